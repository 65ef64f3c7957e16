"""Parallel text: read and check it, encode it once, cache the ids on disk, collate batches.

A corpus is two plain UTF-8 files, one sentence per line, line i of one the translation of line i
of the other. Reading checks what users get wrong (a missing file, line counts that differ, bytes
that are not UTF-8) and names the file and the line (`aiayn.data.lines`). Pairs with an empty side (no
text: `has_text`) are dropped and counted; encoding (`load_encoded`) also drops those whose text encodes
to no pieces.

Encoding reads the files in chunks, so that memory holds the ids, not the whole corpus as Python
strings and lists. The ids are cached as safetensors (flat int32 ids + offsets, never pickle) beside
the run, keyed by the files' identity and the tokenizer's bytes, so that epochs and restarts do not
re-tokenize; a new cache of the same files replaces their earlier ones.

Dimension key: B batch, S source length, T target length.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain, compress, islice
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

# read_lines: here before lines.py held it, and still to be imported from here
from aiayn.data.lines import line_blocks, read_lines, require_same_count  # noqa: F401
from aiayn.data.tokenizer import (
    MAX_LINE_BYTES, MIN_CHARACTER_COVERAGE, SEED_SENTENCES, SHARED, SOURCE, TARGET, Tokenizer,
    sentencepiece_model, write_model,
)
from aiayn.errors import UserError
from aiayn.files import (
    atomic_output, fsync_dir, fsync_file, new_file_mode, raise_dropped_stop, require_file, temporary_path,
)
from aiayn.model.transformer import target_positions
from aiayn.train.config import toml_value
from aiayn.train.progress import throttled_progress

log = logging.getLogger(__name__)
CACHE_FORMAT = "aiayn-ids-2"  # 2: pairs that encode to no pieces are dropped (1 kept them)
TOKENIZER_INPUTS = "tokenizer_inputs.json"  # beside the run's SentencePiece model(s): what trained them



BLANK_CATEGORIES = ("Zs", "Zl", "Zp", "Cc", "Cf")  # separators, controls, formats (U+200B, bidi marks)


def has_text(line: str) -> bool:
    """Whether `line` has something to translate: not only whitespace, control and format characters (a
    zero-width space, a stray \\x01). SentencePiece's nmt_nfkc deletes most of those, leaving no pieces:
    a source of EOS alone, an empty target."""
    if line.isprintable():  # the usual line, checked at C speed: only its spaces can be blank
        return bool(line.strip())
    return any(unicodedata.category(c) not in BLANK_CATEGORIES for c in line)


@dataclass
class ParallelText:
    src: list[str]  # source sentences, empty pairs already dropped
    tgt: list[str]  # target sentences, aligned with src
    dropped_empty: int  # pairs with an empty side that were dropped


def read_parallel(src_path: str | Path, tgt_path: str | Path, report: bool = True) -> ParallelText:
    """Read two aligned files; drop (and count) pairs with an empty side (see `has_text`): the pairs
    `scan_parallel` keeps, held in memory (the count logged with `report`)."""
    files = scan_parallel(src_path, tgt_path, report)
    return ParallelText(list(files.src), list(files.tgt), files.dropped_empty)


def _log_dropped(
    src_path: str | Path, tgt_path: str | Path, dropped: int, pairs: int, empty: tuple[int, int],
    report: bool = True, why: str = "an empty side", no_pieces: tuple[int, int] = (0, 0),
) -> None:
    """Log the pairs dropped (with `report`) and how many lines of each file were empty, or had text of no
    pieces (`no_pieces`, counted in the pairs encoded); refuse a corpus that had nothing else, naming the
    file that has nothing when one has (the source was blamed for an empty target, the target's few empty
    lines for a source whose every line encoded to nothing)."""
    paths = (src_path, tgt_path)
    counts = [f"{n} empty in {path}" for path, n in zip(paths, empty) if n]
    counts += [f"{n} of no pieces in {path}" for path, n in zip(paths, no_pieces) if n]
    sides = f" ({', '.join(counts)})" if counts else ""
    if dropped and report:
        log.info("%s, %s: dropped %d pair(s) of %d with %s%s", src_path, tgt_path, dropped, pairs, why, sides)
    if dropped < pairs:
        return
    if not pairs:  # no line at all: "all 0 are empty or blank" said it as a riddle
        raise UserError(f"{src_path}, {tgt_path}: both files are empty (no lines)")
    for path, n, text_of_none in zip(paths, empty, no_pieces):
        if n + text_of_none == pairs and text_of_none:  # distinct lines: empty ones, and encoded ones
            blank = f"{n} empty or blank, " if n else ""
            raise UserError(f"{path}: no line has pieces ({blank}{text_of_none} of text the tokenizer "
                            "encodes to nothing, such as U+FFFD under nmt_nfkc)")
        if n == pairs:
            raise UserError(f"{path}: no line has text (all {pairs} are empty or blank)")
    has = "pieces" if any(no_pieces) else "text"
    raise UserError(f"{src_path}, {tgt_path}: no pair has {has} on both sides{sides}")


@dataclass
class EncodedCorpus:
    """Token ids of a parallel corpus, flat: source sentence i is `src_ids[src_offsets[i]:src_offsets[i+1]]`.

    Sources end with EOS; targets are bare (collate adds BOS/EOS). Flat int32 tensors rather than
    lists of lists: 4.5 M WMT pairs take about 1 GB, not 10 GB of Python integers, in every process.
    """

    src_ids: torch.Tensor  # (total source tokens,) int32
    src_offsets: torch.Tensor  # (N + 1,) int64
    tgt_ids: torch.Tensor  # (total target tokens,) int32
    tgt_offsets: torch.Tensor  # (N + 1,) int64

    @classmethod
    def from_lists(cls, src: list[list[int]], tgt: list[list[int]]) -> "EncodedCorpus":
        return cls.from_lengths(*_flat(src), *_flat(tgt))

    @classmethod
    def from_lengths(
        cls, src_ids: np.ndarray, src_lengths: np.ndarray, tgt_ids: np.ndarray, tgt_lengths: np.ndarray
    ) -> EncodedCorpus:
        """From flat int32 ids and each sentence's length (int64), without copying the ids."""
        src, tgt = torch.from_numpy(src_ids), torch.from_numpy(tgt_ids)
        return cls(src, _offsets(src_lengths), tgt, _offsets(tgt_lengths))

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    def digest(self) -> str:
        """sha256 of the ids and offsets: the same pairs, whatever their files' names, copies or times."""
        h = hashlib.sha256()
        for t in (self.src_ids, self.src_offsets, self.tgt_ids, self.tgt_offsets):
            h.update(t.contiguous().numpy())
        return h.hexdigest()

    def source(self, i: int) -> list[int]:
        return self.src_ids[self.src_offsets[i] : self.src_offsets[i + 1]].tolist()

    def target(self, i: int) -> list[int]:
        return self.tgt_ids[self.tgt_offsets[i] : self.tgt_offsets[i + 1]].tolist()

    def src_lengths(self) -> list[int]:
        return self.src_offsets.diff().tolist()

    def tgt_lengths(self) -> list[int]:
        """Target lengths as the decoder sees them: pieces + BOS (input) or + EOS (output)."""
        return (self.tgt_offsets.diff() + 1).tolist()

    def fits(self, max_len: int) -> torch.Tensor:
        """(N,) bool: whether a pair's source (with EOS) and target (with EOS) are `max_len` long at most."""
        return (self.src_offsets.diff() <= max_len) & (self.tgt_offsets.diff() + 1 <= max_len)

    def filter_length(self, max_len: int) -> tuple["EncodedCorpus", int]:
        """Drop pairs whose source (with EOS) or target (with EOS) is longer than `max_len` (the corpus
        itself if none is)."""
        keep = self.fits(max_len)  # (N,) bool
        if keep.all():  # the usual case: no copy of ids that are GBs for WMT
            return self, 0
        kept = EncodedCorpus(
            *_select(self.src_ids, self.src_offsets, keep), *_select(self.tgt_ids, self.tgt_offsets, keep)
        )
        return kept, len(self) - len(kept)


def _flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, lengths) of `seqs`: (total,) int32 and (N,) int64, with no flat Python list between."""
    lengths = np.fromiter(map(len, seqs), np.int64, len(seqs))
    return np.fromiter(chain.from_iterable(seqs), np.int32, int(lengths.sum())), lengths


def _offsets(lengths: np.ndarray) -> torch.Tensor:
    """(N + 1,) int64: where each sentence starts, and the end."""
    return torch.from_numpy(np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths, dtype=np.int64)]))


def _select(
    ids: torch.Tensor, offsets: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sentences where `keep` (N,) is True, flat again, through a one-byte-a-token mask."""
    lengths = offsets.diff()  # (N,)
    kept_tokens = torch.repeat_interleave(keep, lengths)  # (total tokens,) bool
    return ids[kept_tokens], torch.cat([torch.zeros(1, dtype=torch.int64), lengths[keep].cumsum(0)])


def cache_key(src_path: Path, tgt_path: Path, tokenizer: Tokenizer) -> str:
    """Identity of an encoding: both files (path, size, mtime, and inode and ctime, which an edit or a
    replacement changes even when `touch -d` puts the old mtime back), the tokenizer models' bytes and, for an
    imported tokenizer (Marian), its piece -> id vocabularies and special ids: the same SentencePiece
    model gives other ids through them."""
    h = hashlib.sha256(CACHE_FORMAT.encode())
    for p in (src_path, tgt_path):
        st = Path(p).stat()
        # fsencode: a name's own bytes, UTF-8 or not (str.encode refused b"s\xff.de" as a traceback)
        h.update(os.fsencode(Path(p).resolve()))
        h.update(f"|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}".encode())
    for model in tokenizer.models():  # the files' bytes, as when they were read from disk
        if model is not None:
            h.update(model)
    if tokenizer.vocab is not None:  # absent for aiayn's own tokenizers, so their keys stay as they were
        specials = [tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id]
        mapping = [tokenizer.vocab, tokenizer.tgt_vocab, specials]
        h.update(json.dumps(mapping, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def encoded_cache(src_path: Path, tgt_path: Path, tokenizer: Tokenizer, cache_dir: str | Path,
                  ) -> tuple[Path, str]:
    """(the cache file of this encoding of two files, its full key)."""
    key = cache_key(src_path, tgt_path, tokenizer)
    return Path(cache_dir) / f"{_cache_stem(src_path, tgt_path)}.{key[:16]}.safetensors", key


CACHE_NAME_BYTES = 80  # at most, of each file's name in its cache's name: two names of 134 characters made
# one longer than a file name can be (255 bytes), with room left for `temporary_path`'s 40 or so more (so
# that it cuts no cache's name: two caches' temporaries would share one)


def _cache_stem(src_path: Path, tgt_path: Path) -> str:
    """The start of the name of a cache of these files: their names, each cut to CACHE_NAME_BYTES (the key
    that follows tells apart those that are then the same), a byte that is not UTF-8 as U+FFFD:
    safetensors opens no path that is not UTF-8."""
    def cut(name: str) -> str:
        name = os.fsencode(name).decode("utf-8", "replace")
        while len(name.encode()) > CACHE_NAME_BYTES:  # whole characters: a name stays valid UTF-8
            name = name[:-1]
        return name
    return f"{cut(src_path.name)}-{cut(tgt_path.name)}"


def read_encoded(cache: Path, key: str, tokenizer: Tokenizer) -> EncodedCorpus:
    """The corpus that `load_encoded` cached in `cache` under `key`, read as it is and never encoded here:
    how training's other processes take process 0's pairs. Their own look at the files found another
    key for the same bytes on another machine's copy (another inode), encoded them again and deleted
    process 0's cache; for other bytes, it trained each process on its own corpus unnoticed."""
    corpus = None
    if cache.is_file():
        corpus, _ = _read_cache(cache, key, (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size), "")
    if corpus is None:
        raise UserError(f"{cache}: process 0's encoding of the corpus is missing or unreadable on this "
                        "machine; with several machines, put run_dir on a shared filesystem")
    return corpus


def load_encoded(
    src_path: str | Path, tgt_path: str | Path, tokenizer: Tokenizer, cache_dir: str | Path
) -> tuple[EncodedCorpus, int]:
    """Ids from the cache, or read, check, encode and cache them: (corpus, empty pairs dropped)."""
    corpus, dropped, _ = cache_encoded(src_path, tgt_path, tokenizer, cache_dir)
    return corpus, dropped


# What a pair of one file on both sides does, by set: a validation pair's (a typo, va.de for va.en) left
# training as it was, and was said as the training pair's
SAME_FILE = {
    "training": "the model will learn to copy its input",
    "validation": "the model trains as usual, but validation (its loss, the best checkpoint, train.patience, "
                  "BLEU) measures copying the input; check data.valid_src and data.valid_tgt",
}


def cache_encoded(
    src_path: str | Path, tgt_path: str | Path, tokenizer: Tokenizer, cache_dir: str | Path,
    kept: bool = False, kind: str = "training", normalization: str | None = None,
) -> tuple[EncodedCorpus, int, tuple[Path, str]]:
    """`load_encoded`, and the (cache file, key) it read or wrote: what training's process 0 names to the
    others. The key is the one taken before encoding: taken again after, a file touched meanwhile named
    a cache that was never written. Text encoded is checked, with `kept` (a tokenizer trained on other
    text: a fine-tuned or resumed run's), for what its
    normalization rewrites, as training a tokenizer checks its own text; so it is with `normalization`,
    the data.normalization of a tokenizer made elsewhere with that rule (put in the run directory), as
    training one warns and advises. `kind`: the set the files are, "training" or "validation", for the
    warnings to say what their problem does there. The warnings are those of the encoding: a corpus read
    from the cache is not checked again. Its <unk> pieces are the caller's to count (`warn_if_unknown`),
    in the pairs it uses, which another data.max_len changes and the cache's key does not."""
    src_path, tgt_path = Path(src_path), Path(tgt_path)
    for p in (src_path, tgt_path):
        require_file(p)
    cache, key = encoded_cache(src_path, tgt_path, tokenizer, cache_dir)
    if cache.is_file():
        corpus, dropped = _read_cache(cache, key, (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size))
        if corpus is not None:
            log.info("%s: %d pairs from the cache%s", cache, len(corpus),
                     f" ({dropped} pairs with a side empty or of no pieces dropped)" if dropped else "")
            return corpus, dropped, (cache, key)
    if src_path.samefile(tgt_path):  # said once, when encoded; a copy model has its uses, so not an error
        log.warning("%s and %s are the same file: %s", src_path, tgt_path, SAME_FILE[kind])
    files = scan_parallel(src_path, tgt_path, report=False)  # every error in the files before the encoding
    if kept or normalization is not None:
        _warn_if_normalization_changes_text(tokenizer, files, normalization or "", kept=kept, kind=kind)
    corpus, no_pieces = _encode(files, tokenizer)
    pairs = len(files.src) + files.dropped_empty
    dropped = pairs - len(corpus)  # empty pairs and those of text that encodes to no pieces
    _log_dropped(src_path, tgt_path, dropped, pairs, files.empty_lines, why="a side empty or of no pieces",
                 no_pieces=no_pieces)
    _write_cache(cache, key, corpus, dropped, (src_path, tgt_path))
    _remove_stale_caches(cache, src_path, tgt_path)
    log.info("%s: encoded %d pairs, cached in %s", src_path, len(corpus), cache)
    return corpus, dropped, (cache, key)


ENCODE_CHUNK = 20_000  # pairs encoded at once: their Python id lists (~40 bytes an id) stay ~50 MB
PROGRESS_SECONDS = 10.0  # between the progress lines of a long encode


def _encode(files: ParallelFiles, tokenizer: Tokenizer) -> tuple[EncodedCorpus, tuple[int, int]]:
    """Encode the kept pairs of two scanned files ENCODE_CHUNK at a time into int32 arrays, dropping those
    that encode to no pieces: the whole corpus as Python strings and int lists took 15x the files' bytes.
    With it, how many source and target lines had text of no pieces."""
    # Per column, the chunks' arrays: source ids, source lengths, target ids, target lengths.
    columns = tuple([np.empty(0, dtype)] for dtype in (np.int32, np.int64, np.int32, np.int64))
    no_pieces = np.zeros(2, dtype=np.int64)
    chunks = _pair_chunks(files, ENCODE_CHUNK)
    for src, tgt in _with_progress(chunks, files.src.path, len(files.src)):
        parts, none = _encode_chunk(src, tgt, tokenizer)
        for column, part in zip(columns, parts):
            column.append(part)
        no_pieces += none
    corpus = EncodedCorpus.from_lengths(*(np.concatenate(column) for column in columns))
    return corpus, (int(no_pieces[0]), int(no_pieces[1]))


UNKNOWN_TOLERANCE = 0.01  # share of a side's pieces (EOS aside) that may be <unk> without a warning


def warn_if_unknown(src_path: str | Path, tgt_path: str | Path, corpus: EncodedCorpus, unk_id: int,
                    max_len: int | None, kept: bool) -> None:
    """Warn of a side whose pieces (EOS aside) are more than UNKNOWN_TOLERANCE <unk>: characters the
    tokenizer has no piece for, each run of them one unknown token (a line of nothing else is "▁ <unk>",
    half its pieces). A fine-tune on another language or script trained on sentences of a few such tokens,
    its loss looking healthy, and nothing said. Only the pairs `max_len` keeps are counted: one long line
    that training drops warned of 22% of a corpus' pieces, blaming the tokenizer's training text. `kept`:
    the tokenizer was trained on other text (a fine-tuned or resumed run's), which the advice blames."""
    keep = corpus.fits(max_len) if max_len is not None else torch.ones(len(corpus), dtype=torch.bool)  # (N,)
    for path, ids, offsets, eos in ((src_path, corpus.src_ids, corpus.src_offsets, 1),
                                    (tgt_path, corpus.tgt_ids, corpus.tgt_offsets, 0)):
        at = (ids == unk_id).nonzero().flatten()  # (unknown pieces,) positions in the flat ids
        sentence = torch.searchsorted(offsets, at, right=True) - 1  # (unknown pieces,) the pair each is in
        inside = keep[sentence]  # (unknown pieces,) whether the pair each is in is kept
        at, sentence = at[inside], sentence[inside]  # those of the pairs kept
        pieces = int((offsets.diff() - eos)[keep].sum())  # a source's last piece is its EOS
        if len(at) <= UNKNOWN_TOLERANCE * pieces:
            continue
        lines = len(sentence.unique())  # the sentences they are in
        why = ("the tokenizer kept (train.init_from's, or the resumed run's) was trained on other text: "
               "another language or script?" if kept else "the tokenizer's training text (or the sample it "
               "learnt from) lacks them, or data.character_coverage < 1 left them out")
        within = f" within data.max_len={max_len}" * (not bool(keep.all()))
        log.warning("%s: %d of its %d pieces (%.1f%%, in %d of %d lines%s) are <unk>, characters the "
                    "tokenizer has no piece for; %s", path, len(at), pieces, 100 * len(at) / pieces, lines,
                    int(keep.sum()), within, why)


def _pair_chunks(files: ParallelFiles, size: int) -> Iterator[tuple[list[str], list[str]]]:
    """(source lines, target lines) of the kept pairs, `size` pairs at a time (the last may be shorter).
    Both sides keep the same pairs, so their chunks align; a file changed meanwhile is a UserError
    (`KeptLines`)."""
    src_lines, tgt_lines = iter(files.src), iter(files.tgt)
    while src := list(islice(src_lines, size)):
        yield src, list(islice(tgt_lines, len(src)))
    next(tgt_lines, None)  # runs the target's end-of-file check


def _with_progress(
    chunks: Iterator[tuple[list[str], list[str]]], path: Path, pairs: int
) -> Iterator[tuple[list[str], list[str]]]:
    """`chunks`, passed on, with a progress line every PROGRESS_SECONDS: none for a quick encode."""

    def say(done: int, percent: float, per_second: float) -> None:
        log.info("%s: encoded %d of %d pairs (%.0f%%, %.0f pairs/s)", path, done, pairs, percent, per_second)

    progress = throttled_progress(pairs, PROGRESS_SECONDS, say)
    for src, tgt in chunks:
        raise_dropped_stop()  # a Ctrl-C or SIGTERM Python dropped (the CLI records it): not after the encode
        yield src, tgt
        progress(len(src))


def _encode_chunk(
    src: list[str], tgt: list[str], tokenizer: Tokenizer
) -> tuple[tuple[np.ndarray, ...], list[int]]:
    """(source ids, lengths, target ids, lengths) of the pairs that have pieces on both sides (the pairs
    given have text on both: `has_text`), and the [source, target] lines of text but no pieces."""
    threads = torch.get_num_threads()  # train.threads: 1 on a busy machine, not one per core
    x, y = tokenizer.encode_src_batch(src, threads), tokenizer.encode_tgt_batch(tgt, threads)
    # Text can still have no pieces: nmt_nfkc deletes U+FFFD (the replacement character) and U+2581
    src_pieces = [len(a) > 1 for a in x]  # a source's last id is its EOS
    tgt_pieces = [len(b) > 0 for b in y]
    pieces = [a and b for a, b in zip(src_pieces, tgt_pieces)]
    none = [src_pieces.count(False), tgt_pieces.count(False)]
    return (*_flat(list(compress(x, pieces))), *_flat(list(compress(y, pieces)))), none


def _write_cache(
    path: Path, key: str, corpus: EncodedCorpus, dropped: int, files: tuple[Path, Path]
) -> None:
    """Write to a temporary name, flush it to disk, then rename: a killed run (or a power loss) never
    leaves half a cache. The metadata names the encoded `files`, so that `_remove_stale_caches` knows
    whose cache it is."""
    tmp = temporary_path(path)  # a killed writer's is removed by the next run
    tensors = dict(
        src_ids=corpus.src_ids,
        src_offsets=corpus.src_offsets,
        tgt_ids=corpus.tgt_ids,
        tgt_offsets=corpus.tgt_offsets,
    )
    src, tgt = map(_path_text, files)
    metadata = {"key": key, "dropped_empty": str(dropped), "format": CACHE_FORMAT, "src": src, "tgt": tgt}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata=metadata)
        os.chmod(tmp, new_file_mode())  # safetensors makes it 0600, whatever the umask: as the run's other files
        fsync_file(tmp)  # as `atomic_output` does: after a power loss, the whole file or none
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename too
    except (OSError, SafetensorError) as e:  # a full disk: safetensors reports it as a SafetensorError
        with contextlib.suppress(OSError):  # cache/ a file: unlinking under it fails the same way
            tmp.unlink(missing_ok=True)
        reason = getattr(e, "strerror", None) or e
        raise UserError(f"{path}: cannot write the encoded-ids cache ({reason})") from None
    except BaseException:  # Ctrl-C mid-write: the temporary (named by pid, so never reused) goes too
        tmp.unlink(missing_ok=True)
        raise


def _remove_stale_caches(kept: Path, src_path: Path, tgt_path: Path) -> None:
    """Delete the caches of earlier versions of these files (another mtime or size, or another file a
    symlink now points at) or of an earlier tokenizer beside `kept`: hundreds of MB each, never read
    again. Only files with a cache's name for these file names go, and of those only caches of the same
    paths or of an older CACHE_FORMAT (which no key matches any more): a cache of other files of the
    same names (valid/de.txt beside train/de.txt, in one run) stays. The same paths are the names given,
    not the files they resolve to: a symlink repointed to a new corpus left the old one's cache."""
    name = re.compile(re.escape(f"{_cache_stem(src_path, tgt_path)}.") + r"[0-9a-f]{16}\.safetensors")
    named = (_path_text(src_path), _path_text(tgt_path))
    resolved = (_path_text(src_path.resolve()), _path_text(tgt_path.resolve()))  # what caches recorded before
    for old in kept.parent.iterdir():
        if (old.name != kept.name and name.fullmatch(old.name) and old.is_file()  # a directory: not ours
                and _cache_files(old) in (named, resolved, None)):
            old.unlink(missing_ok=True)
            log.info("%s: removed, an earlier encoding of %s", old, src_path)


def _path_text(path: Path) -> str:
    """`path` made absolute, its symlinks not followed (the name given, which a symlink repointed keeps),
    as text that UTF-8 can hold (a cache's metadata): a byte of a name that is not UTF-8 written as \\xff,
    where the name itself failed to be written."""
    return os.fsencode(os.path.abspath(path)).decode("utf-8", "backslashreplace")


def _cache_files(path: Path) -> tuple[str, str] | None:
    """The (source, target) paths a cache was encoded from; None if no aiayn reads it any more (an older
    CACHE_FORMAT, whose key can no longer match, or a damaged file)."""
    try:
        meta, _ = _open_cache(path)
    except Exception:  # whatever safetensors raises for a file that is not one
        return None
    return (meta.get("src"), meta.get("tgt")) if meta.get("format") == CACHE_FORMAT else None


def _read_cache(path: Path, key: str, vocab_sizes: tuple[int, int], then: str = "; re-encoding",
                ) -> tuple[EncodedCorpus | None, int]:
    """The corpus a cache holds and its count of dropped pairs; (None, 0) if it is another encoding's, or
    damaged (then said, with what the caller does `then`)."""
    try:
        meta, t = _open_cache(path, key)
        if not t:
            return None, 0
        problem = _cache_problem(meta, t, vocab_sizes)
    except OSError as e:  # one we may not read (mode 000, another user's): rebuilt too
        problem = e.strerror or str(e)
    except Exception as e:  # a damaged cache is rebuilt, not fatal
        problem = str(e) or type(e).__name__
    if problem:
        log.warning("%s: unreadable cache (%s)%s", path, problem, then)
        return None, 0
    corpus = EncodedCorpus(t["src_ids"], t["src_offsets"], t["tgt_ids"], t["tgt_offsets"])
    return corpus, int(meta["dropped_empty"])


def _cache_problem(meta: dict[str, str], t: dict[str, torch.Tensor], vocab_sizes: tuple[int, int]) -> str:
    """What is wrong with a cache's tensors ("" if nothing): each side's ids 1-D int32 within its
    vocabulary, offsets 1-D int64 from 0, never decreasing, ending at the ids' length, as many sentences
    on both sides. A file edited by hand or by another program failed later with an IndexError, or
    trained on garbage."""
    if sorted(t) != ["src_ids", "src_offsets", "tgt_ids", "tgt_offsets"]:
        return f"tensors {sorted(t)}"
    if not meta.get("dropped_empty", "").isdigit():
        return f"dropped_empty={meta.get('dropped_empty')!r}"
    for side, vocab in zip(("src", "tgt"), vocab_sizes):
        ids, offsets = t[f"{side}_ids"], t[f"{side}_offsets"]
        if ids.dtype != torch.int32 or offsets.dtype != torch.int64 or ids.dim() != 1 or offsets.dim() != 1:
            return f"{side} tensors: {ids.dtype}, {offsets.dtype}; {ids.dim()}, {offsets.dim()} dimensions"
        if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(ids) or bool((offsets.diff() < 0).any()):
            return f"{side} offsets that do not cut the ids"
        if len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            return f"{side} ids outside the vocabulary of {vocab}"
    if len(t["src_offsets"]) != len(t["tgt_offsets"]):
        return "unequal numbers of source and target sentences"
    return ""


def _open_cache(path: Path, key: str | None = None) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A cache file's metadata, and its tensors if its key is `key` (else none)."""
    with open(path, "rb"):  # safetensors says "No such file or directory" of any file it cannot open
        pass
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        same = key is not None and meta.get("key") == key
        return meta, {name: f.get_tensor(name) for name in f.keys()} if same else {}


@dataclass
class Batch:
    src: torch.Tensor  # (B, S) source ids ending in EOS, right-padded
    tgt_in: torch.Tensor  # (B, T) BOS + target, right-padded: the decoder input
    tgt_out: torch.Tensor  # (B, T) target + EOS, right-padded: what the decoder must predict
    n_tokens: int  # real target tokens (the loss' normalizer)
    positions: torch.Tensor  # (N,) flat indices of the N = n_tokens non-pad positions of tgt_out
    targets: torch.Tensor  # (N,) their target ids: tgt_out.flatten()[positions]

    @classmethod
    def of(cls, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, pad_id: int) -> Batch:
        """The batch of these padded tensors, its real targets found here, on the host, not on a GPU."""
        positions = target_positions(tgt_out, pad_id)  # (N,)
        return cls(src, tgt_in, tgt_out, len(positions), positions, tgt_out.flatten()[positions])

    def to(self, device: torch.device | str) -> Batch:
        """The batch on `device`; to a GPU through pinned memory, without blocking. A copy from ordinary
        memory waits until the GPU has finished all its queued work (a host-device sync), so the host
        could not collate the next batch while the GPU trains on this one."""
        tensors = (self.src, self.tgt_in, self.tgt_out, self.positions, self.targets)
        if torch.device(device).type == "cuda":
            tensors = tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)
        else:
            tensors = tuple(t.to(device) for t in tensors)
        src, tgt_in, tgt_out, positions, targets = tensors
        return Batch(src, tgt_in, tgt_out, self.n_tokens, positions, targets)


def collate(corpus: EncodedCorpus, indices: list[int], tokenizer: Tokenizer) -> Batch:
    """Pad the pairs at `indices` into one batch (decoder input BOS + y, output y + EOS).

    Each side is one gather from the flat ids. The former Python loop over rows took 3 ms for a batch of
    2,048 tokens and 25 ms for 25,000 on one CPU core (now 0.2 and 0.9 ms), a sizeable part of a GPU's
    training step on them."""
    pad, bos, eos = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
    rows = torch.as_tensor(indices, dtype=torch.long)  # (B,)
    src = _padded(corpus.src_ids, corpus.src_offsets, rows, pad)  # (B, S): the sources carry their EOS
    y = _padded(corpus.tgt_ids, corpus.tgt_offsets, rows, pad, extra=1)  # (B, T): y, then at least one pad
    lengths = corpus.tgt_offsets[rows + 1] - corpus.tgt_offsets[rows]  # (B,)
    tgt_out = y.clone()  # (B, T)
    tgt_out[torch.arange(len(rows)), lengths] = eos  # on each row's first pad
    bos_column = torch.full((len(rows), 1), bos, dtype=torch.long)  # (B, 1)
    tgt_in = torch.cat([bos_column, y[:, :-1]], dim=1)  # (B, T): y shifted right, dropping a column of pads
    return Batch.of(src, tgt_in, tgt_out, pad)


def _padded(
    ids: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, pad: int, extra: int = 0
) -> torch.Tensor:
    """(B, L + extra) long: the sentences `rows` (B,) of the flat `ids`, right-padded with `pad` to the
    longest one's length L, and `extra` columns more."""
    starts = offsets[rows]  # (B,)
    lengths = offsets[rows + 1] - starts  # (B,)
    columns = torch.arange(int(lengths.max()) + extra)  # (L + extra,)
    real = columns < lengths[:, None]  # (B, L + extra): inside the sentence
    if not len(ids):  # every sentence empty (EncodedCorpus.from_lists allows it): nothing to gather
        return torch.full(real.shape, pad, dtype=torch.long)
    # Every position reads an id (the pads ids[0], then dropped): 40% faster than gathering real ones only.
    at = torch.where(real, starts[:, None] + columns, 0)  # (B, L + extra): where in `ids`
    return torch.where(real, ids[at].long(), pad)  # (B, L + extra)


class KeptLines:
    """One side's lines of the pairs `read_parallel` keeps, read from the file again on each pass rather
    than held: the corpus as Python strings set the peak memory of a run's data preparation when the run
    trained its tokenizer (1.69 GB for a million WMT-length pairs, 1.15 GB streamed)."""

    def __init__(self, path: str | Path, keep: np.ndarray) -> None:
        self.path = Path(path)
        self.keep = keep  # (lines in the file,) bool: whether line i's pair is kept
        self.count = int(keep.sum())

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[str]:
        done = 0  # lines read
        for block in line_blocks(self.path):
            yield from compress(block, self.keep[done : done + len(block)].tolist())
            done += len(block)
        if done != len(self.keep):  # its lines were counted when `keep` was made
            raise UserError(f"{self.path}: changed while being read")


@dataclass
class ParallelFiles:
    """ParallelText's interface, streamed from the files: src and tgt iterate the kept lines, and len()
    counts them."""

    src: KeptLines
    tgt: KeptLines
    dropped_empty: int  # pairs with an empty side, not iterated
    empty_lines: tuple[int, int] = (0, 0)  # empty (or blank) lines in the source file and in the target file


def scan_parallel(src_path: str | Path, tgt_path: str | Path, report: bool = True) -> ParallelFiles:
    """The pairs `read_parallel` keeps, the files checked and the empty pairs counted (with `report`,
    logged, as CRs inside lines are) and refused if all are, as it does, in one pass over each file; what
    is held is a byte per pair, not the text."""
    done = "read" if report else None  # CRs inside lines said by the reading that follows, once
    src_text, tgt_text = _has_text_per_line(src_path, done), _has_text_per_line(tgt_path, done)
    require_same_count(src_path, len(src_text), tgt_path, len(tgt_text))
    keep = src_text & tgt_text
    dropped = len(keep) - int(keep.sum())
    empty = (len(keep) - int(src_text.sum()), len(keep) - int(tgt_text.sum()))
    _log_dropped(src_path, tgt_path, dropped, len(keep), empty, report)
    return ParallelFiles(KeptLines(src_path, keep), KeptLines(tgt_path, keep), dropped, empty)


def _has_text_per_line(path: str | Path, done: str | None) -> np.ndarray:
    """(lines,) bool: `has_text` of each line, the file checked whole as `read_lines` checks it (CRs inside
    lines warned of as `line_blocks` does with `done`)."""
    lines = chain.from_iterable(line_blocks(Path(path), done=done))
    return np.fromiter(map(has_text, lines), dtype=bool)


def train_tokenizer(
    text: ParallelText | ParallelFiles, directory: str | Path, vocab_size: int, model_type: str = "bpe",
    shared: bool = True, normalization: str = "nmt_nfkc", character_coverage: float = 1.0, seed: int = 0,
) -> Tokenizer:
    """Train SentencePiece on the training text: one model for both sides (the paper) or one per side.
    `text` is held (`read_parallel`) or streamed from its files (`scan_parallel`); both feed SentencePiece
    the same lines in the same order, so give the same model byte for byte. A model learns from at most
    SEED_SENTENCES lines: of more, a sample that `seed` chooses (`_sampled`), the same in every process.

    Then warn (once) if the model's normalization rewrites a sizeable share of the text, since the model
    will translate into the rewritten form (a Persian ZWNJ becomes a space under "nmt_nfkc")."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    settings = dict(normalization=normalization, character_coverage=character_coverage)
    n = len(text.src)
    if n >= LARGE_CORPUS:
        log.info("SentencePiece training on %d pairs (a sample of at most %d sentences per model) may take "
                 "minutes", n, SEED_SENTENCES)
    if shared:  # chained, not text.src + text.tgt: no second list of every sentence
        both = chain(_noting_long_lines(text.src, "source"), _noting_long_lines(text.tgt, "target"))
        lines = _sampled(both, 2 * n, seed)
        write_model(directory / SHARED, _train_spm(lines, vocab_size, model_type, **settings))
        tokenizer = Tokenizer(directory / SHARED)
    else:  # one seed: both models learn from the same pairs
        models = _side_models(text, n, seed, vocab_size, model_type, settings)
        for name, model in zip((SOURCE, TARGET), models):  # Tokenizer.save's names
            write_model(directory / name, model)
        tokenizer = Tokenizer(directory / SOURCE, directory / TARGET)
    _warn_if_normalization_changes_text(tokenizer, text, normalization)
    _warn_if_fewer_pieces(tokenizer, vocab_size, shared)
    return tokenizer


def _side_models(
    text: ParallelText | ParallelFiles, n: int, seed: int, vocab_size: int, model_type: str, settings: dict,
) -> tuple[bytes, bytes]:
    """The source's model and the target's, both trained before either is written: a refused target, or a
    kill between the two, left the source's model behind under a name no cleanup knew (source.model). A
    source refused for more characters than data.vocab_size holds is said with what the target needs too,
    counted without training it: raised to the source's size alone, the next run trained the source
    again, only for the target to be refused with a larger one."""
    src_side, tgt_side = _side("source", text.src), _side("target", text.tgt)
    try:
        src_lines = _noting_long_lines(text.src, "source")
        src = _train_spm(_sampled(src_lines, n, seed), vocab_size, model_type, src_side, **settings)
    except _TooManyCharacters as e:
        tgt = _characters_needed(_sampled(text.tgt, n, seed), model_type, **settings)
        if tgt is None or tgt <= vocab_size:  # the target fits: the source's size is the one to say
            raise
        both = _too_many_characters(vocab_size, [e.needed, tgt], settings["character_coverage"])
        raise UserError(f"{src_side} and {tgt_side}: {both}") from None
    tgt_lines = _noting_long_lines(text.tgt, "target")
    return src, _train_spm(_sampled(tgt_lines, n, seed), vocab_size, model_type, tgt_side, **settings)


LONG_LINE_CHARACTERS = MAX_LINE_BYTES // 4  # a character is 4 UTF-8 bytes at most: a line of no more is short


def _noting_long_lines(lines: list[str] | KeptLines, side: str) -> Iterator[str]:
    """`lines`, and once all are read, a warning of those SentencePiece leaves out of the tokenizer's
    training: over MAX_LINE_BYTES in UTF-8 (its max_sentence_length), which it says only in the log that
    minloglevel=2 hides (a line of characters found nowhere else was then "▁ <unk>"). Only a line of more
    than LONG_LINE_CHARACTERS is encoded to be measured: the usual line costs a len()."""
    count, first = 0, 0
    for i, line in enumerate(lines):
        if len(line) > LONG_LINE_CHARACTERS and len(line.encode("utf-8", "surrogatepass")) > MAX_LINE_BYTES:
            first = first if count else i
            count += 1
        yield line
    if not count:
        return
    if isinstance(lines, KeptLines):  # streamed: the file's own line number
        name, where = lines.path, f"line {int(np.flatnonzero(lines.keep)[first]) + 1}"
    else:  # held: the number among the lines kept
        name, where = f"{side} side", f"kept line {first + 1}"
    log.warning("%s: %d line%s over %s bytes (%s%s) left out of the tokenizer's training (SentencePiece's "
                "limit)", name, count, "s" * (count > 1), f"{MAX_LINE_BYTES:,}", "the first: " * (count > 1),
                where)


def _warn_if_fewer_pieces(tokenizer: Tokenizer, vocab_size: int, shared: bool) -> None:
    """SentencePiece stops early when the text holds no more pieces (hard_vocab_limit=False): say so, since
    the run's configuration still shows the size asked for; separate vocabularies by side (sorted sizes
    left the reader to guess which was which)."""
    src, tgt = tokenizer.src_vocab_size, tokenizer.tgt_vocab_size
    if min(src, tgt) < vocab_size:
        made = f"{src}" if shared else f"{src} source and {tgt} target"
        log.warning("SentencePiece made %s pieces, fewer than data.vocab_size=%d: the training text holds no "
                    "more (BPE: no more merges; unigram: no more substrings worth keeping); the model's "
                    "vocabulary is what was made", made, vocab_size)


LARGE_CORPUS = 100_000  # pairs: training a tokenizer on more takes long enough to say so
SAMPLE_BLOCK = 1 << 20  # lines whose sample flags are drawn at once: memory for a block, not the corpus


def _sampled(lines: Iterable[str], n: int, seed: int) -> Iterable[str]:
    """The `n` `lines`, or of more than SEED_SENTENCES, that many of them, in their order, chosen by a
    generator seeded with `seed`. Every line is still read: a streamed file's end-of-file check runs."""
    if n <= SEED_SENTENCES:
        return lines
    flags = _sample_flags(n, SEED_SENTENCES, seed)
    return (line for line in lines if next(flags, False))


def _sample_flags(n: int, k: int, seed: int) -> Iterator[bool]:
    """`n` flags, `k` of them True, a uniform choice of `seed`'s generator, drawn SAMPLE_BLOCK at a time:
    how many of the k fall in a block is a hypergeometric draw (k taken from the n left, without
    replacement), then which of its lines they are, a choice within the block."""
    rng = np.random.default_rng(seed)
    for start in range(0, n, SAMPLE_BLOCK):
        size = min(SAMPLE_BLOCK, n - start)
        take = int(rng.hypergeometric(size, n - start - size, k))
        block = np.zeros(size, dtype=bool)
        block[rng.choice(size, take, replace=False)] = True
        k -= take
        yield from block.tolist()


def _train_spm(
    lines: Iterable[str], vocab_size: int, model_type: str, side: str = "",
    normalization: str = "nmt_nfkc", character_coverage: float = 1.0,
) -> bytes:
    """sentencepiece_model, with SentencePiece's refusals (RuntimeError) as a line naming the setting and,
    for one of two models, the `side` it is. What reading the lines raises (a UserError naming the file,
    Ctrl-C, MemoryError) comes out as itself: they are read here, and sent to SentencePiece's process (in
    its own, SentencePiece wrapped it in a RuntimeError, "INTERNAL: KeyboardInterrupt: ...", which Ctrl-C's
    exit status 130 became a vocabulary error's 2)."""
    try:
        model = sentencepiece_model(lines, vocab_size, model_type, character_coverage, normalization)
    except RuntimeError as e:  # "INTERNAL: trainer_interface.cc(638) [check] Vocabulary size is smaller ..."
        refusal = _refusal(str(e), vocab_size, character_coverage)
        message = f"{side}: {refusal}" if side else refusal
        if (needed := _required_chars(str(e))) is not None:
            raise _TooManyCharacters(message, needed) from None
        raise UserError(message) from None
    # SentencePiece 0.2.3 refuses a text of no character it keeps (all_chars_count > 0); 0.2.2 made a model
    # of the special pieces alone, which reads every line as unknown pieces, and training went on with it
    if spm.SentencePieceProcessor(model_proto=model).get_piece_size() <= SPECIAL_PIECES:
        raise UserError(f"{side}: {NO_CHARACTER}" if side else NO_CHARACTER)
    return model


class _TooManyCharacters(UserError):
    """SentencePiece's refusal of a vocabulary smaller than the text's characters and the special pieces,
    `needed` pieces in all."""

    def __init__(self, message: str, needed: int = 0) -> None:  # a default: type(e)(message) rewords one
        super().__init__(message, needed)  # both in args: pickled whole (a process pool sends it back)
        self.needed = needed

    def __str__(self) -> str:
        return str(self.args[0])


SPECIAL_PIECES = 4  # pad, bos, eos and unk, in every vocabulary aiayn trains
NO_CHARACTER = ("SentencePiece found no character to learn from: the training text holds none it keeps (only "
                "U+FFFD replacement characters, say: a file decoded wrongly before)")


def _characters_needed(
    lines: Iterable[str], model_type: str, normalization: str, character_coverage: float
) -> int | None:
    """The least data.vocab_size `lines` take (the characters SentencePiece keeps, and the special pieces),
    counted by SentencePiece without training: asked for the special pieces alone, it refuses once it has
    counted the characters, before any merge. None where it refuses for another reason."""
    try:
        sentencepiece_model(lines, SPECIAL_PIECES, model_type, character_coverage, normalization)
    except RuntimeError as e:
        return _required_chars(str(e))
    return None  # a text of one character takes 5


def _required_chars(error: str) -> int | None:
    """The vocabulary size SentencePiece's RuntimeError `error` says the text needs, if it is that refusal."""
    chars = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", error)
    return int(chars.group(1)) if chars else None


def _side(side: str, lines: list[str] | KeptLines) -> str:
    """"target side (train.en)": which model of two SentencePiece refused, and its file when streamed."""
    return f"{side} side ({lines.path})" if isinstance(lines, KeptLines) else f"{side} side"


def _refusal(error: str, vocab_size: int, character_coverage: float) -> str:
    """One line for SentencePiece's RuntimeError `error`, naming the setting that fixes it."""
    reason = " ".join(error.rsplit("] ", 1)[-1].split()) or "RuntimeError"  # after the C++ check, one line
    if needed := _required_chars(error):  # SentencePiece's advice names --character_coverage, not aiayn's
        return _too_many_characters(vocab_size, [needed], character_coverage)
    if "sentences_.empty()" in error or not reason:  # every line skipped: none to learn from
        return (f"SentencePiece found no line to learn from: every line of the training text is empty "
                f"or longer than {MAX_LINE_BYTES:,} bytes")
    # was blamed on data.vocab_size, with "(RuntimeError)" for a reason; a unigram model of SentencePiece
    # 0.2.2 fails its own check, required_chars_ empty, where 0.2.3 counts the characters first
    if "all_chars_count" in error or "required_chars_.empty()" in error:
        return NO_CHARACTER
    check = re.search(r"INTERNAL: \S+ \[(.+?)\] ", error)
    if check and "trainer_spec {" in error:  # the text after the failed C++ check is SentencePiece's log
        reason = check.group(1)
    return f"data.vocab_size={vocab_size}: SentencePiece cannot train on this text ({reason})"


USUAL_CJK_COVERAGE = 0.9995  # SentencePiece's advice for Chinese and Japanese


def _too_many_characters(vocab_size: int, needed: list[int], character_coverage: float) -> str:
    """SentencePiece's "Vocabulary size is smaller than required_chars" as advice that can be taken: the
    coverage lowered only where the configuration allows it (0.9995 was advised at 0.9995, and lowering
    it at 0.98, which data.character_coverage refuses to go below). `needed`: of each text refused (one, or
    a source and a target), the characters kept, plus the special pieces."""
    covered = "" if character_coverage == 1.0 else f" at data.character_coverage={character_coverage}"
    counts = " and ".join(str(n - SPECIAL_PIECES) for n in needed)
    has = f"the texts have {counts}" if len(needed) > 1 else f"the text has {counts}"
    fix = f"raise data.vocab_size to at least {max(needed)}"
    if character_coverage > USUAL_CJK_COVERAGE:
        fix += f", or lower data.character_coverage ({USUAL_CJK_COVERAGE} is usual for Chinese and Japanese)"
    elif character_coverage > MIN_CHARACTER_COVERAGE:
        fix += f", or lower data.character_coverage ({MIN_CHARACTER_COVERAGE} at the lowest)"
    return (f"data.vocab_size={vocab_size}: {has} distinct characters{covered}, too many for the vocabulary "
            f"and its {SPECIAL_PIECES} special pieces; {fix}")


ROUND_TRIP_SAMPLE = 2000  # lines per side checked after training a tokenizer
ROUND_TRIP_TOLERANCE = 0.01  # share of sampled lines the normalization may change without a warning


# What a kept tokenizer's rewriting does to each set's text ("training" or "validation"). The validation's
# was said as the training's, "the model will learn to write it so", of text it never learns from. {does}:
# what the model does with the text (`_what_the_model_does`).
KEPT_REWRITES = {
    "training": "the model will {does} it so",
    "validation": "the model trains as usual, but is validated on it as rewritten",
}


def _warn_if_normalization_changes_text(
    tokenizer: Tokenizer, text: ParallelText | ParallelFiles, normalization: str, kept: bool = False,
    kind: str = "training",
) -> None:
    """Log one warning if the tokenizer's normalization changes more than 1% of a sample of either side's
    training text (whitespace aside: SentencePiece always collapses it; case aside where the rule folds
    it, "nmt_nfkc_cf" and "nfkc_cf": what was asked; a source composed to NFC aside: the text to translate
    is composed alike, and "identity", once advised, made NFC and NFD input other text), naming the first
    changed character, an example line, the file where the text is streamed from one, and the setting
    that keeps the text; of a tokenizer `kept` (trained on other text, which no setting of this run
    changes), what the rewriting does to the `kind` of text it is (`KEPT_REWRITES`)."""
    problems, nfkc_changes = [], False
    for side, lines, sp in (("source", text.src, tokenizer.src), ("target", text.tgt, tokenizer.tgt)):
        sample = _evenly_spaced(lines, ROUND_TRIP_SAMPLE)
        k = len(sample)
        changed, first, nfkc = 0, None, False
        folds = folds_case(sp)
        for line in sample:
            raw = _spaced(line)
            got = _spaced(sp.normalize(line))
            if side == "source" and unicodedata.is_normalized("NFC", got):  # its composition aside, where
                raw = unicodedata.normalize("NFC", raw)  # the rule composed (not "identity"), NFKC's
                # compatibility forms still seen
            want = simple_casefold(raw) if folds else raw  # character for character: `raw`'s positions
            if got != want:
                changed += 1
                first = first or (raw, want, got)
                nfkc = nfkc or _spaced(unicodedata.normalize("NFKC", raw)) != raw
        if changed > ROUND_TRIP_TOLERANCE * k:
            # streamed: the file named (a fine-tune warned of its training and validation pairs alike)
            of = f" of {lines.path}" if isinstance(lines, KeptLines) else ""
            problems.append((side, changed, k, of, first))
            # the advice covers every changed line of each side warned about, not the example's alone: a
            # ZWNJ first and a fullwidth letter later (or on the other side) advised "nfkc", whose run
            # warned again and advised "identity", a second tokenizer trained
            nfkc_changes = nfkc_changes or nfkc
    if not problems:
        return
    counts = "; ".join(f"{changed} of {k} sampled {side} lines{of}" for side, changed, k, of, _ in problems)
    raw, want, got = problems[0][-1]
    at = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    chars = _cluster(raw, at) if at < len(raw) else got[at]  # the text's own character, not its folding
    example = raw[max(0, at - 30) : at + 30]
    fix = _normalization_fix(normalization, nfkc_changes)
    if fix:
        fix += (" and train a new tokenizer (in a new train.run_dir, or delete this one's spm.model, or "
                "source.spm and target.spm)")
    named = " + ".join(f"U+{ord(c):04X} {unicodedata.name(c, '(unnamed)')}" for c in chars)
    does = _what_the_model_does(side for side, *_ in problems)
    if kept:  # a fine-tune's or a resumed run's: the checkpoint's, whatever [data] says
        log.warning("the tokenizer kept (train.init_from's, or the resumed run's) changes this %s text (%s), "
                    "e.g. %s in %r: %s", kind, counts, named, example, KEPT_REWRITES[kind].format(does=does))
        return
    log.warning(
        "data.normalization=%r changes the training text the model will %s (%s), e.g. %s in %r%s",
        normalization, does, counts, named, example, fix,
    )


def _what_the_model_does(sides: Iterable[str]) -> str:
    """What the model does with text of these `sides` rewritten: the target's it learns to write; the
    source's alone it reads, as it will read the text it translates (was said as "learn to write")."""
    return "learn to write" if "target" in sides else "read"


def _normalization_fix(normalization: str, nfkc_changes: bool) -> str:
    """The advice that follows the warning of text that `normalization` rewrites: the rule that keeps it,
    case folding kept where it was asked for. `nfkc_changes`: NFKC rewrites it too."""
    # "nfkc" keeps what nmt_nfkc alone rewrites (the ZWNJ), not a compatibility form (ＩＢＭ, ﬁ) or a
    # decomposed letter (e + U+0301, Hangul jamo), which only "identity" keeps: the advice to try "nfkc"
    # there was followed by the same warning. The same holds of "nfkc_cf" beside "nmt_nfkc_cf"; advising
    # "nfkc" or "identity" there gave up the case folding asked for, unsaid.
    identity = '; set data.normalization = "identity"'
    if normalization in ("nmt_nfkc_cf", "nfkc_cf"):
        if normalization == "nmt_nfkc_cf" and not nfkc_changes:
            return '; set data.normalization = "nfkc_cf"'
        return ('; no rule that folds case keeps it: set data.normalization = "identity" '
                "(which keeps case too)")
    nfkc = '; set data.normalization = "nfkc" (or "identity")'
    return {"nfkc": identity, "identity": ""}.get(normalization, identity if nfkc_changes else nfkc)


def folds_case(sp: spm.SentencePieceProcessor) -> bool:
    """Whether a model's normalization folds case ("nmt_nfkc_cf", "nfkc_cf"): asked, not read, since its
    rule's name is in the model's protobuf, which SentencePiece's Python API does not expose."""
    return _spaced(sp.normalize("A")) == "a"


def simple_casefold(text: str) -> str:
    """`text` case-folded as SentencePiece's *_cf rules fold it: Unicode's simple folding, one character
    for one (ẞ to ß, ß kept), where str.casefold's full folding writes ß as ss and İ as i + U+0307. Checked
    against SentencePiece 0.2 for every character its rules keep otherwise."""
    folded = text.casefold()
    if len(folded) == len(text):  # no character that full folding writes as several: the folds agree
        return folded
    return "".join(map(_simple_fold, text))


def _simple_fold(c: str) -> str:
    """Python has no simple folding: a character's full folding if one character, else its lowercase if
    one (ᾈ to ᾀ, ẞ to ß), else itself (ß, İ)."""
    folded, lower = c.casefold(), c.lower()
    return folded if len(folded) == 1 else lower if len(lower) == 1 else c


def _cluster(text: str, at: int) -> str:
    """The character at `at` with the marks and Hangul vowel or final jamo after it: what composition
    rewrites as one (e + U+0301 -> é), where the first character alone named the base letter."""
    def joins(c: str) -> bool:
        return unicodedata.category(c).startswith("M") or "\u1160" <= c <= "\u11ff"

    end = at + 1
    while end < len(text) and joins(text[end]):
        end += 1
    return text[at:end]


def _evenly_spaced(lines: list[str] | KeptLines, k: int) -> list[str]:
    """min(k, n) of the n `lines`, evenly spaced (line i * n // k), in one pass: `lines` may stream a file."""
    n = len(lines)
    k = min(k, n)
    picks = {i * n // k for i in range(k)}
    return [line for i, line in enumerate(lines) if i in picks]


def _spaced(text: str) -> str:
    """`text` as SentencePiece gives it back in the best case: whitespace runs as one space (its U+2581
    meta symbol, which `normalize` writes for a space, counted as a space too)."""
    return " ".join(text.replace("\u2581", " ").split())


TOKENIZER_DEFAULTS = {"normalization": "nmt_nfkc", "character_coverage": 1.0}  # settings recorded since
# aiayn had them: a tokenizer_inputs.json without one was trained with the value here


def tokenizer_settings(
    vocab_size: int, model_type: str, shared: bool, normalization: str = "nmt_nfkc",
    character_coverage: float = 1.0,
) -> dict:
    """The data settings a trained tokenizer depends on, by their [data] names."""
    return {
        "vocab_size": vocab_size,
        "spm_type": model_type,
        "shared_vocab": shared,
        "normalization": normalization,
        "character_coverage": character_coverage,
    }


def tokenizer_inputs(src_path: str | Path, tgt_path: str | Path, settings: dict) -> dict:
    """What a trained tokenizer depends on: its `tokenizer_settings` and the identity of both training
    files."""
    files = {"train_src": _file_identity(Path(src_path)), "train_tgt": _file_identity(Path(tgt_path))}
    return {**settings, **files}


def _file_identity(path: Path) -> dict:
    """Size and a hash of the whole file ("sha256"), and of its first MB ("sha256_1mb"), which the records
    written before the whole one are compared by. Not the mtime: a copied or re-downloaded corpus is still
    the same corpus. The first MB alone took a corpus edited after it for the one trained on; the whole
    costs about a second a GB (a WMT corpus is GBs), against minutes of training a tokenizer and encoding.
    The path is kept to name it, not to compare."""
    require_file(path)
    try:
        with open(path, "rb") as f:
            first = f.read(1 << 20)
            head, whole = hashlib.sha256(first), hashlib.sha256(first)
            while block := f.read(1 << 20):
                whole.update(block)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    return {"path": str(path.resolve()), "size": path.stat().st_size, "sha256_1mb": head.hexdigest(),
            "sha256": whole.hexdigest()}


def write_tokenizer_inputs(directory: Path, inputs: dict) -> None:
    """Record `inputs` atomically, before the tokenizer is trained: a model never exists without it."""
    with atomic_output(directory / TOKENIZER_INPUTS) as f:
        f.write(json.dumps(inputs, indent=1) + "\n")


def check_tokenizer_inputs(directory: Path, inputs: dict, resumed: bool = False) -> bool:
    """Refuse to reuse a run directory's tokenizer trained from other settings or files. A directory
    without the record (written before it existed) is accepted, as it always was.

    `resumed`: the run has checkpoints, trained with this tokenizer, so it stays. Other tokenizer
    settings are refused (they could not take effect); another corpus is what continuing training on new
    data looks like, so it is only logged, and True returned: the tokenizer is kept for other text."""
    saved = _read_tokenizer_inputs(directory)
    if saved is None:
        return False
    files = _tokenizer_file_changes(saved, inputs)
    if resumed:
        refuse_other_tokenizer_settings(directory, saved, inputs)
        for change in files:
            log.info("%s (--resume keeps the run's tokenizer)", change)
        return bool(files)
    changed = tokenizer_setting_changes(saved, inputs) + files
    if changed:
        raise UserError(
            f"{directory}: its tokenizer was trained for other data ({'; '.join(changed)}); "
            "delete the tokenizer (spm.model, or source.spm and target.spm) to train a new one, "
            "or use a new train.run_dir"
        )
    return False


def refuse_other_tokenizer_settings(where: Path, saved: dict, inputs: dict, written: str = "",
                                    defaults: Iterable[str] = ()) -> None:
    """--resume keeps the tokenizer its checkpoints were trained with: a setting other than the one `saved`
    records (the run dir's record, or a checkpoint's data configuration) could not take effect. `written`:
    where the settings were written, the refusal's start ("run.toml:9: "); `defaults`: those written
    nowhere, left at their default, said so. The remedy is the trained value: "drop the change" was said
    of a default, and of a change dropped the default was refused again."""
    settings = tokenizer_setting_changes(saved, inputs, defaults)
    if settings:
        trained = " and ".join(f"data.{key}={toml_value(_trained_value(saved, key))}"
                               for key in _changed_settings(saved, inputs))
        raise UserError(f"{written}{where}: --resume keeps the tokenizer its checkpoints were trained with "
                        f"({'; '.join(settings)}); set {trained}, or use a new train.run_dir")


def tokenizer_setting_changes(saved: dict, inputs: dict, defaults: Iterable[str] = ()) -> list[str]:
    """Each tokenizer setting of `inputs` (`tokenizer_inputs`) that differs from `saved`, named; those of
    `defaults` said to be the default ("now the default 8000")."""
    return [f"data.{key} was {toml_value(trained)}, now {'the default ' * (key in defaults)}{toml_value(now)}"
            for key, trained, now in tokenizer_differences(saved, inputs)]


def tokenizer_differences(saved: dict, inputs: dict) -> list[tuple[str, object, object]]:
    """(setting, the value `saved` records, the one of `inputs`) for each tokenizer setting that differs."""
    return [(key, _trained_value(saved, key), inputs[key]) for key in _changed_settings(saved, inputs)]


def _changed_settings(saved: dict, inputs: dict) -> list[str]:
    """The tokenizer settings of `inputs` whose value is not the one `saved` records."""
    return [key for key, value in inputs.items()
            if not key.startswith("train_") and _trained_value(saved, key) != value]


def _trained_value(saved: dict, key: str) -> object:
    """A tokenizer setting as `saved` records it; one it lacks was recorded before aiayn had it, so it had
    its default (TOKENIZER_DEFAULTS)."""
    return saved.get(key, TOKENIZER_DEFAULTS.get(key))


def _read_tokenizer_inputs(directory: Path) -> dict | None:
    """The directory's record of what its tokenizer was trained from; None without one."""
    path = directory / TOKENIZER_INPUTS
    if not path.is_file():
        return None
    advice = "delete it and the tokenizer beside it to train a new one"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSON and UTF-8 decoding errors
        raise UserError(f"{path}: unreadable ({e}); {advice}") from None
    if not isinstance(saved, dict):
        raise UserError(f"{path}: not a JSON object; {advice}")
    return saved


def _tokenizer_file_changes(saved: dict, inputs: dict) -> list[str]:
    """Each training file of `inputs` that is not the one `saved` records, named: by the whole file's hash,
    or by its first MB's where `saved` was written before the whole one was recorded."""
    files = []
    for key in ("train_src", "train_tgt"):
        old, new = saved.get(key), inputs[key]
        old = old if isinstance(old, dict) else {}
        digest = "sha256" if "sha256" in old else "sha256_1mb"
        if (old.get("size"), old.get(digest)) == (new["size"], new[digest]):
            continue
        if old.get("path") == new["path"]:  # "X is not the X it was trained on" contradicted itself
            files.append(f"data.{key}={new['path']} changed since the tokenizer was trained on it")
        else:
            files.append(f"data.{key}={new['path']} is not the {old.get('path')} it was trained on")
    return files


def find_tokenizer(directory: str | Path, shared: bool | None = None) -> Tokenizer | None:
    """The tokenizer a run directory already holds (shared spm.model, or source.spm + target.spm). Half of
    a pair, or both kinds, is refused: a lone source.spm was taken for no tokenizer, and training wrote a
    new one over it; spm.model beside source.spm and target.spm was used, the others ignored, unsaid.
    A lone one beside aiayn's record (TOKENIZER_INPUTS) is aiayn's own training, killed between its two
    files: no tokenizer, trained again.

    `shared`: the kind a resumed run's checkpoints were trained with, whose tokenizer is what counts: only
    that kind's files are looked for, none refused (--resume compares them with the checkpoint's, and
    mends a pair it finds half of)."""
    directory = Path(directory)
    if shared is not None:
        names = [SHARED] if shared else [SOURCE, TARGET]
        if all((directory / name).is_file() for name in names):
            return Tokenizer(*(directory / name for name in names))
        return None
    held = [name for name in (SHARED, SOURCE, TARGET) if (directory / name).is_file()]
    if held in ([SOURCE], [TARGET]) and (directory / TOKENIZER_INPUTS).is_file():
        return None
    if held == [SHARED]:
        return Tokenizer(directory / SHARED)
    if held == [SOURCE, TARGET]:
        return Tokenizer(directory / SOURCE, directory / TARGET)
    if not held:
        return None
    if held[0] == SHARED:
        separate = " and ".join(held[1:])
        raise UserError(f"{directory}: holds {SHARED} (one shared vocabulary) beside {separate} (separate "
                        "ones): two tokenizers; delete the one not meant")
    lone, partner = (SOURCE, TARGET) if held == [SOURCE] else (TARGET, SOURCE)
    raise UserError(f"{directory / lone}: no {partner} beside it (separate vocabularies take both; a shared "
                    f"one is {SHARED} alone); put {partner} there, or delete {lone} to train a new "
                    "tokenizer")

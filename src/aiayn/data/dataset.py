"""Parallel text: read and check it, encode it once, cache the ids on disk, collate batches.

A corpus is two plain UTF-8 files, one sentence per line, line i of one the translation of line i
of the other. Reading checks what users get wrong (a missing file, line counts that differ, bytes
that are not UTF-8) and names the file and the line. Empty pairs are dropped and counted.

Encoded ids are cached as safetensors (flat int32 ids + offsets, never pickle) beside the run, keyed
by the files' identity and the tokenizer's bytes, so that epochs and restarts do not re-tokenize.

Dimension key: B batch, S source length, T target length.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from aiayn.data.tokenizer import Tokenizer, train_sentencepiece
from aiayn.errors import UserError
from aiayn.files import atomic_output

log = logging.getLogger(__name__)
CACHE_FORMAT = "aiayn-ids-1"
TOKENIZER_INPUTS = "tokenizer_inputs.json"  # beside the run's SentencePiece model(s): what trained them


def require_file(path: Path) -> None:
    """A UserError unless `path` is a regular file, saying what it is instead."""
    if path.is_dir():
        raise UserError(f"{path}: is a directory, not a text file")
    if not path.exists():
        raise UserError(f"{path}: file not found")
    if not path.is_file():  # a FIFO or a device: reading it may block or never end
        raise UserError(f"{path}: not a regular file")


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 file, without line ends or a leading byte order mark; invalid UTF-8 or a
    NUL byte is a UserError naming the file and the bad line."""
    path = Path(path)
    require_file(path)
    try:
        data = path.read_bytes()
    except OSError as e:  # unreadable (permissions, I/O error): still one line naming the file
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: invalid UTF-8 (byte {data[e.start]:#04x})") from None
    if (nul := data.find(b"\0")) >= 0:  # valid UTF-8, but no text has it: a binary file, or a corrupt one
        line = data.count(b"\n", 0, nul) + 1
        raise UserError(f"{path}:{line}: NUL byte (binary or corrupt input?)")
    # Notepad's BOM would stay glued to the first word (a hypothesis scored 99.84 BLEU against itself);
    # SentencePiece drops it from training text anyway.
    lines = text.removeprefix("\ufeff").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start a new one
    return [line.rstrip("\r") for line in lines]


@dataclass
class ParallelText:
    src: list[str]  # source sentences, empty pairs already dropped
    tgt: list[str]  # target sentences, aligned with src
    dropped_empty: int  # pairs with an empty side that were dropped


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> ParallelText:
    """Read two aligned files; drop (and count) pairs with an empty side."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):  # named at the first line the other file lacks
        longer = src_path if len(src) > len(tgt) else tgt_path
        raise UserError(
            f"{longer}:{min(len(src), len(tgt)) + 1}: line counts differ: "
            f"{src_path} has {len(src)} lines, {tgt_path} has {len(tgt)}"
        )
    keep = [i for i in range(len(src)) if src[i].strip() and tgt[i].strip()]
    dropped = len(src) - len(keep)
    if dropped:
        log.info("%s: dropped %d empty pair(s) of %d", src_path, dropped, len(src))
    if not keep:
        raise UserError(f"{src_path}:1: no non-empty sentence pairs")
    return ParallelText([src[i] for i in keep], [tgt[i] for i in keep], dropped)


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
        return cls(*_flatten(src), *_flatten(tgt))

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    def source(self, i: int) -> list[int]:
        return self.src_ids[self.src_offsets[i] : self.src_offsets[i + 1]].tolist()

    def target(self, i: int) -> list[int]:
        return self.tgt_ids[self.tgt_offsets[i] : self.tgt_offsets[i + 1]].tolist()

    def src_lengths(self) -> list[int]:
        return self.src_offsets.diff().tolist()

    def tgt_lengths(self) -> list[int]:
        """Target lengths as the decoder sees them: pieces + BOS (input) or + EOS (output)."""
        return (self.tgt_offsets.diff() + 1).tolist()

    def filter_length(self, max_len: int) -> tuple["EncodedCorpus", int]:
        """Drop pairs whose source (with EOS) or target (with EOS) is longer than `max_len`."""
        keep = ((self.src_offsets.diff() <= max_len) & (self.tgt_offsets.diff() + 1 <= max_len)).nonzero()[
            :, 0
        ]
        kept = EncodedCorpus(
            *_select(self.src_ids, self.src_offsets, keep), *_select(self.tgt_ids, self.tgt_offsets, keep)
        )
        return kept, len(self) - len(kept)


def _flatten(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    ids = torch.tensor([i for s in seqs for i in s], dtype=torch.int32)
    return ids, offsets


def _select(
    ids: torch.Tensor, offsets: torch.Tensor, keep: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sentences at `keep`, flat again: every kept token's old position, gathered at once."""
    lengths = offsets.diff()[keep]
    new_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    sentence = torch.repeat_interleave(torch.arange(len(keep)), lengths)  # (kept tokens,)
    old_position = offsets[keep][sentence] + torch.arange(int(new_offsets[-1])) - new_offsets[sentence]
    return ids[old_position], new_offsets


def cache_key(src_path: Path, tgt_path: Path, tokenizer: Tokenizer) -> str:
    """Identity of an encoding: both files (path, size, mtime), the tokenizer models' bytes and, for an
    imported tokenizer (Marian), its piece -> id vocabularies and special ids: the same SentencePiece
    model gives other ids through them."""
    h = hashlib.sha256(CACHE_FORMAT.encode())
    for p in (src_path, tgt_path):
        st = Path(p).stat()
        h.update(f"{Path(p).resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    for p in (tokenizer.src_path, tokenizer.tgt_path):
        if p is not None:
            h.update(Path(p).read_bytes())
    if tokenizer.vocab is not None:  # absent for aiayn's own tokenizers, so their keys stay as they were
        specials = [tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id]
        mapping = [tokenizer.vocab, tokenizer.tgt_vocab, specials]
        h.update(json.dumps(mapping, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def load_encoded(
    src_path: str | Path, tgt_path: str | Path, tokenizer: Tokenizer, cache_dir: str | Path
) -> tuple[EncodedCorpus, int]:
    """Ids from the cache, or read, check, encode and cache them: (corpus, empty pairs dropped)."""
    src_path, tgt_path = Path(src_path), Path(tgt_path)
    for p in (src_path, tgt_path):
        require_file(p)
    key = cache_key(src_path, tgt_path, tokenizer)
    cache = Path(cache_dir) / f"{src_path.name}-{tgt_path.name}.{key[:16]}.safetensors"
    if cache.is_file():
        corpus, dropped = _read_cache(cache, key)
        if corpus is not None:
            log.info("%s: %d pairs from the cache", cache, len(corpus))
            return corpus, dropped
    text = read_parallel(src_path, tgt_path)
    corpus = EncodedCorpus.from_lists(
        [tokenizer.encode_src(s) for s in text.src], [tokenizer.encode_tgt(t) for t in text.tgt]
    )
    _write_cache(cache, key, corpus, text.dropped_empty)
    log.info("%s: encoded %d pairs, cached in %s", src_path, len(corpus), cache)
    return corpus, text.dropped_empty


def _write_cache(path: Path, key: str, corpus: EncodedCorpus, dropped: int) -> None:
    """Write to a temporary name, then rename: a killed run never leaves half a cache."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tensors = dict(
        src_ids=corpus.src_ids,
        src_offsets=corpus.src_offsets,
        tgt_ids=corpus.tgt_ids,
        tgt_offsets=corpus.tgt_offsets,
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"key": key, "dropped_empty": str(dropped)})
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:  # a full disk: safetensors reports it as a SafetensorError
        tmp.unlink(missing_ok=True)
        reason = getattr(e, "strerror", None) or e
        raise UserError(f"{path}: cannot write the encoded-ids cache ({reason})") from None
    except BaseException:  # Ctrl-C mid-write: the temporary (named by pid, so never reused) goes too
        tmp.unlink(missing_ok=True)
        raise


def _read_cache(path: Path, key: str) -> tuple[EncodedCorpus | None, int]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != key:
                return None, 0
            t = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # a damaged cache is rebuilt, not fatal
        log.warning("%s: unreadable cache (%s); re-encoding", path, e)
        return None, 0
    corpus = EncodedCorpus(t["src_ids"], t["src_offsets"], t["tgt_ids"], t["tgt_offsets"])
    return corpus, int(meta.get("dropped_empty", 0))


@dataclass
class Batch:
    src: torch.Tensor  # (B, S) source ids ending in EOS, right-padded
    tgt_in: torch.Tensor  # (B, T) BOS + target, right-padded: the decoder input
    tgt_out: torch.Tensor  # (B, T) target + EOS, right-padded: what the decoder must predict
    n_tokens: int  # real target tokens (the loss' normalizer)

    def to(self, device: torch.device) -> "Batch":
        return Batch(self.src.to(device), self.tgt_in.to(device), self.tgt_out.to(device), self.n_tokens)


def collate(corpus: EncodedCorpus, indices: list[int], tokenizer: Tokenizer) -> Batch:
    """Pad the pairs at `indices` into one batch (decoder input BOS + y, output y + EOS)."""
    pad, bos, eos = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
    b = len(indices)
    src_len, tgt_len = corpus.src_offsets.diff(), corpus.tgt_offsets.diff()
    s = max(int(src_len[i]) for i in indices)
    t = max(int(tgt_len[i]) for i in indices) + 1
    src = torch.full((b, s), pad, dtype=torch.long)  # (B, S)
    tgt_in = torch.full((b, t), pad, dtype=torch.long)  # (B, T)
    tgt_out = torch.full((b, t), pad, dtype=torch.long)  # (B, T)
    n_tokens = 0
    for row, i in enumerate(indices):
        x, y = corpus.source(i), corpus.target(i)
        src[row, : len(x)] = torch.tensor(x)
        tgt_in[row, : len(y) + 1] = torch.tensor([bos] + y)
        tgt_out[row, : len(y) + 1] = torch.tensor(y + [eos])
        n_tokens += len(y) + 1
    return Batch(src, tgt_in, tgt_out, n_tokens)


def train_tokenizer(
    text: ParallelText, directory: str | Path, vocab_size: int, model_type: str = "bpe", shared: bool = True,
    normalization: str = "nmt_nfkc", character_coverage: float = 1.0,
) -> Tokenizer:
    """Train SentencePiece on the training text: one model for both sides (the paper) or one per side.

    Then warn (once) if the model's normalization rewrites a sizeable share of the text, since the model
    will translate into the rewritten form (a Persian ZWNJ becomes a space under "nmt_nfkc")."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    settings = dict(normalization=normalization, character_coverage=character_coverage)
    if shared:
        path = _train_spm(text.src + text.tgt, directory / "spm", vocab_size, model_type, **settings)
        tokenizer = Tokenizer(path)
    else:
        src = _train_spm(text.src, directory / "source", vocab_size, model_type, **settings)
        tgt = _train_spm(text.tgt, directory / "target", vocab_size, model_type, **settings)
        # Tokenizer.save names them source.spm / target.spm; keep those names in the run directory too.
        os.replace(src, directory / "source.spm")
        os.replace(tgt, directory / "target.spm")
        tokenizer = Tokenizer(directory / "source.spm", directory / "target.spm")
    _warn_if_normalization_changes_text(tokenizer, text, normalization)
    return tokenizer


def _train_spm(
    lines: list[str], prefix: Path, vocab_size: int, model_type: str,
    normalization: str = "nmt_nfkc", character_coverage: float = 1.0,
) -> Path:
    """train_sentencepiece, with SentencePiece's refusals (RuntimeError) as a line naming the setting."""
    try:
        return train_sentencepiece(lines, prefix, vocab_size, model_type,
                                   character_coverage=character_coverage, normalization=normalization)
    except RuntimeError as e:  # "INTERNAL: trainer_interface.cc(638) [check] Vocabulary size is smaller ..."
        reason = str(e).rsplit("] ", 1)[-1].strip() or type(e).__name__  # the sentence after the C++ check
        chars = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", reason)
        if chars:  # SentencePiece's own advice names its --character_coverage flag, which aiayn does not have
            needed = int(chars.group(1))  # the characters kept, plus pad, bos, eos and unk
            covered = "" if character_coverage == 1.0 else f" at data.character_coverage={character_coverage}"
            message = (
                f"data.vocab_size={vocab_size}: the text has {needed - 4} distinct characters{covered}, too many "
                f"for the vocabulary and its 4 special pieces; raise data.vocab_size to at least {needed}, or "
                "lower data.character_coverage (0.9995 is usual for Chinese and Japanese)"
            )
        else:
            message = f"data.vocab_size={vocab_size}: SentencePiece cannot train on this text ({reason})"
        raise UserError(message) from None


ROUND_TRIP_SAMPLE = 2000  # lines per side checked after training a tokenizer
ROUND_TRIP_TOLERANCE = 0.01  # share of sampled lines the normalization may change without a warning


def _warn_if_normalization_changes_text(tokenizer: Tokenizer, text: ParallelText, normalization: str) -> None:
    """Log one warning if the tokenizer's normalization changes more than 1% of a sample of either side's
    training text (whitespace aside: SentencePiece always collapses it), naming the first changed
    character, an example line and the setting that keeps the text."""
    problems = []
    for side, lines, sp in (("source", text.src, tokenizer.src), ("target", text.tgt, tokenizer.tgt)):
        k = min(len(lines), ROUND_TRIP_SAMPLE)
        changed, first = 0, None
        for i in range(k):
            line = lines[i * len(lines) // k]  # evenly spaced
            want = _spaced(line)
            got = _spaced(sp.normalize(line))
            if got != want:
                changed += 1
                first = first or (want, got)
        if changed > ROUND_TRIP_TOLERANCE * k:
            problems.append((side, changed, k, first))
    if not problems:
        return
    counts = "; ".join(f"{changed} of {k} sampled {side} lines" for side, changed, k, _ in problems)
    want, got = problems[0][3]
    at = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    char = want[at] if at < len(want) else got[at]
    example = want[max(0, at - 30) : at + 30]
    fix = {"nfkc": '; set data.normalization = "identity"', "identity": ""}.get(
        normalization, '; set data.normalization = "nfkc" (or "identity")'
    )
    if fix:
        fix += (" and train a new tokenizer (in a new train.run_dir, or delete this one's spm.model, or "
                "source.spm and target.spm)")
    log.warning(
        "data.normalization=%r changes the training text the model will learn to write (%s), e.g. "
        "U+%04X %s in %r%s",
        normalization, counts, ord(char), unicodedata.name(char, "(unnamed)"), example, fix,
    )


def _spaced(text: str) -> str:
    """`text` as SentencePiece gives it back in the best case: whitespace runs as one space (its U+2581
    meta symbol, which `normalize` writes for a space, counted as a space too)."""
    return " ".join(text.replace("\u2581", " ").split())


TOKENIZER_DEFAULTS = {"normalization": "nmt_nfkc", "character_coverage": 1.0}  # settings recorded since
# aiayn had them: a tokenizer_inputs.json without one was trained with the value here


def tokenizer_inputs(
    src_path: str | Path, tgt_path: str | Path, vocab_size: int, model_type: str, shared: bool,
    normalization: str = "nmt_nfkc", character_coverage: float = 1.0,
) -> dict:
    """What a trained tokenizer depends on: the data settings and the identity of both training files."""
    return {
        "vocab_size": vocab_size,
        "spm_type": model_type,
        "shared_vocab": shared,
        "normalization": normalization,
        "character_coverage": character_coverage,
        "train_src": _file_identity(Path(src_path)),
        "train_tgt": _file_identity(Path(tgt_path)),
    }


def _file_identity(path: Path) -> dict:
    """Size and a hash of the first MB. Not the mtime: a copied or re-downloaded corpus is still the same
    corpus; not a hash of it all: a WMT corpus is GBs. The path is kept to name it, not to compare."""
    require_file(path)
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    digest = hashlib.sha256(head).hexdigest()
    return {"path": str(path.resolve()), "size": path.stat().st_size, "sha256_1mb": digest}


def write_tokenizer_inputs(directory: Path, inputs: dict) -> None:
    """Record `inputs` atomically, before the tokenizer is trained: a model never exists without it."""
    with atomic_output(directory / TOKENIZER_INPUTS) as f:
        f.write(json.dumps(inputs, indent=1) + "\n")


def check_tokenizer_inputs(directory: Path, inputs: dict, resumed: bool = False) -> None:
    """Refuse to reuse a run directory's tokenizer trained from other settings or files. A directory
    without the record (written before it existed) is accepted, as it always was.

    `resumed`: the run has checkpoints, trained with this tokenizer, so it stays. Other tokenizer
    settings are refused (they could not take effect); another corpus is what continuing training on new
    data looks like, so it is only logged."""
    saved = _read_tokenizer_inputs(directory)
    if saved is None:
        return
    files = _tokenizer_file_changes(saved, inputs)
    if resumed:
        refuse_other_tokenizer_settings(directory, saved, inputs)
        for change in files:
            log.info("%s (--resume keeps the run's tokenizer)", change)
        return
    changed = tokenizer_setting_changes(saved, inputs) + files
    if changed:
        raise UserError(
            f"{directory}: its tokenizer was trained for other data ({'; '.join(changed)}); "
            "delete the tokenizer (spm.model, or source.spm and target.spm) to train a new one, "
            "or use a new train.run_dir"
        )


def refuse_other_tokenizer_settings(where: Path, saved: dict, inputs: dict) -> None:
    """--resume keeps the tokenizer its checkpoints were trained with: a setting other than the one `saved`
    records (the run dir's record, or a checkpoint's data configuration) could not take effect."""
    settings = tokenizer_setting_changes(saved, inputs)
    if settings:
        raise UserError(f"{where}: --resume keeps the tokenizer its checkpoints were trained with "
                        f"({'; '.join(settings)}); drop the change, or use a new train.run_dir")


def tokenizer_setting_changes(saved: dict, inputs: dict) -> list[str]:
    """Each tokenizer setting of `inputs` (`tokenizer_inputs`) that differs from `saved`, named; a setting
    `saved` lacks was recorded before aiayn had it, so it had its default (TOKENIZER_DEFAULTS)."""
    return [
        f"data.{key} was {saved.get(key, TOKENIZER_DEFAULTS.get(key))!r}, now {value!r}"
        for key, value in inputs.items()
        if not key.startswith("train_") and saved.get(key, TOKENIZER_DEFAULTS.get(key)) != value
    ]


def _read_tokenizer_inputs(directory: Path) -> dict | None:
    """The directory's record of what its tokenizer was trained from; None without one."""
    path = directory / TOKENIZER_INPUTS
    if not path.is_file():
        return None
    advice = "delete it and the tokenizer beside it to train a new one"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError includes JSON and UTF-8 decoding errors
        raise UserError(f"{path}: unreadable ({e}); {advice}") from None
    if not isinstance(saved, dict):
        raise UserError(f"{path}: not a JSON object; {advice}")
    return saved


def _tokenizer_file_changes(saved: dict, inputs: dict) -> list[str]:
    """Each training file of `inputs` that is not the one `saved` records, named."""
    files = []
    for key in ("train_src", "train_tgt"):
        old, new = saved.get(key), inputs[key]
        old = old if isinstance(old, dict) else {}
        if (old.get("size"), old.get("sha256_1mb")) != (new["size"], new["sha256_1mb"]):
            files.append(f"data.{key}={new['path']} is not the {old.get('path')} it was trained on")
    return files


def find_tokenizer(directory: str | Path) -> Tokenizer | None:
    """The tokenizer a run directory already holds (shared spm.model, or source.spm + target.spm)."""
    directory = Path(directory)
    if (directory / "spm.model").is_file():
        return Tokenizer(directory / "spm.model")
    if (directory / "source.spm").is_file() and (directory / "target.spm").is_file():
        return Tokenizer(directory / "source.spm", directory / "target.spm")
    return None

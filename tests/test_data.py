"""Parallel text is read, checked, encoded once and cached; bad files give one line naming file and line."""

import errno
import gzip
import io
import logging
import os
import pickle
import random
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest
import sentencepiece as spm
import torch
from safetensors.torch import save_file

from aiayn.data import dataset, lines, tokenizer
from aiayn.data.dataset import (
    ParallelText,
    cache_encoded,
    collate,
    encoded_cache,
    find_tokenizer,
    load_encoded,
    read_encoded,
    read_lines,
    read_parallel,
    scan_parallel,
    train_tokenizer,
    warn_if_unknown,
)
from aiayn.data.tokenizer import Tokenizer, sentencepiece_model
from aiayn.errors import UserError


def write(path, lines, raw=None):
    path.write_bytes(raw if raw is not None else ("\n".join(lines) + "\n").encode("utf-8"))
    return path


def sentences(n, lang):
    words = {
        "de": ["der", "Hund", "läuft", "schnell", "die", "Katze"],
        "en": ["the", "dog", "runs", "fast", "cat"],
    }[lang]
    return [" ".join(words[(i + j) % len(words)] for j in range(1 + i % 5)) for i in range(n)]


# scan_parallel keeps, checks and counts what read_parallel does, streaming the lines instead of holding them.
READERS = pytest.mark.parametrize("read", [read_parallel, scan_parallel])


@READERS
def test_read_parallel_drops_and_counts_empty_pairs(tmp_path, read):
    src = write(tmp_path / "a.de", ["eins", "", "drei", "vier", "   ", "\u200b"])
    tgt = write(tmp_path / "a.en", ["one", "two", "", "four", "five", "six"])
    text = read(src, tgt)
    assert list(text.src) == ["eins", "vier"] and list(text.tgt) == ["one", "four"]
    assert len(text.src) == len(text.tgt) == 2 and text.dropped_empty == 4
    assert list(text.src) == ["eins", "vier"]  # again: the lines are read on each pass
    write(tgt, ["\u200b"] * 6)  # the target is the empty side: named, not the source
    with pytest.raises(UserError, match=r"a\.en: no line has text \(all 6 are empty or blank\)$"):
        read(src, tgt)
    write(src, [], raw=b"")
    write(tgt, [], raw=b"")
    with pytest.raises(UserError) as e:  # was "a.de: no line has text (all 0 are empty or blank)"
        read(src, tgt)
    assert str(e.value) == f"{src}, {tgt}: both files are empty (no lines)"
    write(tgt, ["one", "", "", "four", "", ""])  # text on each side, never on both
    write(src, ["", "zwei", "drei", "", "fünf", "sechs"])
    with pytest.raises(UserError, match=r"a\.de, .*a\.en: no pair has text on both sides \(2 empty in "
                                        r".*a\.de, 4 empty in .*a\.en\)$"):
        read(src, tgt)


@READERS
def test_crlf_and_missing_final_newline(tmp_path, read):
    src = write(tmp_path / "a.de", [], raw=b"eins\r\nzwei")
    tgt = write(tmp_path / "a.en", [], raw=b"one\r\ntwo\n")
    assert list(read(src, tgt).src) == ["eins", "zwei"]


@READERS
def test_errors_name_file_and_line(tmp_path, read):
    good = write(tmp_path / "a.en", ["one", "two", "three"])
    with pytest.raises(UserError, match=r"missing\.de: file not found"):
        read(tmp_path / "missing.de", good)
    short = write(tmp_path / "short.de", ["eins", "zwei"])
    with pytest.raises(UserError, match=r"a\.en:3: line counts differ: .*short\.de has 2 lines"):
        read(short, good)
    bad = write(tmp_path / "bad.de", [], raw="eins\nzwei\n".encode() + b"dr\xffei\n")
    with pytest.raises(UserError, match=r"bad\.de:3: invalid UTF-8"):
        read(bad, good)


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    src = write(d / "train.de", sentences(200, "de") + ["Hund " * 40])
    tgt = write(d / "train.en", sentences(200, "en") + ["dog " * 40])
    return d, src, tgt


@READERS
@pytest.mark.parametrize("shared", [True, False])
def test_lines_sentencepiece_leaves_out_are_warned_of(tmp_path, caplog, shared, read):
    """SentencePiece's training skips a line over 65,536 bytes (max_sentence_length), said only in the log
    minloglevel=2 hides: a long line of characters found nowhere else trained as "▁ <unk>", unsaid."""
    src = write(tmp_path / "long.de", ["", *sentences(40, "de"), "ж" * 32768, "ж" * 35000, "я" * 35000])
    tgt = write(tmp_path / "long.en", ["x", *sentences(40, "en"), "long", "longer", "long too"])
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        tok = train_tokenizer(read(src, tgt), tmp_path / "run", 40, shared=shared)
    # 65,536 bytes are kept (the first), 70,000 are not; a streamed file's line number counts its empty first
    # line, a held list's is among the lines kept
    where = (f"{src}: 2 lines over 65,536 bytes (the first: line 43)" if read is scan_parallel
             else "source side: 2 lines over 65,536 bytes (the first: kept line 42)")
    assert caplog.messages == [f"{where} left out of the tokenizer's training (SentencePiece's limit)"]
    assert tok.unk_id in tok.src.encode("я") and tok.unk_id not in tok.src.encode("ж")


def test_shared_and_separate_tokenizers(tmp_path, corpus_files):
    _, src, tgt = corpus_files
    text = read_parallel(src, tgt)
    shared = train_tokenizer(text, tmp_path / "shared", 40, "bpe", shared=True)
    assert shared.shared and (shared.pad_id, shared.bos_id, shared.eos_id) == (0, 1, 2)
    separate = train_tokenizer(text, tmp_path / "sep", 30, "unigram", shared=False)
    assert not separate.shared
    assert find_tokenizer(tmp_path / "sep").tgt_path.name == "target.spm"
    assert find_tokenizer(tmp_path / "shared").shared
    assert find_tokenizer(tmp_path) is None


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("shared", [True, False])
def test_a_file_changed_while_training_the_tokenizer_is_named(tmp_path, corpus_files, monkeypatch, shared,
                                                              sampled):
    """Streamed text is read again after it was checked; a file rewritten since is an error naming it,
    not a RuntimeError from inside SentencePiece, and leaves no tokenizer trained on part of it. A sample
    of the lines still reads them all, to the end of the file."""
    if sampled:
        monkeypatch.setattr(dataset, "SEED_SENTENCES", 100)
    _, src, _ = corpus_files
    tgt = write(tmp_path / "train.en", sentences(201, "en"))
    text = scan_parallel(src, tgt)
    write(tgt, sentences(202, "en"))
    with pytest.raises(UserError) as e:
        train_tokenizer(text, tmp_path / "run", 40, shared=shared)
    assert str(e.value) == f"{tgt}: changed while being read"
    assert find_tokenizer(tmp_path / "run") is None and not (tmp_path / "run" / "spm.model").exists()


class RaisingLines(list):
    """Lines whose iteration raises `error` after the first `after`."""

    def __init__(self, lines, after, error):
        super().__init__(lines)
        self.after, self.error = after, error

    def __iter__(self):
        yield from self[: self.after]
        raise self.error


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize(("after", "error"), [(150, KeyboardInterrupt()), (150, MemoryError()),
                                              (0, UserError("train.de: changed while being read"))])
def test_what_reading_the_lines_raises_comes_out_as_itself(tmp_path, shared, after, error):
    """SentencePiece wrapped it: Ctrl-C was "data.vocab_size=...: SentencePiece cannot train on this text
    (INTERNAL: KeyboardInterrupt: ..." over several lines, exit status 2, not 130; a UserError before the
    first line was "found no line to learn from". It stops SentencePiece at once, leaving no model."""
    src = RaisingLines(sentences(200, "de"), after, error)
    with pytest.raises(type(error)) as e:
        train_tokenizer(ParallelText(src, sentences(200, "en"), 0), tmp_path, 40, shared=shared)
    assert e.value is error and list(tmp_path.iterdir()) == []


def test_sentencepieces_other_refusals_are_one_line(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("INTERNAL: trainer_interface.cc(1) [check] it went\nwrong\n\nAt:\n  x.py(5): it\n")

    monkeypatch.setattr(dataset, "sentencepiece_model", refuse)
    with pytest.raises(UserError) as e:
        train_tokenizer(ParallelText(["eins"], ["one"], 0), tmp_path, 40)
    assert str(e.value) == ("data.vocab_size=40: SentencePiece cannot train on this text "
                            "(it went wrong At: x.py(5): it)")


def test_a_text_of_no_character_sentencepiece_keeps_is_said_so(tmp_path):
    """Lines of U+FFFD alone: "data.vocab_size=300: SentencePiece cannot train on this text (RuntimeError)"
    blamed the vocabulary and dropped SentencePiece's reason (all_chars_count > 0)."""
    with pytest.raises(UserError, match="^source side: SentencePiece found no character to learn from: the "
                                        "training text holds none it keeps"):
        train_tokenizer(ParallelText(["\ufffd"] * 50, ["\ufffd"] * 50, 0), tmp_path, 40, shared=False)


def test_sentencepiece_0_2_2s_unigram_refusal_of_no_character_is_said_so(tmp_path, monkeypatch):
    """SentencePiece 0.2.2's unigram trainer refuses lines of U+FFFD alone by its own check, which was
    said as "data.vocab_size=40: SentencePiece cannot train on this text (RuntimeError)"."""
    def refuse(*args, **kwargs):
        raise RuntimeError("INTERNAL: unigram_model_trainer.cc(617) [!required_chars_.empty()] ")

    monkeypatch.setattr(dataset, "sentencepiece_model", refuse)
    with pytest.raises(UserError, match=r"^SentencePiece found no character to learn from: the training "
                                        r"text holds none it keeps \(only U\+FFFD"):
        train_tokenizer(ParallelText(["\ufffd"] * 50, ["\ufffd"] * 50, 0), tmp_path, 40, "unigram")


def test_a_model_of_the_special_pieces_alone_is_refused_as_no_character(tmp_path, monkeypatch):
    """SentencePiece 0.2.2 (an H200 machine's) trains lines of U+FFFD alone, which 0.2.3 refuses, into a
    model of the 4 special pieces: every line read as unknown pieces, and training went on with it. Such a
    model made here: a real one with its pieces past the 4th left out of the wire format."""
    def special_pieces_alone(lines, *args):
        model, at, kept, pieces = sentencepiece_model(lines, *args), 0, [], 0
        while at < len(model):
            number, _, _, end = tokenizer._field(model, at)
            pieces += number == 1  # ModelProto's field 1: a piece
            kept += [model[at:end]] if number != 1 or pieces <= 4 else []
            at = end
        made = b"".join(kept)
        assert spm.SentencePieceProcessor(model_proto=made).get_piece_size() == 4
        return made

    monkeypatch.setattr(dataset, "sentencepiece_model", special_pieces_alone)
    pairs = ParallelText(["ein Haus"] * 50, ["a house"] * 50, 0)
    with pytest.raises(UserError, match="^source side: SentencePiece found no character to learn from"):
        train_tokenizer(pairs, tmp_path / "two", 40, shared=False)
    with pytest.raises(UserError, match="^SentencePiece found no character to learn from"):
        train_tokenizer(pairs, tmp_path / "one", 40)
    assert not any(tmp_path.rglob("*.spm")) and not any(tmp_path.rglob("*.model"))


@pytest.mark.parametrize("shared", [True, False])
def test_a_side_sentencepiece_refuses_is_named_and_nothing_is_left(tmp_path, shared):
    """With a vocabulary per side, "data.vocab_size=100: the text has 301 distinct characters..." said not
    which, and the source's model, trained first, stayed as RUN/source.model: no name the cleanup knows,
    and none a later run reads. Ctrl-C between the two trainings left it too."""
    r = random.Random(0)
    chinese = ["".join(r.choices([chr(0x4E00 + i) for i in range(300)], k=20)) for _ in range(400)]
    src = write(tmp_path / "train.en", [f"sentence number {i} about a dog" for i in range(400)])
    tgt = write(tmp_path / "train.zh", chinese)
    with pytest.raises(UserError) as e:
        train_tokenizer(scan_parallel(src, tgt), tmp_path / "run", 100, shared=shared)
    side = "" if shared else f"target side ({tgt}): "
    assert str(e.value).startswith(f"{side}data.vocab_size=100: the text has ")
    assert list((tmp_path / "run").iterdir()) == []
    interrupted = RaisingLines(chinese, 200, KeyboardInterrupt())  # once the source's model is trained
    with pytest.raises(KeyboardInterrupt):
        train_tokenizer(ParallelText(read_lines(src), interrupted, 0), tmp_path / "run", 100, shared=shared)
    assert list((tmp_path / "run").iterdir()) == []


def test_separate_vocabularies_too_small_for_both_sides_are_said_at_once(tmp_path):
    """The source's refusal alone was said ("raise data.vocab_size to at least 28"); raised to that, the
    source was trained again and the target refused for more (305), one SentencePiece training a try."""
    r = random.Random(0)
    chinese = ["".join(r.choices([chr(0x4E00 + i) for i in range(300)], k=20)) for _ in range(400)]
    english = [f"sentence number {i} about a dog" for i in range(400)]
    src, tgt = write(tmp_path / "train.en", english), write(tmp_path / "train.zh", chinese)
    with pytest.raises(UserError) as e:
        train_tokenizer(scan_parallel(src, tgt), tmp_path / "run", 20, shared=False)
    sides = f"source side ({src}) and target side ({tgt}): data.vocab_size=20: "
    rest = (r"the texts have (\d+) and (\d+) distinct characters, too many for the vocabulary and its 4 "
            r"special pieces; raise data.vocab_size to at least (\d+), or lower data.character_coverage "
            r"\(0.9995 is usual for Chinese and Japanese\)")
    said = re.fullmatch(re.escape(sides) + rest, str(e.value))
    assert said, str(e.value)
    source, target, needed = map(int, said.groups())
    assert source < target and needed == target + 4
    assert list((tmp_path / "run").iterdir()) == []
    enough = source + 4  # for the English
    swapped = f"^source side \\({re.escape(str(tgt))}\\): data.vocab_size={enough}: the text has {target} "
    with pytest.raises(UserError, match=swapped) as e:  # the target fits: the source's refusal, as before
        train_tokenizer(scan_parallel(tgt, src), tmp_path / "run", enough, shared=False)
    sent = pickle.loads(pickle.dumps(e.value))  # as a process pool sends it back (it broke the pool)
    assert isinstance(sent, UserError) and str(sent) == str(e.value)
    tok = train_tokenizer(scan_parallel(src, tgt), tmp_path / "run", needed, shared=False)  # enough for both
    assert tok.tgt_vocab_size == needed


def test_fewer_pieces_than_asked_are_said(tmp_path, corpus_files, caplog):
    _, src, tgt = corpus_files
    with caplog.at_level("WARNING", logger="aiayn.data.dataset"):
        tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 5000)  # far more than this text holds
    assert tok.src_vocab_size < 5000
    assert f"SentencePiece made {tok.src_vocab_size} pieces, fewer than data.vocab_size=5000" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="aiayn.data.dataset"):
        tok = train_tokenizer(read_parallel(src, tgt), tmp_path / "apart", 5000, shared=False)
    assert tok.src_vocab_size != tok.tgt_vocab_size  # each side named: sorted sizes named neither
    assert (f"SentencePiece made {tok.src_vocab_size} source and {tok.tgt_vocab_size} target pieces, fewer "
            "than data.vocab_size=5000") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="aiayn.data.dataset"):
        train_tokenizer(read_parallel(src, tgt), tmp_path / "fits", 40)
    assert "fewer than data.vocab_size" not in caplog.text


# Above SEED_SENTENCES lines, a model learns from a sample: SentencePiece's own drew from a generator no seed
# reached, so two runs of one configuration made different models, caches and batches.

def random_corpus(directory, pairs):
    """Lines of made-up words: each sample of them gives a model of its own."""
    r = random.Random(0)
    letters = "abcdefghiklmnoprstuwäöü"
    words = ["".join(r.choice(letters) for _ in range(r.randint(2, 8))) for _ in range(500)]
    paths = directory / "train.xx", directory / "train.yy"
    for path in paths:
        write(path, [" ".join(r.choices(words, k=r.randint(3, 12))) for _ in range(pairs)])
    return paths


SAMPLED_RUN = """
import hashlib, sys
from aiayn.data import dataset
dataset.SEED_SENTENCES = 300
fed = []
sentencepiece_model = dataset.sentencepiece_model
def counted(lines, *args, **kwargs):
    lines = list(lines)
    fed.append(len(lines))
    return sentencepiece_model(lines, *args, **kwargs)
dataset.sentencepiece_model = counted
tokenizer = dataset.train_tokenizer(dataset.scan_parallel(sys.argv[1], sys.argv[2]), sys.argv[3], 200, seed=7)
print(fed, hashlib.sha256(tokenizer.src_path.read_bytes()).hexdigest())
"""


def test_a_sampled_tokenizer_is_the_same_in_every_process(tmp_path):
    src, tgt = random_corpus(tmp_path, 1000)
    env = {**os.environ, "PYTHONPATH": str(Path(dataset.__file__).parents[2])}  # this aiayn, not another
    runs = [subprocess.run([sys.executable, "-c", SAMPLED_RUN, str(src), str(tgt), str(tmp_path / f"run{i}")],
                           env=env, capture_output=True, text=True, check=True, timeout=300).stdout
            for i in range(2)]
    assert runs[0].startswith("[300] ") and runs[0] == runs[1]


@pytest.mark.parametrize("shared", [True, False])
def test_the_sample_is_its_size_of_the_same_lines_held_or_streamed(tmp_path, monkeypatch, shared):
    src, tgt = random_corpus(tmp_path, 1000)
    monkeypatch.setattr(dataset, "SEED_SENTENCES", 300)
    fed = []

    def counted(lines, *args, **kwargs):
        fed.append(list(lines))
        return sentencepiece_model(fed[-1], *args, **kwargs)

    monkeypatch.setattr(dataset, "sentencepiece_model", counted)
    held = read_parallel(src, tgt)
    train_tokenizer(held, tmp_path / "held", 200, shared=shared, seed=7)
    train_tokenizer(scan_parallel(src, tgt), tmp_path / "files", 200, shared=shared, seed=7)
    train_tokenizer(held, tmp_path / "other", 200, shared=shared, seed=8)
    sides = 1 if shared else 2
    held_fed, files_fed, other_fed = fed[:sides], fed[sides : 2 * sides], fed[2 * sides :]
    assert [len(lines) for lines in fed] == [300] * 3 * sides and files_fed == held_fed != other_fed
    whole = held.src + held.tgt if shared else held.src
    assert set(held_fed[0]) <= set(whole) and sorted(held_fed[0], key=whole.index) == held_fed[0]  # in order
    for name in ["spm.model"] if shared else ["source.spm", "target.spm"]:
        assert (tmp_path / "files" / name).read_bytes() == (tmp_path / "held" / name).read_bytes()
        assert (tmp_path / "other" / name).read_bytes() != (tmp_path / "held" / name).read_bytes()
    if not shared:  # one sample of pairs: line i of the source beside line i of the target
        assert [held.src.index(line) for line in fed[0]] == [held.tgt.index(line) for line in fed[1]]


def test_sample_flags_choose_k_of_n_uniformly_a_block_at_a_time(monkeypatch):
    monkeypatch.setattr(dataset, "SAMPLE_BLOCK", 10)
    flags = [list(dataset._sample_flags(35, 7, seed)) for seed in range(2000)]
    assert all(len(f) == 35 and sum(f) == 7 for f in flags)
    assert flags[0] == list(dataset._sample_flags(35, 7, 0)) and flags[0] != flags[1]
    share = torch.tensor(flags, dtype=torch.float64).mean(0)  # (35,): 7 / 35 each, standard error 0.009
    assert ((share - 0.2).abs() < 0.05).all(), share


def test_encode_once_then_cache(tmp_path, corpus_files, monkeypatch):
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    umask = os.umask(0o022)
    try:
        first, dropped = load_encoded(src, tgt, tok, tmp_path / "cache")
    finally:
        os.umask(umask)
    assert len(first) == 201 and dropped == 0
    (cache,) = (tmp_path / "cache").iterdir()
    assert cache.stat().st_mode & 0o777 == 0o644  # as the run's other files; safetensors made it 0600
    assert first.source(0) == tok.encode_src(sentences(1, "de")[0]) and first.source(0)[-1] == tok.eos_id
    assert first.target(0) == tok.encode_tgt(sentences(1, "en")[0])

    def no_encoding(*_):
        raise AssertionError("re-encoded although cached")

    monkeypatch.setattr(type(tok), "encode_src", no_encoding)
    monkeypatch.setattr(type(tok), "encode_src_batch", no_encoding)
    again, _ = load_encoded(src, tgt, tok, tmp_path / "cache")
    assert [again.source(i) for i in range(201)] == [first.source(i) for i in range(201)]
    assert [again.target(i) for i in range(201)] == [first.target(i) for i in range(201)]
    longest = max(max(s, t) for s, t in zip(first.src_lengths()[:200], first.tgt_lengths()[:200]))
    assert min(len(first.source(200)), len(first.target(200)) + 1) > longest  # the 40-word pair
    filtered, too_long = again.filter_length(longest)
    assert too_long == 1 and len(filtered) == 200
    assert [filtered.source(i) for i in range(200)] == [first.source(i) for i in range(200)]
    assert [filtered.target(i) for i in range(200)] == [first.target(i) for i in range(200)]


def test_the_cache_is_on_disk_before_its_name_and_the_name_after(tmp_path, corpus_files, monkeypatch):
    """It was renamed into place unflushed: after a power loss the name could be a zero-length file (as
    `atomic_output`, the checkpoints: the file flushed, renamed, then its folder flushed)."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    done = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        done.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(a, b):
        done.append(("replace", str(b)))
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    load_encoded(src, tgt, tok, tmp_path / "cache")
    (cache,) = (tmp_path / "cache").iterdir()
    tmp = [path for kind, path in done if kind == "fsync" and Path(path).parent == cache.parent]
    assert len(tmp) == 1 and done[-3:] == [("fsync", tmp[0]), ("replace", str(cache)),
                                           ("fsync", str(cache.parent))], done  # the temporary, flushed


def test_a_cache_that_cannot_be_read_is_said_so_and_rebuilt(tmp_path, corpus_files, monkeypatch, caplog):
    """A cache file of mode 000 was logged in safetensors' words, "unreadable cache (No such file or
    directory: ...)", of a file that is there."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    first, _ = load_encoded(src, tgt, tok, tmp_path / "cache")
    (cache,) = (tmp_path / "cache").iterdir()
    real_open, real_safe_open = open, dataset.safe_open

    def unreadable(opener, error):  # chmod 000 does not stop root, whom CI may run as
        def opens(path, *args, **kwargs):
            if Path(path) == cache:
                raise error
            return opener(path, *args, **kwargs)
        return opens

    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(cache))
    monkeypatch.setattr(dataset, "open", unreadable(real_open, denied), raising=False)
    # safetensors' error for any file it cannot open
    said = FileNotFoundError(f"No such file or directory: {cache}")
    monkeypatch.setattr(dataset, "safe_open", unreadable(real_safe_open, said))
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        again, _ = load_encoded(src, tgt, tok, tmp_path / "cache")
    assert caplog.messages == [f"{cache}: unreadable cache (Permission denied); re-encoding"]
    assert [again.source(i) for i in range(len(first))] == [first.source(i) for i in range(len(first))]


def test_collate_shifts_the_target(tmp_path, corpus_files):
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    corpus, _ = load_encoded(src, tgt, tok, tmp_path / "cache")
    batch = collate(corpus, [3, 0], tok)
    y = corpus.target(3)
    assert batch.tgt_in[0, : len(y) + 1].tolist() == [tok.bos_id] + y
    assert batch.tgt_out[0, : len(y) + 1].tolist() == y + [tok.eos_id]
    assert batch.src[0, : len(corpus.source(3))].tolist() == corpus.source(3)
    assert batch.n_tokens == len(corpus.target(3)) + len(corpus.target(0)) + 2
    assert (batch.tgt_out == tok.pad_id).sum() == batch.tgt_out.numel() - batch.n_tokens


def collate_rows(corpus, indices, tokenizer):
    """The oracle: collate as it was first written, one row at a time in Python."""
    pad, bos, eos = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
    s = max(len(corpus.source(i)) for i in indices)
    t = max(len(corpus.target(i)) for i in indices) + 1
    src = torch.full((len(indices), s), pad, dtype=torch.long)  # (B, S)
    tgt_in = torch.full((len(indices), t), pad, dtype=torch.long)  # (B, T)
    tgt_out = torch.full((len(indices), t), pad, dtype=torch.long)  # (B, T)
    n_tokens, positions, targets = 0, [], []
    for row, i in enumerate(indices):
        x, y = corpus.source(i), corpus.target(i)
        src[row, : len(x)] = torch.tensor(x)
        tgt_in[row, : len(y) + 1] = torch.tensor([bos] + y)
        tgt_out[row, : len(y) + 1] = torch.tensor(y + [eos])
        n_tokens += len(y) + 1
        positions += [row * t + j for j in range(len(y) + 1)]  # flat indices into (B, T)
        targets += y + [eos]
    return dataset.Batch(src, tgt_in, tgt_out, n_tokens, torch.tensor(positions), torch.tensor(targets))


@pytest.mark.parametrize("seed", range(4))
def test_collate_equals_the_row_by_row_oracle(seed):
    """The vectorized collate (one gather per side) gives the row-by-row batches exactly: random lengths
    from 1 (a lone EOS source, a one-piece target) up, batches of one, of every pair, in any order, and
    the special ids of an imported Marian model (EOS 0, BOS = pad)."""
    import random

    from aiayn.data.dataset import EncodedCorpus

    r = random.Random(seed)

    def pieces(*short: int) -> list[int]:  # of a length in `short` (as often as all longer ones), or 3-40
        return [r.randrange(5, 90) for _ in range(r.choice([*short, r.randint(3, 40)]))]

    src = [pieces(0, 1, 2) + [2] for _ in range(60)]  # sources end in EOS (id 2)
    tgt = [pieces(1, 1, 2) for _ in range(60)]
    corpus = EncodedCorpus.from_lists(src, tgt)
    aiayn, marian = (0, 1, 2), (58100, 58100, 0)  # (pad, bos, eos); a Marian decoder starts from its pad
    tok = SimpleNamespace(**dict(zip(("pad_id", "bos_id", "eos_id"), [aiayn, marian][seed % 2])))
    shortest = min(range(60), key=lambda i: (len(tgt[i]), len(src[i])))  # target and source of length 1
    assert (len(tgt[shortest]), len(src[shortest])) == (1, 1)
    batches = [[shortest], [r.randrange(60)], list(range(60)), r.sample(range(60), 17)]
    batches.append([shortest, 5, shortest])  # a pair twice
    for indices in batches:
        got, want = collate(corpus, indices, tok), collate_rows(corpus, indices, tok)
        for name in ("src", "tgt_in", "tgt_out", "positions", "targets"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype == torch.long and torch.equal(a, b), (name, indices)
        assert got.n_tokens == want.n_tokens and isinstance(got.n_tokens, int)
    no_ids = EncodedCorpus.from_lists([[2], [5, 2]], [[], []])  # empty targets only: nothing to gather
    got, want = collate(no_ids, [1, 0], tok), collate_rows(no_ids, [1, 0], tok)
    assert torch.equal(got.tgt_in, want.tgt_in) and torch.equal(got.tgt_out, want.tgt_out)


def test_batch_to_the_cpu_is_the_batch():
    """Batch.to pins and copies without blocking only for a GPU; to the CPU it is the plain copy it was."""
    from aiayn.data.dataset import EncodedCorpus

    corpus = EncodedCorpus.from_lists([[5, 6, 2], [7, 2]], [[8], [9, 10, 11]])
    batch = collate(corpus, [0, 1], SimpleNamespace(pad_id=0, bos_id=1, eos_id=2))
    moved = batch.to(torch.device("cpu"))
    assert all(torch.equal(getattr(moved, n), getattr(batch, n)) for n in ("src", "tgt_in", "tgt_out"))
    assert moved.n_tokens == batch.n_tokens == 6 and not moved.src.is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batch_to_a_gpu_goes_through_pinned_memory_without_blocking():
    from aiayn.data.dataset import EncodedCorpus

    corpus = EncodedCorpus.from_lists([[5, 6, 2], [7, 2]], [[8], [9, 10, 11]])
    batch = collate(corpus, [0, 1], SimpleNamespace(pad_id=0, bos_id=1, eos_id=2))
    moved = batch.to(torch.device("cuda"))
    torch.cuda.synchronize()
    assert moved.src.is_cuda and moved.n_tokens == batch.n_tokens
    assert all(torch.equal(getattr(moved, n).cpu(), getattr(batch, n)) for n in ("src", "tgt_in", "tgt_out"))


def test_filter_length_keeps_the_right_pairs():
    import random

    from aiayn.data.dataset import EncodedCorpus

    r = random.Random(0)
    src = [[r.randrange(4, 50) for _ in range(r.randint(1, 12))] for _ in range(300)]
    tgt = [[r.randrange(4, 50) for _ in range(r.randint(0, 12))] for _ in range(300)]
    kept, dropped = EncodedCorpus.from_lists(src, tgt).filter_length(8)
    want = [(s, t) for s, t in zip(src, tgt) if len(s) <= 8 and len(t) + 1 <= 8]
    assert dropped == 300 - len(want) and dropped > 50
    assert [(kept.source(i), kept.target(i)) for i in range(len(kept))] == want


# What the files hold, beyond plain text.


def test_lines_with_no_pieces_are_dropped_as_empty_pairs(tmp_path, corpus_files, caplog):
    """A zero-width space or control bytes look non-empty to str.strip() but encode to no pieces: such
    pairs were trained on as a source of EOS alone or an empty target."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    de = ["der Hund", "die Katze", "\x01\x02", "\u200b\u200b", "\ufffd", "schnell"]  # U+FFFD: text, no pieces
    en = ["the dog", "\u200b", "the cat", "fast", "runs", "the \u200bcat"]
    a, b = write(tmp_path / "v.de", de), write(tmp_path / "v.en", en)
    text = read_parallel(a, b)
    assert text.src == ["der Hund", "\ufffd", "schnell"] and text.tgt == ["the dog", "runs", "the \u200bcat"]
    assert text.dropped_empty == 3
    with caplog.at_level(logging.INFO, logger="aiayn.data.dataset"):
        corpus, dropped = load_encoded(a, b, tok, tmp_path / "cache")
    assert dropped == 4 and len(corpus) == 2
    assert [corpus.source(i) for i in range(2)] == [tok.encode_src("der Hund"), tok.encode_src("schnell")]
    assert corpus.target(1) == tok.encode_tgt("the \u200bcat")
    assert (f"{a}, {b}: dropped 4 pair(s) of 6 with a side empty or of no pieces (2 empty in {a}, 1 empty in "
            f"{b}, 1 of no pieces in {a})") in caplog.messages
    assert load_encoded(a, b, tok, tmp_path / "cache")[1] == 4  # the same count from the cache
    write(b, ["\u200b"] * 6)
    with pytest.raises(UserError, match=r"v\.en: no line has text"):
        load_encoded(a, b, tok, tmp_path / "cache")
    # A source whose every line is text of no pieces: the target's one empty line was blamed, "no pair has
    # text on both sides (1 empty in v.en)"
    write(a, ["\ufffd \ufffd"] * 5 + [""]), write(b, ["the dog", "the cat", "fast", "runs", "x", ""])
    with pytest.raises(UserError) as e:
        load_encoded(a, b, tok, tmp_path / "cache")
    assert str(e.value) == (f"{a}: no line has pieces (1 empty or blank, 5 of text the tokenizer encodes to "
                            "nothing, such as U+FFFD under nmt_nfkc)")
    write(b, en)  # a line of the source whose target is blank is not encoded: no file can be blamed
    with pytest.raises(UserError) as e:
        load_encoded(a, b, tok, tmp_path / "cache")
    assert str(e.value) == (f"{a}, {b}: no pair has pieces on both sides (1 empty in {a}, 1 empty in {b}, "
                            f"4 of no pieces in {a})")


def test_text_the_tokenizer_has_no_pieces_for_is_warned_of(tmp_path, corpus_files, caplog):
    """Characters a tokenizer lacks become <unk>, a run of them one piece: counted per side, EOS aside (a
    line of nothing else is "▁ <unk>" and EOS: a third of its pieces were unknown in the first count)."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    de = ["我们", "der Hund 我们 läuft", "der Hund", "die Katze", "schnell"]
    a, b = write(tmp_path / "v.de", de), write(tmp_path / "v.en", ["the dog"] * 5)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        warn_if_unknown(a, b, cache_encoded(a, b, tok, tmp_path / "cache")[0], tok.unk_id, None, False)
    ids = [tok.encode_src(line)[:-1] for line in de]  # without EOS
    pieces, unknown = sum(map(len, ids)), sum(line.count(tok.unk_id) for line in ids)
    assert unknown == 2 and unknown > 0.01 * pieces
    assert caplog.messages == [(
        f"{a}: 2 of its {pieces} pieces ({100 * 2 / pieces:.1f}%, in 2 of 5 lines) are <unk>, characters the "
        "tokenizer has no piece for; the tokenizer's training text (or the sample it learnt from) lacks "
        "them, or data.character_coverage < 1 left them out")]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        warn_if_unknown(src, tgt, cache_encoded(src, tgt, tok, tmp_path / "cache")[0], tok.unk_id, None,
                        False)  # its own training text: no <unk>
    assert caplog.messages == []


def test_unknown_pieces_are_counted_in_the_pairs_max_len_keeps(tmp_path, corpus_files, caplog):
    """One long line that data.max_len drops warned of 22% of a corpus' pieces as <unk>, blaming the
    tokenizer's training text, for a line training never sees; the pairs kept are counted alone."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    de = ["der Hund 我们 läuft", " ".join(["我们 Hund"] * 30), "der Hund", "die Katze", "schnell"]
    a, b = write(tmp_path / "v.de", de), write(tmp_path / "v.en", ["the dog"] * 5)
    ids = [tok.encode_src(line)[:-1] for line in de]  # without EOS
    max_len = 20
    assert [len(i) + 1 <= max_len for i in ids] == [True, False, True, True, True]
    kept = [i for i in ids if len(i) + 1 <= max_len]
    pieces = sum(map(len, kept))
    corpus = cache_encoded(a, b, tok, tmp_path / "cache")[0]
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        warn_if_unknown(a, b, corpus, tok.unk_id, max_len, False)
    assert caplog.messages == [(
        f"{a}: 1 of its {pieces} pieces ({100 / pieces:.1f}%, in 1 of 4 lines within data.max_len=20) are "
        "<unk>, characters the tokenizer has no piece for; the tokenizer's training text (or the sample it "
        "learnt from) lacks them, or data.character_coverage < 1 left them out")]
    caplog.clear()
    a = write(tmp_path / "w.de", ["der Hund", *de[1:]])  # the kept pairs have no <unk>: nothing said
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        warn_if_unknown(a, b, cache_encoded(a, b, tok, tmp_path / "cache")[0], tok.unk_id, max_len, False)
    assert caplog.messages == []


def test_cr_only_line_ends_are_named(tmp_path):
    """An old Mac file was one line, and SentencePiece then failed with a message about the vocabulary."""
    mac = write(tmp_path / "mac.de", [], raw=b"eins\rzwei\rdrei\r")
    with pytest.raises(UserError, match=r"mac\.de: CR line ends and no LF .*tr '\\r' '\\n'"):
        read_lines(mac)
    assert read_lines(write(tmp_path / "one.de", [], raw=b"eins\r")) == ["eins"]  # one line, ended by CR
    assert read_lines(write(tmp_path / "dos.de", [], raw=b"eins\r\nzwei\r\n")) == ["eins", "zwei"]


def test_the_conversion_suggested_for_cr_line_ends_is_a_command_that_runs(tmp_path):
    """It put the name into a shell command: `tr '\\r' '\\n' < <stdin> > <stdin>.lf` for standard input, and
    a path with a space unquoted."""
    import io

    with pytest.raises(UserError) as e:
        read_lines("<stdin>", io.BytesIO(b"eins\rzwei\r"))
    assert str(e.value).endswith("so it reads as one line; convert it, e.g. pipe it through tr '\\r' '\\n' "
                                 "before aiayn")
    mac = write(tmp_path / "old mac.de", [], raw=b"eins\rzwei\r")
    with pytest.raises(UserError) as e:
        read_lines(mac)
    assert str(e.value).endswith(f"convert it, e.g. tr '\\r' '\\n' < '{mac}' > '{mac}.lf'")


@pytest.mark.parametrize("block", [1 << 22, 8])
def test_cr_line_ends_with_a_last_lf_are_named(tmp_path, monkeypatch, block, caplog):
    """A classic Mac file that ends with an LF was one line, silently; a stray CR in an LF file is text."""
    monkeypatch.setattr(lines, "READ_BLOCK", block)
    mac = write(tmp_path / "mac.de", [], raw=b"eins\rzwei\rdrei\r\n")
    with pytest.raises(UserError) as e:
        read_lines(mac)
    convert = f"convert it, e.g. tr '\\r' '\\n' < {mac} > {mac}.lf"
    assert str(e.value) == (f"{mac}: CR line ends and more CRs alone than LFs (2 to 1; a classic Mac OS "
                            f"file?), so lines run together; {convert}")
    stray = write(tmp_path / "stray.de", [], raw=b"eins\nei\rns\nzw\rei\r\ndrei\n")  # 2 alone, 4 LFs
    with caplog.at_level(logging.WARNING):
        assert read_lines(stray) == ["eins", "ei\rns", "zw\rei", "drei"]
        assert read_lines(stray) == ["eins", "ei\rns", "zw\rei", "drei"]  # read again: said once
    # three lines ended by a lone CR ran together silently, as one pair
    said = f"{stray}:2: 2 CR(s) inside lines; lines end at LFs only, so where a CR ended a line,"
    assert caplog.messages == [said + " two sentences are read as one"]
    write(stray, [], raw=b"eins\nei\rns\nzw\rei\r\n")  # changed, a CR left: said again, where a set of
    assert read_lines(stray) == ["eins", "ei\rns", "zw\rei"]  # paths kept a long-lived process silent
    assert caplog.messages[1:] == [said + " two sentences are read as one"]
    caplog.clear()
    assert read_lines(write(tmp_path / "crlf.de", [], raw=b"eins\r\r\nzwei\r\n")) == ["eins", "zwei"]
    assert caplog.messages == []  # CRs at a line's end are dropped with it


@pytest.mark.parametrize(
    ("raw", "looks"),
    [
        (gzip.compress(b"eins\nzwei\n"), "(byte 0x8b); the file looks gzip-compressed; decompress it first"),
        ("eins\nzwei\n".encode("utf-16"), "(byte 0xff); the file looks like UTF-16; convert it to UTF-8"),
        ("\ufeffeins\n".encode("utf-16-be"), "(byte 0xfe); the file looks like UTF-16; convert it to UTF-8"),
        ("eins\n".encode("utf-32"), "(byte 0xff); the file looks like UTF-32; convert it to UTF-8"),
    ],
    ids=["gzip", "utf-16-le", "utf-16-be", "utf-32"],
)
def test_compressed_or_utf16_input_says_what_it_looks_like(tmp_path, raw, looks):
    path = write(tmp_path / "train.de", [], raw=raw)
    with pytest.raises(UserError) as e:
        read_lines(path)
    assert str(e.value).startswith(f"{path}:1: invalid UTF-8 {looks}")


@pytest.mark.parametrize(("text", "order", "error"), [
    ("eins\nzwei\n", "LE", "NUL byte (binary or corrupt input?)"),  # was that alone
    ("Straße und Fuß\n", "LE", "invalid UTF-8 (byte 0xdf)"),  # was that alone
    ("eins\nzwei\n", "BE", "NUL byte (binary or corrupt input?)"),
])
@pytest.mark.parametrize("block", [1 << 22, 16])
def test_utf16_without_a_byte_order_mark_is_named(tmp_path, monkeypatch, text, order, error, block):
    monkeypatch.setattr(lines, "READ_BLOCK", block)
    path = write(tmp_path / "train.de", [], raw=text.encode(f"utf-16-{order.lower()}"))
    with pytest.raises(UserError) as e:
        read_lines(path)
    assert str(e.value) == (f"{path}:1: {error}; the file looks like UTF-16 without a byte order mark; "
                            f"convert it to UTF-8 (iconv -f UTF-16{order} -t UTF-8)")
    binary = write(tmp_path / "binary.de", [], raw=b"\0\0\0\0eins\n")  # NULs in both byte positions
    with pytest.raises(UserError) as e:
        read_lines(binary)
    assert str(e.value) == f"{binary}:1: NUL byte (binary or corrupt input?)"


@pytest.mark.parametrize(("text", "error"), [
    ("Привет, как дела?\n", "NUL byte (binary or corrupt input?)"),  # was that alone
    ("Καλημέρα κόσμε\n", "invalid UTF-8 (byte 0x9a)"),  # was that alone
    # 38 characters a line: 64 bytes held no newline, its only ASCII character
    ("一个穿着红色衬衫的男人正在公园里和他的狗" + "一起玩飞盘，旁边还有几个孩子在看。\n", "invalid UTF-8 (byte 0xa2)"),
    ("Le prix\u00a0: 10\u202f000 euros.\n", "invalid UTF-8 (byte 0xa0)"),  # no-break spaces: not printable
], ids=["cyrillic", "greek", "chinese", "french"])
@pytest.mark.parametrize("order", ["LE", "BE"])
def test_utf16_without_a_byte_order_mark_is_named_in_any_script(tmp_path, text, order, error):
    """The test was a NUL as every high byte, which Latin text alone has: Cyrillic, Greek or Chinese in
    UTF-16 was a bare "NUL byte" or "invalid UTF-8", where the README says UTF-16 is named."""
    path = write(tmp_path / "train.ru", [], raw=(text * 20).encode(f"utf-16-{order.lower()}"))
    with pytest.raises(UserError) as e:
        read_lines(path)
    assert str(e.value) == (f"{path}:1: {error}; the file looks like UTF-16 without a byte order mark; "
                            f"convert it to UTF-8 (iconv -f UTF-16{order} -t UTF-8)")


def test_utf8_text_with_a_stray_nul_is_not_named_utf16(tmp_path):
    """Read as UTF-16LE these bytes are all characters text has, one of them ASCII (the NUL's "A"): UTF-16
    text has two at least (newlines, spaces, digits), so this is no UTF-16."""
    path = write(tmp_path / "train.en", [], raw=b"A\0 black dog and a spotted dog are fighting\n")
    with pytest.raises(UserError) as e:
        read_lines(path)
    assert str(e.value) == f"{path}:1: NUL byte (binary or corrupt input?)"


def test_errors_keep_their_words_and_order_across_read_blocks(tmp_path, monkeypatch):
    """Files are read in blocks; the first invalid byte is still named before a NUL byte earlier on, and
    each at its line, as when the file was decoded whole."""
    monkeypatch.setattr(lines, "READ_BLOCK", 16)
    head = "".join(f"Zeile {i} äöü\n" for i in range(20)).encode()
    both = write(tmp_path / "both.de", [], raw=b"a\0b\n" + head + b"dr\xffei\n")
    with pytest.raises(UserError) as e:
        read_lines(both)
    assert str(e.value) == f"{both}:22: invalid UTF-8 (byte 0xff)"
    nul = write(tmp_path / "nul.de", [], raw=head + b"a\0b\n")
    with pytest.raises(UserError) as e:
        read_lines(nul)
    assert str(e.value) == f"{nul}:21: NUL byte (binary or corrupt input?)"


class CountedReads(io.BytesIO):
    """A stream that counts its reads."""

    reads = 0

    def read(self, size=-1):
        self.reads += 1
        return super().read(size)


def test_a_line_of_nul_bytes_with_no_end_is_refused_without_reading_on(monkeypatch):
    """A NUL byte in a line that no LF ended was refused only once the whole input was read: a file of 1 GB
    of NULs took 3.4 GB, /dev/zero memory without bound. Now the reading stops a read or so past it. What
    was read of that line is all decoded (it was cut at its last NUL: invalid UTF-8 after it, on the same
    line, was said to be a NUL byte), but for a character the read cut (é over two reads is no error)."""
    monkeypatch.setattr(lines, "READ_BLOCK", 4096)
    zeros = b"\0" * (4 << 20)
    nul = "NUL byte (binary or corrupt input?)"
    for data, error in ((b"eins\n" + zeros, f"2: {nul}"), (b"ei\0ns\nzwei\n" + zeros + b"\xff\n", f"1: {nul}"),
                        (zeros, f"1: {nul}"), (b"\0" + "é".encode() * (2 << 20), f"1: {nul}"),  # é at 4095-6
                        (b"a\0\xff" + b"x" * (4 << 20) + b"\n", "1: invalid UTF-8 (byte 0xff)")):
        stream = CountedReads(data)
        with pytest.raises(UserError) as e:
            read_lines("<stdin>", stream)
        assert str(e.value) == f"<stdin>:{error}"
        assert stream.reads <= 2  # of the 1,024 reads the input takes


def test_load_encoded_checks_both_files_before_encoding(tmp_path, corpus_files, monkeypatch):
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)

    def no_encoding(*_):
        raise AssertionError("encoded before the files were checked")

    monkeypatch.setattr(Tokenizer, "encode_src_batch", no_encoding)
    monkeypatch.setattr(lines, "READ_BLOCK", 64)
    bad = write(tmp_path / "bad.en", [], raw=tgt.read_bytes() + b"la\xc3st\n")
    with pytest.raises(UserError) as e:
        load_encoded(src, bad, tok, tmp_path / "cache")
    assert str(e.value) == f"{bad}:202: invalid UTF-8 (byte 0xc3)"
    short = write(tmp_path / "short.en", sentences(200, "en"))
    with pytest.raises(UserError) as e:
        load_encoded(src, short, tok, tmp_path / "cache")
    assert str(e.value) == f"{src}:201: line counts differ: {src} has 201 lines, {short} has 200"


@pytest.mark.parametrize("side", ["source", "target"])
def test_a_file_changed_between_its_check_and_its_encoding_is_named(tmp_path, corpus_files, monkeypatch, side):
    """The encoding reads the files a second time, after `scan_parallel` checked and counted them: a file
    rewritten in between (a line added) is one line naming it, and no cache is written."""
    src, tgt = (write(tmp_path / p.name, [], raw=p.read_bytes()) for p in corpus_files[1:])  # copies to change
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    changed = src if side == "source" else tgt
    scan = dataset.scan_parallel

    def scan_then_append(*args, **kwargs):
        files = scan(*args, **kwargs)
        write(changed, [], raw=changed.read_bytes() + b"one line more\n")
        return files

    monkeypatch.setattr(dataset, "scan_parallel", scan_then_append)
    monkeypatch.setattr(dataset, "ENCODE_CHUNK", 64)
    with pytest.raises(UserError) as e:
        load_encoded(src, tgt, tok, tmp_path / "cache")
    assert str(e.value) == f"{changed}: changed while being read"
    assert not (tmp_path / "cache").exists()  # nor a temporary file of one


def test_batched_encoding_gives_the_ids_of_one_line_at_a_time(tmp_path, corpus_files):
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    lines = read_lines(src) + ["", "  ", "Hund\u200b", ">>fra<< der Hund"]
    assert tok.encode_src_batch(lines) == [tok.encode_src(line) for line in lines]
    assert tok.encode_tgt_batch(lines) == [tok.encode_tgt(line) for line in lines]
    sp = tok.src  # a Marian-style vocabulary, and its >>fra<< language code as one piece
    vocab = {sp.id_to_piece(i): i + 7 for i in range(sp.get_piece_size())} | {">>fra<<": 5}
    marian = Tokenizer(tok.src_path, vocab=vocab, specials={"pad": 0, "bos": 1, "eos": 2, "unk": 3})
    assert marian.encode_src_batch(lines) == [marian.encode_src(line) for line in lines]
    assert marian.encode_src_batch([">>fra<< der Hund"])[0][0] == 5


def test_a_list_for_one_text_and_one_text_for_a_list_are_type_errors(tmp_path, corpus_files):
    """encode_src(list) came back as a list per text and an EOS ([[27, 67], [162], 2]), silently;
    encode_src_batch(str) failed inside ("unsupported operand type(s) for +"), decode_tgt(str) in int()."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    for side in ("src", "tgt"):
        with pytest.raises(TypeError, match=rf"^Tokenizer\.encode_{side} takes one text \(str\), not list: "
                                            rf"encode_{side}_batch encodes a list of texts$"):
            getattr(tok, f"encode_{side}")(["der Hund", "schnell"])
        with pytest.raises(TypeError, match=rf"^Tokenizer\.encode_{side} takes a str, not bytes: decode it "
                                            r"first \(text\.decode\(\)\)$"):  # not "_batch encodes a list"
            getattr(tok, f"encode_{side}")(b"der Hund")
        with pytest.raises(TypeError, match=rf"^Tokenizer\.encode_{side}_batch takes a list of texts, not one "
                                            rf"str: pass \[text\], or encode_{side}\(text\)$"):
            getattr(tok, f"encode_{side}_batch")("der Hund")
    with pytest.raises(TypeError, match=r"^Tokenizer\.decode_tgt takes target ids \(a list of ints\), not str$"):
        tok.decode_tgt("der Hund")
    assert tok.decode_tgt(torch.tensor(tok.encode_tgt("der Hund"))) == "der Hund"


def test_encoding_uses_the_runs_threads(tmp_path, corpus_files, monkeypatch):
    """train.threads=1 on a busy machine: SentencePiece's batched encode took one thread per core."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    asked = []

    class Spy:  # SentencePiece's processor, recording the threads each batched encode asks for
        def __init__(self, sp):
            self.sp = sp

        def encode(self, texts, **options):
            asked.append(options.get("num_threads"))
            return self.sp.encode(texts, **options)

        def __getattr__(self, name):  # everything else as the processor
            return getattr(self.sp, name)

    monkeypatch.setattr(tok, "src", Spy(tok.src))
    monkeypatch.setattr(tok, "tgt", tok.src)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    load_encoded(src, tgt, tok, tmp_path / "cache")
    assert asked and set(asked) == {1}


def test_a_long_encode_logs_its_progress(tmp_path, corpus_files, monkeypatch, caplog):
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    with caplog.at_level(logging.INFO, logger="aiayn.data.dataset"):
        load_encoded(src, tgt, tok, tmp_path / "quick")
    assert not [m for m in caplog.messages if " of 201 pairs" in m]  # a quick encode says nothing
    monkeypatch.setattr(dataset, "ENCODE_CHUNK", 80)
    monkeypatch.setattr(dataset, "PROGRESS_SECONDS", 0.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="aiayn.data.dataset"):
        load_encoded(src, tgt, tok, tmp_path / "slow")
    progress = [m for m in caplog.messages if " of 201 pairs" in m]
    want = [f"{src}: encoded {n} of 201 pairs" for n in (80, 160, 201)]
    assert [m.split(" (")[0] for m in progress] == want
    assert progress[-1].endswith(" pairs/s)") and "(100%," in progress[-1]


def test_a_stop_python_dropped_ends_the_encode_at_the_chunk_it_came_in(tmp_path, corpus_files, monkeypatch):
    """A Ctrl-C whose KeyboardInterrupt Python dropped while a chunk was encoded (the CLI records it) was
    raised only by the cache's write, after the whole corpus (minutes of WMT) was encoded for nothing."""
    from aiayn import files

    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    encode, chunks = dataset._encode_chunk, []

    def encode_chunk(src, tgt, tokenizer):
        chunks.append(len(src))
        files.record_dropped_stop(KeyboardInterrupt())
        return encode(src, tgt, tokenizer)

    monkeypatch.setattr(dataset, "_encode_chunk", encode_chunk)
    monkeypatch.setattr(dataset, "ENCODE_CHUNK", 80)
    with pytest.raises(KeyboardInterrupt):
        load_encoded(src, tgt, tok, tmp_path / "cache")
    assert chunks == [80] and not (tmp_path / "cache").exists()


def test_the_same_file_on_both_sides_is_warned_about(tmp_path, corpus_files, caplog):
    """A copy model has its uses, so it is not refused; but it is rarely what was meant."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    link = tmp_path / "link.en"
    link.symlink_to(src)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        load_encoded(src, tgt, tok, tmp_path / "cache")
        assert caplog.records == []
        load_encoded(src, link, tok, tmp_path / "cache")
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    message = f"{src} and {link} are the same file: the model will learn to copy its input"
    assert record.getMessage() == message


def test_other_processes_read_process_0s_cache_as_it_is(tmp_path, corpus_files, monkeypatch):
    """Training's other processes take the (cache, key) process 0 names, whatever their own look at the
    files says: a copy of the corpus on another machine (another inode) had another key, was encoded
    again and deleted process 0's cache; other bytes trained that process on another corpus."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    first, _ = load_encoded(src, tgt, tok, tmp_path / "cache")
    cache, key = encoded_cache(src, tgt, tok, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [cache.name]

    def no_encoding(*_):
        raise AssertionError("encoded by another process")

    monkeypatch.setattr(type(tok), "encode_src_batch", no_encoding)
    read = read_encoded(cache, key, tok)
    assert [read.source(i) for i in range(len(first))] == [first.source(i) for i in range(len(first))]
    assert [read.target(i) for i in range(len(first))] == [first.target(i) for i in range(len(first))]
    for missing in (tmp_path / "elsewhere" / cache.name, cache.with_name("other.safetensors")):
        message = rf"^{re.escape(str(missing))}: process 0's encoding of the corpus is missing or unreadable"
        with pytest.raises(UserError, match=message + " on this machine; with several machines"):
            read_encoded(missing, key, tok)
    with pytest.raises(UserError, match="process 0's encoding"):  # another encoding's key: not trusted
        read_encoded(cache, "0" * 64, tok)


def test_a_new_cache_removes_the_stale_ones_of_the_same_files(tmp_path, corpus_files):
    """The key holds the files' mtime: a touched or re-copied corpus left its old cache (GBs for WMT)."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    cache = tmp_path / "cache"
    other = tmp_path / "other"  # other files of the same names, in the same cache: theirs stays
    other.mkdir()
    write(other / "train.de", sentences(30, "de")), write(other / "train.en", sentences(30, "en"))
    load_encoded(other / "train.de", other / "train.en", tok, cache)
    [others] = cache.iterdir()
    a, b = write(tmp_path / "train.de", read_lines(src)), write(tmp_path / "train.en", read_lines(tgt))
    load_encoded(a, b, tok, cache)
    [first] = set(cache.iterdir()) - {others}
    old_format = cache / "train.de-train.en.0123456789abcdef.safetensors"  # aiayn-ids-1: no "format"
    save_file({"x": torch.zeros(1)}, str(old_format), metadata={"key": "k", "dropped_empty": "0"})
    names = ("train.de-train.en.notes", "xtrain.de-train.en.0123456789abcdef")  # not a cache of a, b
    unrelated = {cache / f"{name}.safetensors" for name in names}
    for path in unrelated:
        path.write_bytes(b"not a cache")
    os.utime(a, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns + 10**9))  # touched: another key
    load_encoded(a, b, tok, cache)
    [second] = set(cache.iterdir()) - {others} - unrelated
    assert second != first and set(cache.iterdir()) == {others, second} | unrelated


def test_a_corpus_reached_through_a_repointed_symlink_replaces_its_old_cache(tmp_path, corpus_files, caplog):
    """The cache recorded the files the symlink resolved to: pointed at a new corpus, the old one's cache
    stayed, where the README says a new encoding of the same files replaces their old one."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    for version, n in (("v1", 200), ("v2", 150)):
        (tmp_path / version).mkdir()
        write(tmp_path / version / "train.de", read_lines(src)[:n])
        write(tmp_path / version / "train.en", read_lines(tgt)[:n])
    current, cache = tmp_path / "current", tmp_path / "cache"
    current.symlink_to("v1")
    a, b = current / "train.de", current / "train.en"
    load_encoded(a, b, tok, cache)
    [first] = cache.iterdir()
    current.unlink()
    current.symlink_to("v2")
    with caplog.at_level(logging.INFO, logger="aiayn.data.dataset"):
        corpus, _ = load_encoded(a, b, tok, cache)
    [second] = cache.iterdir()
    assert second != first and len(corpus) == 150
    assert f"{first}: removed, an earlier encoding of {a}" in caplog.messages
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="aiayn.data.dataset"):
        load_encoded(a, b, tok, cache)  # unchanged: read from the cache, which stays
    assert f"{second}: 150 pairs from the cache" in caplog.messages and list(cache.iterdir()) == [second]


def test_a_cache_that_recorded_the_resolved_files_is_still_replaced(tmp_path, corpus_files, monkeypatch):
    """Caches written before the names were recorded hold the files the names resolved to."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    (tmp_path / "link").symlink_to(src.parent)
    a, b, cache = tmp_path / "link" / src.name, tmp_path / "link" / tgt.name, tmp_path / "cache"
    with monkeypatch.context() as m:
        m.setattr(dataset, "_path_text", lambda path: str(path.resolve()))  # as aiayn wrote them
        load_encoded(a, b, tok, cache)
    [first] = cache.iterdir()
    other = train_tokenizer(read_parallel(src, tgt), tmp_path / "other", 30)  # another key
    load_encoded(a, b, other, cache)
    [second] = cache.iterdir()
    assert second != first


@pytest.mark.parametrize("stem", ["a" * 251, "ä" * 125], ids=["ascii", "two-byte"])
def test_files_of_the_longest_names_have_a_cache(tmp_path, corpus_files, stem):
    """The cache's name held both files' names whole: two legal names of 134 characters failed with
    "File name too long" after the tokenizer's training and the encoding."""
    _, src, tgt = corpus_files
    a = write(tmp_path / f"{stem}1.de", [], raw=src.read_bytes())
    b = write(tmp_path / f"{stem}2.en", [], raw=tgt.read_bytes())
    assert len(os.fsencode(a.name)) in (254, 255)  # 255 bytes: the most a name may have
    tok = train_tokenizer(read_parallel(a, b), tmp_path, 40)
    first, _ = load_encoded(a, b, tok, tmp_path / "cache")
    [cache] = (tmp_path / "cache").iterdir()
    assert cache.name.startswith(stem[:40]) and len(os.fsencode(cache.name)) <= 255 - 19  # 19: a temporary's
    assert cache.name.encode().decode("utf-8") == cache.name  # cut between characters
    again, _ = load_encoded(a, b, tok, tmp_path / "cache")  # found by its name
    assert torch.equal(again.src_ids, first.src_ids)
    os.utime(a, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns + 10**9))  # touched: another key
    load_encoded(a, b, tok, tmp_path / "cache")
    [new] = (tmp_path / "cache").iterdir()  # the stale one removed, by its cut name
    assert new != cache


def test_files_whose_names_are_not_utf8_have_a_cache(tmp_path, corpus_files):
    """The cache's key encoded the path as UTF-8: b"s\\xff.de" was a UnicodeEncodeError traceback, and the
    cache's metadata, which names the files, would have been one too; safetensors opens no file whose
    name is not UTF-8."""
    from safetensors import safe_open

    _, src, tgt = corpus_files
    a = write(tmp_path / os.fsdecode(b"s\xff.de"), [], raw=src.read_bytes())
    b = write(tmp_path / os.fsdecode(b"s\xff.en"), [], raw=tgt.read_bytes())
    tok = train_tokenizer(read_parallel(a, b), tmp_path / "run", 40)
    first, _ = load_encoded(a, b, tok, tmp_path / "cache")
    [cache] = (tmp_path / "cache").iterdir()
    assert cache.name.startswith("s\ufffd.de-s\ufffd.en.")
    with safe_open(str(cache), framework="pt") as f:
        assert f.metadata()["src"] == str(tmp_path.resolve()) + "/s\\xff.de"
    again, _ = load_encoded(a, b, tok, tmp_path / "cache")
    assert torch.equal(again.tgt_ids, first.tgt_ids) and list((tmp_path / "cache").iterdir()) == [cache]
    os.utime(a, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns + 10**9))  # touched: another key
    load_encoded(a, b, tok, tmp_path / "cache")
    [new] = (tmp_path / "cache").iterdir()  # the stale one removed: its metadata names these files
    assert new != cache


# Text SentencePiece's default normalization (nmt_nfkc) rewrites, and alphabets larger than the vocabulary.

PERSIAN = ["می\u200cروم", "کتاب\u200cها", "نمی\u200cدانم", "خانه", "بزرگ", "است", "این", "ما"]  # \u200c: ZWNJ
ENGLISH = ["I go", "books", "I do not know", "house", "big", "is", "this", "we"]


def persian_text(n=80):
    pick = [[(i + 3 * j) % len(PERSIAN) for j in range(1 + i % 4)] for i in range(n)]
    return ParallelText([" ".join(PERSIAN[w] for w in ws) for ws in pick],
                        [" ".join(ENGLISH[w] for w in ws) for ws in pick], 0)


@pytest.mark.parametrize(("normalization", "shared"), [("nfkc", True), ("identity", False)])
def test_nfkc_or_identity_keeps_the_zero_width_non_joiner(tmp_path, caplog, normalization, shared):
    text = persian_text()
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        tok = train_tokenizer(text, tmp_path, 60, shared=shared, normalization=normalization)
    sp = tok.src
    assert all(sp.decode(sp.encode(line)) == line for line in text.src)
    assert sum("\u200c" in line for line in text.src) > len(text.src) // 2
    assert caplog.records == []


def test_the_default_normalization_turns_zwnj_into_a_space_and_says_so(tmp_path, caplog):
    text = persian_text()
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        tok = train_tokenizer(text, tmp_path, 60)
    assert [tok.src.decode(tok.src.encode(line)) for line in text.src] == [
        line.replace("\u200c", " ") for line in text.src
    ]
    [record] = caplog.records  # one warning, not one per line or per side
    assert record.levelno == logging.WARNING
    assert "U+200C ZERO WIDTH NON-JOINER" in record.message
    assert 'data.normalization = "nfkc"' in record.message and "train a new tokenizer" in record.message


def test_a_compatibility_form_only_identity_keeps_is_advised_so(tmp_path, caplog):
    """nfkc folds ＩＢＭ to IBM as nmt_nfkc does: advising "nfkc" led to the same warning again."""
    text = ParallelText([f"{s} ＩＢＭ" for s in sentences(100, "de")], sentences(100, "en"), 0)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        train_tokenizer(text, tmp_path, 40)
    [record] = caplog.records
    assert "U+FF29 FULLWIDTH LATIN CAPITAL LETTER I" in record.message
    assert 'set data.normalization = "identity" and train a new tokenizer' in record.message
    assert '"nfkc"' not in record.message


@pytest.mark.parametrize("other_side", [False, True])
def test_the_advice_covers_every_changed_line_not_the_example_alone(tmp_path, caplog, other_side):
    """A ZWNJ in the first changed line and ＩＢＭ in later ones (or on the other side): "nfkc" was
    advised from the example alone, and the run that followed it warned again, advising "identity"."""
    text = persian_text(100)
    side = text.tgt if other_side else text.src
    ibm = [f"{line} ＩＢＭ" if i % 4 == 3 else line for i, line in enumerate(side)]
    text = ParallelText(text.src, ibm, 0) if other_side else ParallelText(ibm, text.tgt, 0)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        train_tokenizer(text, tmp_path, 60)
    [record] = caplog.records
    assert "U+200C ZERO WIDTH NON-JOINER" in record.message  # the example: the first changed line's
    # the target's rewriting the model learns to write; the source's alone it reads (said as "write")
    does = "learn to write" if other_side else "read"
    assert record.message.startswith("data.normalization='nmt_nfkc' changes the training text the model "
                                     f"will {does} (")
    assert 'set data.normalization = "identity" and train a new tokenizer' in record.message
    assert '"nfkc"' not in record.message


@pytest.mark.parametrize("word, named", [
    ("cafe\u0301", "U+0065 LATIN SMALL LETTER E + U+0301 COMBINING ACUTE ACCENT"),
    ("\u1112\u1161\u11ab", "U+1112 HANGUL CHOSEONG HIEUH + U+1161 HANGUL JUNGSEONG A + U+11AB HANGUL "
                            "JONGSEONG NIEUN"),
])
def test_a_decomposed_letter_is_named_whole_and_only_identity_is_advised(tmp_path, caplog, word, named):
    """NFD text: the warning named the base letter alone and advised "nfkc", which composes it too (the
    same warning again). Of the target's: the model learns to write it composed."""
    text = ParallelText(sentences(100, "en"), [f"{s} {word}" for s in sentences(100, "de")], 0)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        train_tokenizer(text, tmp_path, 40)
    [record] = caplog.records
    assert named in record.message
    assert 'set data.normalization = "identity" and train a new tokenizer' in record.message
    assert '"nfkc"' not in record.message


@pytest.mark.parametrize("normalization", ["nmt_nfkc", "nfkc", "nmt_nfkc_cf"])
def test_a_source_composed_alone_is_not_warned_about(tmp_path, caplog, normalization):
    """A decomposed source (NFD) composed to NFC was warned of with "identity" advised: the text to
    translate is composed alike, and under "identity" the model reads NFC and NFD input as other text. A
    compatibility form on the source, which the model can then not tell apart, is still said."""
    nfd = [unicodedata.normalize("NFD", f"{s} café über Straße") for s in sentences(100, "de")]
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        tok = train_tokenizer(ParallelText(nfd, sentences(100, "en"), 0), tmp_path / "nfd", 40,
                              normalization=normalization)
    nfc = unicodedata.normalize("NFC", nfd[0])
    assert nfc != nfd[0] and tok.src.normalize(nfd[0]) == tok.src.normalize(nfc)  # composed, and not said
    assert caplog.records == []
    fullwidth = [f"{s} ＩＢＭ" for s in nfd]
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        train_tokenizer(ParallelText(fullwidth, sentences(100, "en"), 0), tmp_path / "fullwidth", 40,
                        normalization=normalization)
    [record] = caplog.records
    assert "U+FF29 FULLWIDTH LATIN CAPITAL LETTER I" in record.message


def test_a_decomposed_source_under_identity_is_not_warned_about(tmp_path, caplog):
    """The source compared in NFC whatever the rule: under "identity", which keeps it decomposed, every
    line was "changed", named by a composed letter the text does not hold, and no setting advised."""
    nfd = [unicodedata.normalize("NFD", f"{s} café über Straße") for s in sentences(100, "de")]
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        tok = train_tokenizer(ParallelText(nfd, sentences(100, "en"), 0), tmp_path, 40, normalization="identity")
    assert tok.src.normalize(nfd[0]).replace("\u2581", " ").strip() == nfd[0]  # kept decomposed
    assert caplog.records == []


@pytest.mark.parametrize("normalization", ["nmt_nfkc_cf", "nfkc_cf"])
def test_the_case_folding_asked_for_is_not_warned_about(tmp_path, caplog, normalization):
    """Every cased line was "changed" (300 of 300, e.g. U+005A LATIN CAPITAL LETTER Z), with the advice to
    give up the folding. SentencePiece folds one character to one: ẞ to ß, and ß and İ kept, where
    str.casefold writes ss and i + U+0307."""
    odd = ["Die STRASSE und die Straße", "ẞ İstanbul ΣΑΣ ᾈ"] * 10
    text = ParallelText(sentences(100, "de") + odd, sentences(100, "en") + odd, 0)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        tok = train_tokenizer(text, tmp_path, 60, normalization=normalization)
    assert tok.src.normalize("ẞ İ ß").replace("\u2581", " ").strip() == "ß İ ß"  # no ss, no i + U+0307
    assert caplog.records == []


def test_a_case_folding_rule_is_advised_one_that_keeps_the_folding(tmp_path, caplog):
    """nmt_nfkc_cf rewrites the ZWNJ as nmt_nfkc does: nfkc_cf keeps it, and the case folding asked for."""
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        train_tokenizer(persian_text(), tmp_path, 60, normalization="nmt_nfkc_cf")
    [record] = caplog.records
    assert "U+200C ZERO WIDTH NON-JOINER" in record.message
    assert 'set data.normalization = "nfkc_cf" and train a new tokenizer' in record.message
    assert '"nfkc"' not in record.message and "identity" not in record.message


@pytest.mark.parametrize("normalization", ["nmt_nfkc_cf", "nfkc_cf"])
def test_what_no_case_folding_rule_keeps_is_said(tmp_path, caplog, normalization):
    """ＩＢＭ is folded to ibm by NFKC, which every rule that folds case applies: only "identity" keeps it.
    The character named is the text's, not its folding (U+FF49 FULLWIDTH LATIN SMALL LETTER I)."""
    text = ParallelText([f"{s} ＩＢＭ" for s in sentences(100, "de")], sentences(100, "en"), 0)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        train_tokenizer(text, tmp_path, 40, normalization=normalization)
    [record] = caplog.records
    assert "U+FF29 FULLWIDTH LATIN CAPITAL LETTER I in " in record.message
    assert ('no rule that folds case keeps it: set data.normalization = "identity" (which keeps case too) '
            "and train a new tokenizer") in record.message


def test_a_kept_tokenizer_that_folds_case_is_not_warned_about_case(tmp_path, caplog):
    """A fine-tune's or a resumed run's nmt_nfkc_cf tokenizer: its new text is folded as asked."""
    text = ParallelText(sentences(100, "de"), sentences(100, "en"), 0)
    tok = train_tokenizer(text, tmp_path / "tok", 40, normalization="nmt_nfkc_cf")
    src, tgt = tmp_path / "new.de", tmp_path / "new.en"
    src.write_text("\n".join(line.upper() for line in text.src) + "\n", encoding="utf-8")
    tgt.write_text("\n".join(line.title() for line in text.tgt) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        cache_encoded(src, tgt, tok, tmp_path / "cache", kept=True)
    assert caplog.records == []


@pytest.mark.parametrize("normalization", ["nmt_nfkc", "nfkc", "identity"])
def test_whitespace_alone_is_not_warned_about(tmp_path, caplog, normalization):
    """SentencePiece collapses spaces whatever the rule, and a no-break space or a tab is whitespace too."""
    odd = ["der\u00a0Hund  läuft\tschnell", " die  Katze "] * 10
    text = ParallelText(sentences(100, "de") + odd, sentences(100, "en") + odd, 0)
    with caplog.at_level(logging.WARNING, logger="aiayn.data.dataset"):
        train_tokenizer(text, tmp_path, 40, normalization=normalization)
    assert caplog.records == []


def cjk_text():
    """30 frequent characters and 60 that occur once each: 0.04% of the characters, under 1 - 0.9995."""
    common = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年"
    src = ["".join(common[(i * 7 + j) % len(common)] for j in range(60)) for i in range(1500)]
    src[::25] = [line + chr(0x4E00 + 500 + k) for k, line in enumerate(src[::25])]
    return ParallelText(src, [f"the dog runs {i % 10}" for i in range(1500)], 0)


def test_an_alphabet_larger_than_the_vocabulary_names_the_settings_that_fix_it(tmp_path):
    text = cjk_text()
    distinct = len(set("".join(text.src + text.tgt)))  # with SentencePiece's word boundary for the space
    with pytest.raises(UserError) as e:
        train_tokenizer(text, tmp_path / "full", 64)
    assert str(e.value) == (
        f"data.vocab_size=64: the text has {distinct} distinct characters, too many for the vocabulary "
        f"and its 4 special pieces; raise data.vocab_size to at least {distinct + 4}, or lower "
        "data.character_coverage (0.9995 is usual for Chinese and Japanese)"
    )
    assert train_tokenizer(text, tmp_path / "enough", distinct + 4).src_vocab_size == distinct + 4
    tok = train_tokenizer(text, tmp_path / "covered", 64, character_coverage=0.9995)
    assert tok.src_vocab_size == 64
    assert tok.unk_id not in tok.encode_tgt(text.src[1])
    assert any(tok.unk_id in tok.encode_tgt(line) for line in text.src[::25])  # the rarest are <unk>


@pytest.mark.parametrize(("coverage", "kept", "advice"), [
    (0.9995, 54, ", or lower data.character_coverage (0.98 at the lowest)"),
    (0.98, 41, ""),
])
def test_too_many_characters_advises_only_what_can_be_done(tmp_path, coverage, kept, advice):
    """"0.9995 is usual" was advised at 0.9995, and lowering the coverage at 0.98, below which
    data.character_coverage is refused."""
    with pytest.raises(UserError) as e:
        train_tokenizer(cjk_text(), tmp_path, 40, character_coverage=coverage)
    assert str(e.value) == (
        f"data.vocab_size=40: the text has {kept} distinct characters at data.character_coverage={coverage}, "
        f"too many for the vocabulary and its 4 special pieces; raise data.vocab_size to at least {kept + 4}"
        f"{advice}"
    )


def test_an_edit_that_keeps_size_and_mtime_is_not_read_from_the_cache(tmp_path, corpus_files):
    """Same size, `touch -d` back to the old mtime: the stale ids were served (a --resume trained on them)."""
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    before, _ = load_encoded(src, tgt, tok, tmp_path / "cache")
    st = tgt.stat()
    text = tgt.read_text(encoding="utf-8")
    swapped = text.replace("a", "\0").replace("e", "a").replace("\0", "e")  # same length, other words
    assert swapped != text and len(swapped.encode()) == st.st_size
    tgt.write_text(swapped, encoding="utf-8")
    os.utime(tgt, ns=(st.st_atime_ns, st.st_mtime_ns))
    after, _ = load_encoded(src, tgt, tok, tmp_path / "cache")
    assert [after.target(i) for i in range(3)] == [tok.encode_tgt(line) for line in swapped.splitlines()[:3]]
    assert [after.target(i) for i in range(3)] != [before.target(i) for i in range(3)]


@pytest.mark.parametrize("damage", ["missing", "2d", "offsets", "ids", "float", "dropped"])
def test_a_cache_with_wrong_contents_is_rebuilt_not_trusted(tmp_path, corpus_files, damage, caplog):
    """Valid safetensors with the right key but wrong tensors: tracebacks later (KeyError, IndexError) or,
    for offsets out of order or other dtypes, training on garbage."""
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    good, _ = load_encoded(src, tgt, tok, tmp_path / "cache")
    [path] = (tmp_path / "cache").glob("*.safetensors")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    t = load_file(str(path))
    if damage == "missing":
        del t["tgt_offsets"]
    elif damage == "2d":
        t["src_ids"] = t["src_ids"][None]
    elif damage == "offsets":
        t["src_offsets"] = t["src_offsets"].flip(0).contiguous()
    elif damage == "ids":
        t["tgt_ids"] = t["tgt_ids"] + 1000
    elif damage == "float":
        t["src_ids"] = t["src_ids"].float()
    else:
        meta = {**meta, "dropped_empty": "abc"}
    save_file(t, str(path), metadata=meta)
    with caplog.at_level("WARNING", logger="aiayn.data.dataset"):
        again, _ = load_encoded(src, tgt, tok, tmp_path / "cache")
    assert "unreadable cache" in caplog.text and "re-encoding" in caplog.text
    assert [again.source(i) for i in range(len(good))] == [good.source(i) for i in range(len(good))]


def test_a_cache_folder_that_is_a_file_or_a_directory_with_a_caches_name_is_one_line_or_skipped(
        tmp_path, corpus_files):
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    (tmp_path / "cache_file").write_text("mine")
    with pytest.raises(UserError, match="cannot write the encoded-ids cache"):  # was NotADirectoryError
        load_encoded(src, tgt, tok, tmp_path / "cache_file")
    cache = tmp_path / "cache"
    (cache / f"{src.name}-{tgt.name}.0123456789abcdef.safetensors").mkdir(parents=True)  # IsADirectoryError
    corpus, _ = load_encoded(src, tgt, tok, cache)
    assert len(corpus) == 201


@pytest.mark.parametrize("name", ["<stdin>", "/dev/stdin", "/dev/fd/63", "/proc/self/fd/0"])
def test_cr_line_ends_of_a_stream_are_told_a_pipe_not_a_file(name):
    """`tr '\\r' '\\n' < /dev/stdin > /dev/stdin.lf` cannot run: a stream has no place beside it."""
    from aiayn.data.lines import cr_only_error

    assert str(cr_only_error(name)).endswith("convert it, e.g. pipe it through tr '\\r' '\\n' before aiayn")

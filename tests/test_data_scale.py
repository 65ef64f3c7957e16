"""Corpora are read and encoded in chunks: the ids of the whole file at once, in a fraction of the memory."""

import random
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

from aiayn.data import dataset, lines, tokenizer
from aiayn.data.dataset import (
    EncodedCorpus,
    load_encoded,
    read_lines,
    read_parallel,
    scan_parallel,
    train_tokenizer,
)

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"  # as configs/tiny.toml has it


def read_whole(path: Path) -> list[str]:
    """read_lines as it was: the whole file decoded at once, then split."""
    lines = path.read_bytes().decode("utf-8").removeprefix("\ufeff").split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]


def encoded_whole(src: Path, tgt: Path, tokenizer) -> EncodedCorpus:
    """load_encoded as it was: every line in memory, encoded one at a time, flattened through Python lists."""
    pairs = [(s, t) for s, t in zip(read_whole(src), read_whole(tgt)) if s.strip() and t.strip()]
    x = [tokenizer.encode_src(s) for s, _ in pairs]
    y = [tokenizer.encode_tgt(t) for _, t in pairs]

    def flat(seqs):
        offsets = [0]
        for s in seqs:
            offsets.append(offsets[-1] + len(s))
        return torch.tensor([i for s in seqs for i in s], dtype=torch.int32), torch.tensor(offsets)

    return EncodedCorpus(*flat(x), *flat(y))


def assert_same(a: EncodedCorpus, b: EncodedCorpus) -> None:
    for name in ("src_ids", "src_offsets", "tgt_ids", "tgt_offsets"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


@pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"needs the Multi30k text in {MULTI30K}")
def test_chunks_give_the_ids_of_the_whole_file(tmp_path, monkeypatch):
    """3,000 Multi30k pairs with a BOM, CRLF line ends and blank pairs, in blocks and chunks that end
    anywhere: the tensors the whole-file, line-by-line encoding gave, and the cache holds them."""
    de, en = (read_lines(MULTI30K / f"train.{lang}")[:3000] for lang in ("de", "en"))
    de[10], en[20], de[30], en[30] = "", " ", "", ""
    src, tgt = tmp_path / "train.de", tmp_path / "train.en"
    src.write_bytes(("\ufeff" + "\r\n".join(de) + "\r\n").encode())
    tgt.write_bytes("\n".join(en).encode())  # no final newline
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 500)
    want = encoded_whole(src, tgt, tok)
    assert len(want) == 2997
    whole, dropped = load_encoded(src, tgt, tok, tmp_path / "one-chunk")
    assert_same(whole, want)
    assert dropped == 3
    monkeypatch.setattr(lines, "READ_BLOCK", 1000)  # bytes: lines and UTF-8 characters cross blocks
    monkeypatch.setattr(dataset, "ENCODE_CHUNK", 333)
    chunked, _ = load_encoded(src, tgt, tok, tmp_path / "chunks")
    assert_same(chunked, want)
    cached, _ = load_encoded(src, tgt, tok, tmp_path / "chunks")
    assert_same(cached, want)


@pytest.mark.skipif(not MULTI30K.is_dir(), reason=f"needs the Multi30k text in {MULTI30K}")
@pytest.mark.parametrize(("shared", "model_type"), [(True, "bpe"), (False, "unigram")])
def test_a_tokenizer_streamed_from_the_files_is_the_one_trained_on_their_text(
    tmp_path, monkeypatch, shared, model_type
):
    """3,000 Multi30k pairs with a BOM, CRLF line ends, and blank, zero-width and control-character lines
    that drop 6 pairs: the models trained from the text held and from the files, read in blocks that end
    anywhere, are the same bytes, and the normalization check samples the same lines."""
    de, en = (read_lines(MULTI30K / f"train.{lang}")[:3000] for lang in ("de", "en"))
    de[10], en[20], de[30], en[30], de[40], en[50], en[60] = "", " ", "", "", "\u200b", "\x01\u200e", "\t"
    src, tgt = tmp_path / "train.de", tmp_path / "train.en"
    src.write_bytes(("\ufeff" + "\r\n".join(de) + "\r\n").encode())
    tgt.write_bytes("\n".join(en).encode())  # no final newline
    held = read_parallel(src, tgt)
    train_tokenizer(held, tmp_path / "held", 1000, model_type, shared)
    monkeypatch.setattr(lines, "READ_BLOCK", 1000)  # bytes: lines and UTF-8 characters cross blocks
    files = scan_parallel(src, tgt)
    train_tokenizer(files, tmp_path / "files", 1000, model_type, shared)
    assert len(files.src) == len(files.tgt) == len(held.src) == 2994 and files.dropped_empty == 6
    # In the same order too: below SEED_SENTENCES a model depends on the lines alone (one dropped pair
    # more changes it), above it on their order as well, through the sample of line numbers drawn.
    assert list(files.src) == held.src and list(files.tgt) == held.tgt
    models = sorted(path.name for path in (tmp_path / "held").iterdir())
    assert models == (["spm.model"] if shared else ["source.spm", "target.spm"])
    assert sorted(path.name for path in (tmp_path / "files").iterdir()) == models
    for name in models:
        assert (tmp_path / "files" / name).read_bytes() == (tmp_path / "held" / name).read_bytes(), name
    n, k = len(held.src), 1000
    for side in ("src", "tgt"):  # the lines the held text's sample took by index
        want = [getattr(held, side)[i * n // k] for i in range(k)]
        assert dataset._evenly_spaced(getattr(files, side), k) == want


@pytest.mark.parametrize("sampled", [False, True])
def test_a_tokenizer_trained_from_the_files_does_not_hold_their_text(tmp_path, monkeypatch, sampled):
    """read_parallel held the text as Python strings (0.44 GB per million WMT-length pairs): 1.75x the
    strings' bytes at the peak of training here. scan_parallel holds a byte per pair, and a block of
    lines at a time while SentencePiece reads them. Scaled down: blocks of 64 KiB, chunks of 16 lines sent
    to SentencePiece's process and a normalization sample of 200 lines of 20,000 pairs, as 4 MiB, 1,000
    and 2,000 are of millions. `sampled`: a model's sample of 10,000 of the 40,000 lines, its flags drawn
    4,096 at a time, holds no more."""
    src, tgt = made_up_corpus(tmp_path, 20_000)
    monkeypatch.setattr(lines, "READ_BLOCK", 1 << 16)
    monkeypatch.setattr(dataset, "ROUND_TRIP_SAMPLE", 200)
    monkeypatch.setattr(tokenizer, "CHUNK_LINES", 16)
    if sampled:
        monkeypatch.setattr(dataset, "SEED_SENTENCES", 10_000)
        monkeypatch.setattr(dataset, "SAMPLE_BLOCK", 4096)
    # a first training imports what it needs (numpy.random for a sample, hmac for multiprocessing: 0.7 MB
    # of modules, which a test run alone, as on a machine of many test workers, traced as text held)
    train_tokenizer(scan_parallel(src, tgt), tmp_path / "first", 1000)
    tracemalloc.start()  # Python's and numpy's allocations, not SentencePiece's own copy of its sample
    try:
        train_tokenizer(scan_parallel(src, tgt), tmp_path / "files", 1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    text = read_parallel(src, tgt)
    held = sum(map(sys.getsizeof, text.src + text.tgt))  # 6.4 MB
    assert peak < held / 5, (peak, held)


def made_up_corpus(directory: Path, pairs: int) -> tuple[Path, Path]:
    """Unique lines of made-up words, about the length of WMT sentences."""
    r = random.Random(0)
    letters = "abcdefghiklmnoprstuwäöü"
    words = ["".join(r.choice(letters) for _ in range(r.randint(2, 9))) for _ in range(3000)]
    paths = directory / "train.xx", directory / "train.yy"
    for path in paths:
        path.write_text("".join(" ".join(r.choices(words, k=r.randint(3, 25))) + "\n" for _ in range(pairs)))
    return paths


def test_encoding_takes_a_small_multiple_of_the_ids(tmp_path, monkeypatch):
    """The whole corpus as Python strings and int lists took 8x its int32 ids here (15x the files' bytes
    for 2M WMT-like pairs: 4.2 GB); chunks take the ids twice, while they are joined, and one chunk.
    Scaled down: 20,000 pairs in chunks of 1,000, as 2M pairs are in chunks of 20,000 (ENCODE_CHUNK)."""
    src, tgt = made_up_corpus(tmp_path, 20_000)
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 1000)
    # raising: it runs on older aiayn, whose dataset held READ_BLOCK (or had none) before lines.py did
    monkeypatch.setattr(sys.modules.get("aiayn.data.lines", dataset), "READ_BLOCK", 1 << 16, raising=False)
    monkeypatch.setattr(dataset, "ENCODE_CHUNK", 1000, raising=False)
    tracemalloc.start()  # Python's and numpy's allocations (not SentencePiece's, which are per chunk)
    try:
        corpus, _ = load_encoded(src, tgt, tok, tmp_path / "cache")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    ids_bytes = 4 * (len(corpus.src_ids) + len(corpus.tgt_ids))  # 7 MB, from 4 MB of text
    assert peak < 3 * ids_bytes, (peak, ids_bytes)

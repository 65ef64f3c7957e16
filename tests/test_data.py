"""Parallel text is read, checked, encoded once and cached; bad files give one line naming file and line."""

import pytest

from aiayn.data.dataset import collate, find_tokenizer, load_encoded, read_parallel, train_tokenizer
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


def test_read_parallel_drops_and_counts_empty_pairs(tmp_path):
    src = write(tmp_path / "a.de", ["eins", "", "drei", "vier", "   "])
    tgt = write(tmp_path / "a.en", ["one", "two", "", "four", "five"])
    text = read_parallel(src, tgt)
    assert text.src == ["eins", "vier"] and text.tgt == ["one", "four"] and text.dropped_empty == 3


def test_crlf_and_missing_final_newline(tmp_path):
    src = write(tmp_path / "a.de", [], raw=b"eins\r\nzwei")
    tgt = write(tmp_path / "a.en", [], raw=b"one\r\ntwo\n")
    assert read_parallel(src, tgt).src == ["eins", "zwei"]


def test_errors_name_file_and_line(tmp_path):
    good = write(tmp_path / "a.en", ["one", "two", "three"])
    with pytest.raises(UserError, match=r"missing\.de: file not found"):
        read_parallel(tmp_path / "missing.de", good)
    short = write(tmp_path / "short.de", ["eins", "zwei"])
    with pytest.raises(UserError, match=r"a\.en:3: line counts differ: .*short\.de has 2 lines"):
        read_parallel(short, good)
    bad = write(tmp_path / "bad.de", [], raw="eins\nzwei\n".encode() + b"dr\xffei\n")
    with pytest.raises(UserError, match=r"bad\.de:3: invalid UTF-8"):
        read_parallel(bad, good)


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    src = write(d / "train.de", sentences(200, "de") + ["Hund " * 40])
    tgt = write(d / "train.en", sentences(200, "en") + ["dog " * 40])
    return d, src, tgt


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


def test_encode_once_then_cache(tmp_path, corpus_files, monkeypatch):
    _, src, tgt = corpus_files
    tok = train_tokenizer(read_parallel(src, tgt), tmp_path, 40)
    first, dropped = load_encoded(src, tgt, tok, tmp_path / "cache")
    assert len(first) == 201 and dropped == 0
    assert first.source(0) == tok.encode_src(sentences(1, "de")[0]) and first.source(0)[-1] == tok.eos_id
    assert first.target(0) == tok.encode_tgt(sentences(1, "en")[0])

    def no_encoding(*_):
        raise AssertionError("re-encoded although cached")

    monkeypatch.setattr(type(tok), "encode_src", no_encoding)
    again, _ = load_encoded(src, tgt, tok, tmp_path / "cache")
    assert [again.source(i) for i in range(201)] == [first.source(i) for i in range(201)]
    assert [again.target(i) for i in range(201)] == [first.target(i) for i in range(201)]
    longest = max(max(s, t) for s, t in zip(first.src_lengths()[:200], first.tgt_lengths()[:200]))
    assert min(len(first.source(200)), len(first.target(200)) + 1) > longest  # the 40-word pair
    filtered, too_long = again.filter_length(longest)
    assert too_long == 1 and len(filtered) == 200
    assert [filtered.source(i) for i in range(200)] == [first.source(i) for i in range(200)]
    assert [filtered.target(i) for i in range(200)] == [first.target(i) for i in range(200)]


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

"""SentencePiece's training (tokenizer.py): in a child process that a Ctrl-C ends at once, the same model as
SentencePiece trained in this process."""

import io
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import sentencepiece as spm
from conftest import record_disk_events

from aiayn.data.tokenizer import MAX_LINE_BYTES, sentencepiece_model, train_sentencepiece, trained_settings
from aiayn.errors import CorruptFile


def made_up_text(lines: int) -> list[str]:
    """Lines of made-up words: a unigram model of 4000 pieces trains for seconds on 5000 of them."""
    r = random.Random(0)
    letters = "abcdefghiklmnoprstuwäöü"
    words = ["".join(r.choice(letters) for _ in range(r.randint(3, 10))) for _ in range(5000)]
    return [" ".join(r.choices(words, k=12)) for _ in range(lines)]


def children_running_spm() -> list[str]:
    """The pids of this process' children that run spm_child.py (Linux: /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid() and b"spm_child" in (stat.parent / "cmdline").read_bytes():
                found.append(stat.parent.name)
        except (OSError, IndexError, ValueError):  # ended meanwhile
            pass
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="lists processes through /proc")
def test_ctrl_c_stops_sentencepiece_training_at_once(tmp_path, ctrl_c_handled):
    """SentencePieceTrainer.train is C++ that returns to Python only once done: a Ctrl-C during it, even a
    second one, waited for the end (13 s on Multi30k, minutes on WMT). Now its process is killed."""
    lines = made_up_text(5000)
    start = time.monotonic()
    sentencepiece_model(lines, 4000, "unigram")
    whole = time.monotonic() - start
    delay = 0.1
    sent = []

    def then_ctrl_c():  # every line read: SentencePiece trains in C++ now
        yield from lines
        sent.append(time.monotonic() + delay)
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()

    with pytest.raises(KeyboardInterrupt):
        train_sentencepiece(then_ctrl_c(), tmp_path / "spm", 4000, "unigram")
    stopped = time.monotonic() - sent[0]
    assert stopped < whole / 2, f"stopped {stopped:.2f} s after Ctrl-C; training takes {whole:.2f} s"
    assert list(tmp_path.iterdir()) == [] and children_running_spm() == []


def test_the_model_is_sentencepieces_own_byte_for_byte():
    """The lines reach the child exactly: tabs, carriage returns, Unicode line separators, a line longer
    than SentencePiece's default limit, an empty one; the model is the one its training in this process
    makes with the same options."""
    lines = made_up_text(300) + ["a\tb", "c\rd", "e\u2028f", "g\x0bh\x1ci", " lead", "trail ", "", "🙂 x",
                                 "long " * 2000]
    for model_type, vocab_size in (("bpe", 200), ("unigram", 300)):
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type=model_type,
            character_coverage=1.0, normalization_rule_name="nmt_nfkc", pad_id=0, bos_id=1, eos_id=2,
            unk_id=3, hard_vocab_limit=False, input_sentence_size=0, max_sentence_length=MAX_LINE_BYTES,
            num_threads=2, minloglevel=2,
        )
        assert sentencepiece_model(lines, vocab_size, model_type) == model.getvalue()


@pytest.mark.parametrize("options, settings", [
    ({}, ("unigram", "nmt_nfkc", 0.9995)),  # SentencePiece's defaults, which it does not write
    ({"model_type": "bpe", "character_coverage": 1.0}, ("bpe", "nmt_nfkc", 1.0)),
    ({"model_type": "char", "character_coverage": 0.98, "normalization_rule_name": "nfkc_cf"},
     ("char", "nfkc_cf", 0.98)),
    ({"model_type": "word", "character_coverage": 0.9999, "normalization_rule_name": "identity"},
     ("word", "identity", 0.9999)),
])
def test_a_models_training_settings_are_read_from_it(options, settings):
    """SentencePiece's Python API gives none of them: read from the model's protobuf, the coverage, a
    float32, as the decimal it was given as (0.9995, not 0.9994999766349792)."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(made_up_text(50)), model_writer=model,
                                   vocab_size=60, hard_vocab_limit=False, minloglevel=2, **options)
    read = trained_settings(model.getvalue())
    assert (read["spm_type"], read["normalization"], read["character_coverage"]) == settings


@pytest.mark.parametrize("tail", [
    b"\x18\x02",  # ModelProto's field 3 (normalizer_spec) as a varint: an unknown field
    b"\x12\x02\x50\x02",  # a trainer_spec whose field 10 (character_coverage) is a varint
    b"\x1a\x02\x08\x01",  # a normalizer_spec whose field 1 (name) is a varint
    b"\x12\x02\x18\x07",  # model_type 7, no ModelType: an unknown enum value, which leaves bpe
    b"\x12\x02\x1b\x1c",  # a group in trainer_spec, whose end group was read as 4 bytes of a number
])
def test_training_settings_are_read_as_protobuf_reads_fields_of_another_wire_type(tail):
    """Fields SentencePiece loads a model with, as unknown fields, were read as the setting of their number
    whatever their wire type: a TypeError or an AttributeError, or model_type 7 said as 'model type 7'
    where SentencePiece encodes as the bpe model it was. A trainer_spec given twice is the two merged."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(made_up_text(50)), model_writer=model,
                                   vocab_size=60, hard_vocab_limit=False, minloglevel=2, model_type="bpe",
                                   character_coverage=0.9999, normalization_rule_name="nfkc")
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue() + tail)
    bpe = spm.SentencePieceProcessor(model_proto=model.getvalue())
    assert sp.encode(made_up_text(5)) == bpe.encode(made_up_text(5))  # SentencePiece reads the bpe model
    read = trained_settings(sp.serialized_model_proto())
    assert (read["spm_type"], read["normalization"], read["character_coverage"]) == ("bpe", "nfkc", 0.9999)


def test_training_settings_that_cannot_be_read_are_a_corrupt_file():
    """A backstop: what the wire reader cannot read is one line naming the file, not a traceback."""
    with pytest.raises(CorruptFile, match=r"^x/spm\.model: its training settings cannot be read \("):
        trained_settings(b"\x12\x05\x18", "x/spm.model")


def test_sentencepieces_refusal_is_its_runtime_error():
    with pytest.raises(RuntimeError, match=r"Vocabulary size is smaller than required_chars\. 10 vs 31"):
        sentencepiece_model(["abcdefghijklmnopqrstuvwxyz"], 10)


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="names flushed files through /proc")
def test_the_model_is_on_disk_before_its_name(tmp_path, monkeypatch):
    """spm.model was written and renamed into place unflushed: after a power loss the name could hold an
    empty file, which every later run refused. Its bytes are flushed before the rename, the rename after."""
    events = record_disk_events(monkeypatch)
    path = train_sentencepiece(made_up_text(100), tmp_path / "spm", 100)
    renames = [e for e in events if e[0] == "replace" and e[2] == path]
    assert len(renames) == 1
    at = events.index(renames[0])
    assert ("fsync", renames[0][1]) in events[:at] and ("fsync", tmp_path) in events[at:]
    assert spm.SentencePieceProcessor(model_file=str(path)).get_piece_size() == 100


def test_identity_keeps_every_character_but_not_every_space():
    """DataConfig.normalization's comment, configs/tiny.toml and this module said "identity" keeps the text
    exactly (or changes nothing); SentencePiece's rule keeps every character, but writes a run of spaces as
    one and drops those at the ends of a line, as the README says."""
    text = "ab\u200cc ｆi  de"  # a ZWNJ and a fullwidth f, which nmt_nfkc turns into a space and an f
    model = spm.SentencePieceProcessor(model_proto=sentencepiece_model(made_up_text(300) + [text] * 5, 200,
                                                                       normalization="identity"))
    assert model.decode(model.encode(f"  {text}   ")) == "ab\u200cc ｆi de"

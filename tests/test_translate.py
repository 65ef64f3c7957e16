"""Translating lists, files and stdin: input order, empty lines, batching invisible, the CLI's formats."""

import contextlib
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from aiayn.cli import main
from aiayn.config import ConfigError
from aiayn.decoding import DecodeConfig, Ensemble, generate, length_penalty
from aiayn.decoding.cpu import packing_available
from aiayn.errors import SentenceTooLong, UserError
from aiayn.files import _stream_only, atomic_output
from aiayn.translate import (
    Translator, decode_config, length_sorted_batches, quantize_int8, read_utf8_lines, translate,
    translate_stream,
)
from conftest import numbers_checkpoint, padded_batch, tiny_model, vm_flags

TEXTS = ["the number 12 is even", "", "odd", "und die Zahl 7 ist odd und die Zahl 8 ist even", "  ",
         "the number 3"]
OPTIONS = dict(beam=2, max_len_a=0.0, max_len_b=6)
OPTIONS_ARGS = ["--beam", "2", "--max-len-a", "0", "--max-len-b", "6"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return numbers_checkpoint(tmp_path_factory.mktemp("translate"))


def alone(translator, text):
    """The reference: one sentence, no batching, straight through the search."""
    if not text.strip():
        return ""
    src = torch.tensor([translator.tokenizer.encode_src(text)])
    best = generate(translator.model, src, DecodeConfig(**OPTIONS))[0][0]
    return translator.tokenizer.decode_tgt(best.tokens)


def test_batched_translation_keeps_order_and_empty_lines(checkpoint):
    translator = Translator.load(checkpoint)
    out = translator.translate(TEXTS, max_tokens=30, **OPTIONS)  # small budget: several length-sorted batches
    assert out == [alone(translator, t) for t in TEXTS]
    assert out[1] == out[4] == "" and any(out)
    assert translate(checkpoint, TEXTS[:1], **OPTIONS) == out[:1]  # the one-call helper


def test_the_docs_say_which_searches_depend_on_the_batch(capsys):
    """float32 searches translate each text as alone (above); int8's one activation scale per batch and
    bfloat16 or float16 attention, rounded otherwise beside a longer text's padding, do not. The docs named
    int8 alone (a demo model in bfloat16, greedy: 2 of 80 lines came out otherwise with --chunk 1)."""
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").split())
    assert ("With `--int8`, and in bfloat16 or float16, a line's translation can also depend on the lines "
            "batched with it, so a pipe's output can vary with its timing") in readme
    doc = " ".join(Translator.hypotheses.__doc__.split())
    assert "searches do not in float32, but do on int8 weights" in doc and "in bfloat16 or float16" in doc
    with pytest.raises(SystemExit):
        main(["translate", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "as with --int8, a line's translation can depend on the lines batched with it" in shown


def test_n_best_hypotheses_are_ranked(checkpoint):
    hyps = Translator.load(checkpoint).hypotheses(TEXTS, n_best=2, **OPTIONS)
    assert [len(h) for h in hyps] == [2, 0, 2, 2, 0, 2]
    assert all(h[0].score >= h[1].score for h in hyps if h)


def test_n_best_rows_are_marians_with_log_prob_and_score(checkpoint):
    """`LINE ||| TEXT ||| F0= LOG_PROB ||| SCORE` (Marian's n-best; Moses' has the same four fields), with
    exactly n_best rows per input line: an empty line gets n_best empty ones, not one. F0 is the raw
    log P(Y | X) of the search's hypothesis, SCORE that divided by the length penalty."""
    translator = Translator.load(checkpoint)
    dst = io.StringIO()
    data = ("\n".join(TEXTS) + "\n").encode()
    assert translate_stream(translator, io.BytesIO(data), dst, "in.txt", n_best=2, **OPTIONS) == len(TEXTS)
    rows = [line.split(" ||| ") for line in dst.getvalue().splitlines()]
    assert [int(r[0]) for r in rows] == [i for i in range(len(TEXTS)) for _ in range(2)]
    assert all(len(r) == 4 and re.fullmatch(r"F0= -?\d+\.\d{4}", r[2]) for r in rows), rows
    text_of, config = translator.tokenizer.decode_tgt, DecodeConfig(n_best=2, **OPTIONS)
    for i, text in enumerate(TEXTS):
        if not text.strip():
            assert rows[2 * i : 2 * i + 2] == [[str(i), "", "F0= 0.0000", "0.0000"]] * 2
            continue
        found = generate(translator.model, torch.tensor([translator.tokenizer.encode_src(text)]), config)[0]
        expected = [[str(i), text_of(h.tokens), f"F0= {h.log_prob:.4f}", f"{h.score:.4f}"] for h in found]
        assert rows[2 * i : 2 * i + 2] == expected
    best = translator.hypotheses(TEXTS[:1], **OPTIONS)[0][0]
    lp = length_penalty(len(best.tokens), DecodeConfig.lenpen, DecodeConfig.lenpen_kind)
    assert best.log_prob < 0 and best.score == pytest.approx(best.log_prob / lp)


def test_sample_alone_means_beam_one_in_the_api(checkpoint):
    """As --sample does in the CLI: sample=True without a beam samples (it was refused for the default
    beam 4); an explicit other beam is still a contradiction."""
    translator = Translator.load(checkpoint)
    texts = ["the number 12 is even"] * 5
    options = dict(sample=True, seed=3, temperature=3.0, max_len_a=0.0, max_len_b=6)
    assert translator.translate(texts, **options) == translator.translate(texts, beam=1, **options)
    assert decode_config(sample=True).beam == decode_config(DecodeConfig(beam=8), sample=True).beam == 1
    with pytest.raises(ConfigError, match="sample=True needs beam=1, not 4"):
        translator.translate(texts, sample=True, beam=4)


def test_a_translator_over_a_training_model_says_it_turned_dropout_off(checkpoint, caplog):
    """Translator(model, tokenizer) puts the caller's model in eval mode, as it must to translate: a check
    in the middle of the caller's own training went on training without dropout, silently."""
    loaded = Translator.load(checkpoint)
    model = loaded.model.train()
    with caplog.at_level("WARNING", logger="aiayn"):
        Translator(model, loaded.tokenizer)
    assert not model.training and caplog.messages == [
        ("Translator: the model was in training mode and is now in eval mode (no dropout); call "
         "model.train() before training it further")]
    caplog.clear()
    with caplog.at_level("WARNING", logger="aiayn"):
        Translator(model, loaded.tokenizer)  # in eval mode already: nothing to say
        Translator.load([checkpoint, checkpoint])
        for m in model.modules():  # Monte Carlo dropout: the model in eval mode, its dropout on
            if isinstance(m, torch.nn.Dropout):
                m.train()
        Translator(model, loaded.tokenizer)
    assert caplog.messages == []
    assert all(m.training for m in model.modules() if isinstance(m, torch.nn.Dropout))  # kept: generate does
    for int8 in (False, True):  # packed or quantized: the new modules in eval mode too
        assert not any(m.training for m in Translator.load(checkpoint, int8=int8).model.modules())
    members = [Translator.load(checkpoint).model for _ in range(2)]
    with caplog.at_level("WARNING", logger="aiayn"):
        Translator(Ensemble(members), loaded.tokenizer)  # a new Ensemble is in training mode, its members not
    assert caplog.messages == []


def test_a_translator_refuses_a_tokenizer_that_does_not_fit_its_model(checkpoint):
    """Translator(model, tokenizer) took any pair, as load_checkpoint does not: a tokenizer with more pieces
    than the model's embeddings failed in their lookup (an IndexError traceback), and one with another EOS
    id ended sentences with an id the model does not stop at, silently."""
    loaded = Translator.load(checkpoint)
    pieces = loaded.tokenizer.src_vocab_size
    refused = (rf"^Translator: the source tokenizer has {pieces} pieces but the model 40 embeddings: not the "
               r"tokenizer this model was trained with$")
    with pytest.raises(UserError, match=refused):
        Translator(tiny_model(vocab_size=40), loaded.tokenizer)
    with pytest.raises(UserError, match=r"^Translator: the tokenizer's eos id is 2, the model's eos_id 3: "):
        Translator(tiny_model(vocab_size=pieces, eos_id=3), loaded.tokenizer)
    Translator(tiny_model(vocab_size=pieces), loaded.tokenizer)  # one that fits


def test_a_translator_refuses_what_is_no_model_tokenizer_or_decode_config(checkpoint):
    """A dict config, or None for the model or tokenizer, was taken, then failed at the first translation
    or in the vocabulary check with an AttributeError ("'dict' object has no attribute 'beam'")."""
    loaded = Translator.load(checkpoint)
    model, tokenizer = loaded.model, loaded.tokenizer
    with pytest.raises(TypeError, match=r"^Translator takes a DecodeConfig, not dict: build one with "
                                        r"DecodeConfig\(beam=4, \.\.\.\)"):
        Translator(model, tokenizer, {"beam": 2})
    with pytest.raises(TypeError, match=r"^Translator takes a Transformer \(or an Ensemble\), not NoneType: "
                                        r"load_checkpoint\(path\)\.model"):
        Translator(None, tokenizer)
    for wrong in (None, str(checkpoint)):
        with pytest.raises(TypeError, match=rf"^Translator takes the model's Tokenizer, not {type(wrong).__name__}"
                                            r": load_checkpoint\(path\)\.tokenizer"):
            Translator(model, wrong)
    assert Translator(model, tokenizer, DecodeConfig(beam=2)).config.beam == 2


def test_a_translator_its_tokenizer_and_its_checkpoint_print_in_one_short_line(checkpoint):
    """Translator and Tokenizer printed as "<... object at 0x...>", a Checkpoint as the model's module tree
    (53 lines)."""
    from aiayn.checkpoint import Checkpoint, load_checkpoint
    from aiayn.data.tokenizer import Tokenizer

    loaded = load_checkpoint(checkpoint)
    size = loaded.tokenizer.src_vocab_size
    tokenizer = f"Tokenizer(vocab_size={size}, SentencePiece model {checkpoint}/spm.model)"
    assert repr(loaded.tokenizer) == tokenizer
    assert repr(loaded) == f"Checkpoint({str(checkpoint)!r}, parameters={loaded.model.num_parameters():,})"
    # Checkpoint(model, tokenizer) printed its path as 'None'; two SentencePiece models printed as the
    # source's alone, and Marian's one vocabulary over two models as "shared=False"
    assert repr(Checkpoint(loaded.model, loaded.tokenizer)).startswith("Checkpoint(path=None, parameters=")
    spm = checkpoint / "spm.model"
    vocab = {loaded.tokenizer.src.id_to_piece(i): i for i in range(size)}
    for vocabularies, sizes in (({}, f"src_vocab_size={size}, tgt_vocab_size={size}"),
                                ({"vocab": vocab}, f"vocab_size={size}")):
        assert repr(Tokenizer(spm, spm, **vocabularies)) == (
            f"Tokenizer({sizes}, SentencePiece models {spm}, {spm})")
    c = loaded.model.config
    assert repr(Translator(loaded.model, loaded.tokenizer, DecodeConfig(beam=2))) == (
        f"Translator(d_model={c.d_model}, layers={c.n_layers}+{c.decoder_layers}, {tokenizer}, cpu, "
        "torch.float32, beam=2)")
    assert repr(Translator.load([checkpoint, checkpoint])).startswith("Translator(2 models, Tokenizer(")


def test_a_sampling_translator_searches_for_one_call(checkpoint):
    """A Translator sampling by default could not search for one call: sample=False was refused for the
    temperature and seed it had not given, a beam 4 for the sampling it had not asked for."""
    loaded = Translator.load(checkpoint)
    sampling = Translator(loaded.model, loaded.tokenizer,
                          DecodeConfig(beam=1, sample=True, seed=3, temperature=0.7, top_k=5, n_best=3))
    texts = ["the number 12 is even", "the number 7"]
    cases = [({"sample": False}, {"beam": 1, "n_best": 1}),  # 3 samples: n_best capped at the beam
             ({"beam": 4}, {"beam": 4, "n_best": 3}), ({"beam": 4, "n_best": 2}, {"beam": 4, "n_best": 2}),
             ({"sample": False, "beam": 3}, {"beam": 3, "n_best": 3})]
    for options, expected in cases:
        assert sampling.decode_config(**options) == DecodeConfig(**expected), options
        assert sampling.hypotheses(texts, **options) == loaded.hypotheses(texts, **expected), options
    with pytest.raises(ConfigError, match="top_k=2 needs sample=True"):  # given in this call: a contradiction
        sampling.translate(texts, sample=False, top_k=2)
    with pytest.raises(ConfigError, match="sample=True needs beam=1, not 4"):
        sampling.translate(texts, sample=True, beam=4)
    assert sampling.decode_config(top_p=0.5) == DecodeConfig(beam=1, sample=True, seed=3, temperature=0.7,
                                                             top_k=5, n_best=3, top_p=0.5)  # still sampling


def test_a_searching_translator_narrows_or_samples_for_one_call(checkpoint):
    """The other way round: a Translator searching with beam 5, n_best 5 and early stopping could not search
    with beam 2 ("n_best=5 must be between 1 and beam=2") nor sample or search greedily ("early_stopping=True
    needs beam > 1, not 1") for one call, refused for settings the call had not given."""
    loaded = Translator.load(checkpoint)
    config = DecodeConfig(beam=5, n_best=5, early_stopping=True)
    searching = Translator(loaded.model, loaded.tokenizer, config)
    texts = ["the number 12 is even", "the number 7"]
    cases = [({"beam": 2}, {"beam": 2, "n_best": 2, "early_stopping": True}), ({"beam": 1}, {"beam": 1}),
             ({"sample": True, "seed": 1}, {"beam": 1, "n_best": 5, "sample": True, "seed": 1}),  # 5 samples
             ({"beam": 3, "n_best": 2}, {"beam": 3, "n_best": 2, "early_stopping": True})]
    for options, expected in cases:
        assert searching.decode_config(**options) == DecodeConfig(**expected), options
        assert searching.hypotheses(texts, **options) == loaded.hypotheses(texts, **expected), options
    assert decode_config(DecodeConfig(beam=5, n_best=5), beam=2) == DecodeConfig(beam=2, n_best=2)
    with pytest.raises(ConfigError, match="n_best=3 must be between 1 and beam=2"):  # the call's own
        searching.translate(texts, beam=2, n_best=3)
    with pytest.raises(ConfigError, match="early_stopping=True needs beam > 1, not 1"):
        searching.translate(texts, sample=True, early_stopping=True)


def test_length_sorted_batches_respect_the_budget():
    lengths = [5, 1, 9, 3, 3, 20]
    batches = list(length_sorted_batches(lengths, max_tokens=12, rows_per_sentence=2))
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert [lengths[i] for b in batches for i in b] == sorted(lengths)  # shortest first
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) * 2 <= 12  # a long sentence goes alone


def test_cli_file_to_file_and_errors(checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar is a terminal's
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    args = ["translate", str(checkpoint), "-i", str(src), "-o", str(out), "--beam", "2", "--max-len-a", "0",
            "--max-len-b", "6", "--max-tokens", "30"]
    assert main(args) == 0
    translator = Translator.load(checkpoint)
    assert out.read_text(encoding="utf-8").split("\n") == [alone(translator, t) for t in TEXTS] + [""]
    assert "6/6" in capsys.readouterr().err  # progress on stderr for a file, empty lines counted
    assert main(args + ["--n-best", "2", "-q"]) == 0
    nbest = [line.split(" ||| ") for line in out.read_text(encoding="utf-8").splitlines()]
    assert [int(n) for n, _, _, _ in nbest] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]  # empty lines too
    assert nbest[0][1] == alone(translator, TEXTS[0]) and float(nbest[0][3]) >= float(nbest[1][3])
    before = out.read_text(encoding="utf-8")
    src.write_bytes(b"fine\n\xff\xfe\n")
    assert main(args) == 2
    assert f"{src}:2: invalid UTF-8" in capsys.readouterr().err
    too_long = " ".join(["the number 12"] * translator.model.config.max_len)
    src.write_text(f"the number 3\n{too_long}\n", encoding="utf-8")
    assert main(args) == 2
    assert f"{src}:2: " in (err := capsys.readouterr().err) and "positions of this model" in err
    assert out.read_text(encoding="utf-8") == before  # a failed run leaves the output file as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]  # no temporary left
    assert main(["translate", str(checkpoint), "--beam", "2", "--n-best", "3"]) == 2  # n_best > beam
    assert "--n-best 3 must be between 1 and --beam 2" in capsys.readouterr().err
    for option in ("--threads", "--chunk", "--max-tokens"):
        with pytest.raises(SystemExit) as usage:  # argparse: a usage error, exit status 2
            main(["translate", str(checkpoint), option, "0"])
        assert usage.value.code == 2  # one line, without argparse's dozen lines of usage first
        assert capsys.readouterr().err == (f"aiayn translate: error: argument {option}: invalid positive integer "
                                           "value: '0' (see aiayn translate --help)\n")
    with pytest.raises(SystemExit):  # an option of another command: named by the one that does not know it
        main(["score", str(checkpoint), "--src", "a", "--tgt", "b", "--int8"])
    assert capsys.readouterr().err == ("aiayn score: error: unrecognized arguments: --int8 "
                                       "(see aiayn score --help)\n")
    with pytest.raises(SystemExit):  # before the command: aiayn's
        main(["--int8", "score", str(checkpoint), "--src", "a", "--tgt", "b"])
    assert capsys.readouterr().err == "aiayn: error: unrecognized arguments: --int8 (see aiayn --help)\n"


def test_a_bad_line_late_in_a_file_fails_before_anything_is_translated(checkpoint, tmp_path, capsys,
                                                                         monkeypatch):
    """Invalid UTF-8 at line 3,001 was found after 3,000 lines were translated (minutes at beam 4), and the
    work thrown away with the -o file left as it was; a regular file is checked whole first."""
    src = tmp_path / "in.txt"
    src.write_bytes(b"the number 3\n" * 30 + b"bad \xff\n")

    def translated(*args, **kwargs):
        raise AssertionError("a chunk was translated before the input was checked")

    monkeypatch.setattr(Translator, "hypotheses", translated)
    for quiet in ([], ["-q"]):
        code = main(["translate", str(checkpoint), "-i", str(src), "--chunk", "10", "-o", str(tmp_path / "o")]
                    + quiet)
        assert (code, capsys.readouterr().err) == (2, f"aiayn: error: {src}:31: invalid UTF-8 (byte 0xff)\n")
    # a sentence too long for the model's positions, past the pre-pass's first block of 10,000 lines too
    limit = Translator.load(checkpoint).model.config.max_len
    src.write_text("the number 3\n" * 10_030 + " ".join(["the number 12"] * limit) + "\n")
    code = main(["translate", str(checkpoint), "-i", str(src), "--chunk", "10", "-o", str(tmp_path / "o"),
                 "-q"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"aiayn: error: {src}:10031: ") and f"the {limit} positions" in err
    assert not (tmp_path / "o").exists()


def test_over_long_text_is_named(checkpoint):
    translator = Translator.load(checkpoint)
    limit = translator.model.config.max_len
    with pytest.raises(SentenceTooLong, match=f"text 2: .* more than the {limit} positions"):
        translator.translate(["the number 3", " ".join(["the number 12"] * limit)])


def test_every_too_long_line_is_named_in_one_run(checkpoint, tmp_path, capsys):
    """k too long lines took k runs, one named a run: the first is named, and the others counted, the
    first few by number; a file's whole (its check reads it 10,000 lines at a time), before any line is
    translated."""
    translator = Translator.load(checkpoint)
    long = " ".join(["the number 12"] * (translator.model.config.max_len // 3))  # past the positions
    with pytest.raises(SentenceTooLong, match=r"^text 2: \d+ tokens \(with EOS\), more than the \d+ "
                                              r"positions of this model; and 2 more: texts 4, 5$"):
        translator.translate(["the number 3", long, "odd", long, long])
    with pytest.raises(SentenceTooLong, match=r" positions of this model; and 1 more: text 2$"):
        translator.translate([long, long])
    lines = ["the number 3"] * 10_010
    for i in (1, 4, 7, 8, 9, 10, 10_004):  # 0-based: lines 2, 5, ... and one past the first 10,000
        lines[i] = long
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["translate", str(checkpoint), "-i", str(src), "-o", str(out), "-q", "--beam", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiayn: error: {src}:2: ") and err.endswith(
        "positions of this model; and 6 more: lines 5, 8, 9, 10, 11, ...\n"), err
    assert not out.exists()
    # a line that cannot be read after the first chunk: the too long lines before it, of the lines read
    # (all 10,010 before it: the reader hands over the lines before a bad one first)
    src.write_bytes(src.read_bytes() + b"bad \xff\n")
    assert main(["translate", str(checkpoint), "-i", str(src), "-o", str(out), "-q", "--beam", "1"]) == 2
    said = capsys.readouterr().err
    assert said.endswith("; and 6 more in the 10,010 lines read: lines 5, 8, 9, 10, 11, ...\n"), said


def test_a_pipe_gets_the_lines_before_a_too_long_one_first(checkpoint):
    """From a pipe (not checked whole first), `--chunk 2`'s chunk of lines 5 and 6, line 6 too long, lost
    line 5: 4 lines out, then line 6 named, so that a rerun from line 6 never translated line 5."""
    translator = Translator.load(checkpoint)
    long = " ".join(["the number 12"] * (translator.model.config.max_len // 3))
    lines = [f"the number {i}" for i in range(1, 6)] + [long, "odd", long]
    data = ("\n".join(lines) + "\n").encode()
    for n_best, rows in ((1, 5), (2, 10)):
        dst = io.StringIO()
        with pytest.raises(SentenceTooLong, match=r"^<pipe>:6: .* positions of this model$"):
            translate_stream(translator, io.BytesIO(data), dst, "<pipe>", chunk=2, n_best=n_best, **OPTIONS)
        assert len(dst.getvalue().splitlines()) == rows
    assert dst.getvalue().splitlines()[-1].startswith("4 ||| ")  # line 5, counted from 0
    dst = io.StringIO()  # all the lines in one chunk: the others of those read are said
    with pytest.raises(SentenceTooLong, match=r"^<pipe>:6: .*; and 1 more in the 8 lines read: line 8$"):
        translate_stream(translator, io.BytesIO(data), dst, "<pipe>", **OPTIONS)
    assert dst.getvalue().splitlines() == translator.translate(lines[:5], **OPTIONS)


@pytest.mark.parametrize("bad, said", [(b"x\xff", "invalid UTF-8 (byte 0xff)"), (b"x\0", "NUL byte")])
def test_a_pipe_gets_the_lines_before_a_bad_byte_first(checkpoint, bad, said):
    """From a pipe, invalid UTF-8 or a NUL byte lost the lines read before it in its chunk (0 of 20 written),
    though a rerun from the line named needs them, as a too long line's are written first."""
    translator = Translator.load(checkpoint)
    lines = [f"the number {i}" for i in range(1, 6)]
    data = ("\n".join(lines) + "\n").encode() + bad + b"\nthe number 7\n"
    for chunk in (10_000, 2):
        dst = io.StringIO()
        with pytest.raises(UserError, match=rf"^<pipe>:6: {re.escape(said)}"):
            translate_stream(translator, io.BytesIO(data), dst, "<pipe>", chunk=chunk, **OPTIONS)
        assert dst.getvalue().splitlines() == translator.translate(lines, **OPTIONS)


def test_running_out_of_memory_is_one_line_naming_the_batch(checkpoint, tmp_path):
    """--beam 100000000 asks for tens of GB: the allocator's failure, in a process whose address space is
    capped at 8 GB so that it fails on any machine, is one line naming the file and line, exit 2."""
    import subprocess

    src = tmp_path / "in.txt"
    src.write_text("the number 3\n\nthe number 12 is even\n", encoding="utf-8")
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30)); "
            "from aiayn.cli import main; sys.exit(main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", code, "translate", str(checkpoint), "-i", str(src), "-q",
                          "--beam", "100000000", "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        (f"aiayn: error: {src}:1: out of memory decoding a batch of 1 sentence(s) at beam 100000000; "
         "use a smaller beam")]  # not --max-tokens: a batch of one sentence is as small as batches get
    run = subprocess.run([sys.executable, "-c", code, "translate", str(checkpoint), "-i", str(src), "-q",
                          "--sample", "--n-best", "100000000", "--threads", "1"], capture_output=True, text=True,
                         timeout=120)
    assert run.stderr.strip().splitlines() == [  # sampling's rows are the samples; it said "at beam 1"
        (f"aiayn: error: {src}:1: out of memory decoding a batch of 1 sentence(s) at 100000000 samples each "
         "(--n-best); use fewer samples")]


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS caps the address space on Linux")
def test_a_kernels_bad_alloc_is_out_of_memory_too(checkpoint, tmp_path, capsys, monkeypatch):
    """Under `ulimit -v`, beam search's topk (a CPU kernel's own buffer) fails with C++'s std::bad_alloc,
    a RuntimeError other than the allocator's: `translate --beam 50000` was a traceback, exit 1."""
    code = ("import resource, torch; from aiayn.errors import is_out_of_memory\n"
            "x = torch.randn(1, 60_000_000)  # 240 MB; topk's buffer for it takes about 1 GB more\n"
            "size = int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024\n"
            "hard = resource.getrlimit(resource.RLIMIT_AS)[1]\n"
            "resource.setrlimit(resource.RLIMIT_AS, (size + (300 << 20), hard))\n"
            "try:\n    x.topk(1000, dim=1)\nexcept RuntimeError as e:\n"
            "    print(type(e).__name__, str(e).strip(), is_out_of_memory(e))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout == "RuntimeError std::bad_alloc True\n", run.stderr

    def bad_alloc(*args, **kwargs):
        raise RuntimeError("std::bad_alloc")

    monkeypatch.setattr("aiayn.translate.generate", bad_alloc)
    src = tmp_path / "in.txt"
    src.write_text("the number 3\n", encoding="utf-8")
    assert main(["translate", str(checkpoint), "-i", str(src), "-q", "--beam", "50"]) == 2
    assert capsys.readouterr().err == (f"aiayn: error: {src}:1: out of memory decoding a batch of 1 "
                                       "sentence(s) at beam 50; use a smaller beam\n")
    monkeypatch.setattr("aiayn.translate.force_decode", bad_alloc)  # score's batches: the same
    assert main(["score", str(checkpoint), "--src", str(src), "--tgt", str(src), "-q"]) == 2
    assert capsys.readouterr().err == (f"aiayn: error: {src}:1: out of memory scoring a batch of 1 pair(s); "
                                       "the pair alone needs more memory\n")


@pytest.mark.parametrize("batch, beam, samples, advice", [
    (1, 1, 0, "the sentence alone needs more memory"),  # greedy, one sentence: nothing smaller to offer
    (1, 1, 1, "the sentence alone needs more memory"),
    (1, 4, 0, "use a smaller beam"),
    (3, 1, 0, "use fewer tokens per batch (--max-tokens)"),
    (3, 4, 0, "use a smaller beam or fewer tokens per batch (--max-tokens)"),
    (3, 1, 5, "use fewer samples or fewer tokens per batch (--max-tokens)"),
])
def test_out_of_memory_advice_offers_only_what_can_shrink(batch, beam, samples, advice):
    """A beam of 1, one sample or a batch of one sentence is already as small as it gets."""
    from aiayn.errors import OutOfMemory

    assert str(OutOfMemory(0, batch, beam, samples=samples)).endswith(f"; {advice}")


def test_output_file_is_untouched_when_writing_fails(tmp_path, monkeypatch):
    """A full disk (os.fsync failing with ENOSPC) leaves the old file and no temporary; a `UserError`."""
    out = tmp_path / "out.txt"
    out.write_text("old\n", encoding="utf-8")

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(UserError, match=r"out.txt: cannot write \(No space left on device\)"), \
            atomic_output(out) as f:
        f.write("new\n")
    assert out.read_text(encoding="utf-8") == "old\n" and [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    monkeypatch.undo()
    with atomic_output(out) as f:
        f.write("new\n")
    assert out.read_text(encoding="utf-8") == "new\n" and [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as open(path, "w") creates files
    out.chmod(0o640)
    link = tmp_path / "link.txt"
    link.symlink_to(out)
    with atomic_output(link) as f:
        f.write("newer\n")
    assert link.is_symlink() and out.read_text(encoding="utf-8") == "newer\n"  # the link kept, its file replaced
    assert out.stat().st_mode & 0o777 == 0o640  # and its permissions


def test_output_to_a_device_or_fifo_is_streamed_not_renamed(tmp_path):
    """/dev/stdout, /dev/null or a FIFO: no temporary file beside them, nothing renamed over them."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert _stream_only(Path("/dev/stdout")) and _stream_only(fifo)
    assert not _stream_only(tmp_path / "new.txt")
    with atomic_output(os.devnull) as f:
        f.write("nothing\n")
    assert Path(os.devnull).is_char_device()


def test_cli_stops_quietly_when_its_reader_goes_away(checkpoint, tmp_path, monkeypatch, capsys):
    """`aiayn translate ... | head -1`: a broken pipe on stdout ends the run with 141, no traceback."""

    class ClosedPipe:
        def fileno(self):
            raise io.UnsupportedOperation("fileno")  # as a captured stdout

        def write(self, text):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    src = tmp_path / "in.txt"
    src.write_text("the number 3\n", encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["translate", str(checkpoint), "-i", str(src), "-q", "--beam", "1"]) == 141
    assert capsys.readouterr().err == ""


def test_cli_is_a_unix_filter(checkpoint, tmp_path, monkeypatch, capsys):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    with open(src, encoding="utf-8") as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        args = ["translate", str(checkpoint), "--beam", "2", "--max-len-a", "0", "--max-len-b", "6"]
        assert main(args) == 0
    captured = capsys.readouterr()
    translator = Translator.load(checkpoint)
    assert captured.out.split("\n") == [alone(translator, t) for t in TEXTS] + [""]
    assert captured.err == ""  # no progress bar in a pipe


SAMPLE = ["--sample", "--beam", "1", "--seed", "1", "--temperature", "3", "--max-len-a", "0", "--max-len-b", "6"]


def test_seeded_sampling_is_reproducible_and_never_reseeded_per_batch(checkpoint, tmp_path):
    """One generator, seeded once, draws a whole run: 20 copies of a line read one at a time (as from a
    terminal) or batched one sentence per batch get different samples, and the same run twice the same."""
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("the number 12 is even\n" * 20, encoding="utf-8")
    runs = []
    for _ in range(2):
        assert main(["translate", str(checkpoint), "-i", str(src), "-o", str(out), "-q", "--chunk", "1"] + SAMPLE) == 0
        runs.append(out.read_text(encoding="utf-8").splitlines())
    assert len(runs[0]) == 20 and len(set(runs[0])) > 1 and runs[0] == runs[1]
    without_beam = SAMPLE[:1] + SAMPLE[3:]  # --sample alone means beam 1
    assert main(["translate", str(checkpoint), "-i", str(src), "-o", str(out), "-q", "--chunk", "1"] + without_beam) == 0
    assert out.read_text(encoding="utf-8").splitlines() == runs[0]
    translator = Translator.load(checkpoint)
    options = {"sample": True, "beam": 1, "seed": 1, "temperature": 3.0, "max_len_a": 0.0, "max_len_b": 6,
               "max_tokens": 1}
    texts = ["the number 12 is even"] * 20
    first = translator.translate(texts, **options)
    assert len(set(first)) > 1 and translator.translate(texts, **options) == first


def test_a_stop_python_dropped_ends_the_translation_at_the_chunk_it_came_in(checkpoint, tmp_path, capsys,
                                                                            monkeypatch):
    """A Ctrl-C whose KeyboardInterrupt Python dropped (raised in a weakref callback: the CLI records it)
    during the first chunk was raised only at the end with -o: all 200 lines translated (hours of a real
    test set), then exit 130 and the work thrown away. The stream stops before the next chunk."""
    from aiayn import files
    from aiayn.translate import Translation

    src, out = tmp_path / "in.en", tmp_path / "out.de"
    src.write_text("".join(f"the number {i} is even\n" for i in range(50)))
    out.write_text("OLD\n")
    chunks = []

    def hypotheses(self, lines, *args):
        chunks.append(len(lines))
        if len(chunks) == 1:
            files.record_dropped_stop(KeyboardInterrupt())
        return [[Translation("x", 0.0, [], 0.0)] for _ in lines]

    monkeypatch.setattr(Translator, "_hypotheses", hypotheses)
    assert main(["translate", str(checkpoint), "-i", str(src), "-o", str(out), "--chunk", "10", "-q"]) == 130
    assert chunks == [10] and out.read_text() == "OLD\n"
    assert capsys.readouterr().out == ""


def test_a_terminal_is_read_a_line_at_a_time_whatever_chunk_says(checkpoint, tmp_path, capsys, monkeypatch):
    """Typed lines must each be answered, so standard input on a terminal is read as with --chunk 1, its
    seeded samples those of --chunk 1, not of the --chunk given: --chunk's and --seed's help and the README
    said --chunk counted (the same input and options give the same output) and never said this."""
    import pty

    data = "".join(f"the number {i}{' is even' * (i % 3)}\n" for i in range(10))
    src = tmp_path / "in.txt"
    src.write_text(data, encoding="utf-8")
    outputs = {}
    for chunk in ("1", "3"):
        assert main(["translate", str(checkpoint), "-i", str(src), "--chunk", chunk, *SAMPLE]) == 0
        outputs[chunk] = capsys.readouterr().out
    assert outputs["1"] != outputs["3"]  # else the test tells nothing
    controller, terminal = pty.openpty()
    os.write(controller, data.encode() + b"\x04")  # Ctrl-D at a line's start: the end of the input
    with open(terminal, "rb", buffering=0) as raw, io.TextIOWrapper(io.BufferedReader(raw)) as typed:
        monkeypatch.setattr(sys, "stdin", typed)
        assert main(["translate", str(checkpoint), "--chunk", "3", *SAMPLE]) == 0
    os.close(controller)
    assert capsys.readouterr().out == outputs["1"]
    with pytest.raises(SystemExit):
        main(["translate", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert ("--chunk CHUNK lines read (and sorted) at a time (default 10000); standard input (no -i, or "
            "-i -) that is a terminal is read one line at a time whatever --chunk says, so that each typed "
            "line is answered") in shown
    assert ("(--chunk and --max-tokens included; standard input from a terminal is read as with --chunk 1, "
            "see --chunk) and device give the same output") in shown
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").split())
    assert ("Standard input (no `-i`, or `-i -`) that is a terminal is read one line at a time whatever "
            "`--chunk` says, so that each typed line is answered: typed lines get the samples of `--chunk 1`"
            ) in readme


class Trickle:
    """A pipe read a few bytes at a time: with `_ready` saying 'not ready', the input of a writer that
    stalls after every line, whatever the machine's timing."""

    def __init__(self, pipe):
        self.pipe = pipe

    def fileno(self):
        return self.pipe.fileno()

    def read1(self, size=-1):
        return self.pipe.read1(5)


def test_seeded_sampling_from_a_stalling_pipe_gives_what_the_file_gives(checkpoint, tmp_path, monkeypatch):
    """A batch used to end wherever piped input stalled, so which line got which of the seeded generator's
    draws depended on timing. With a seed, a pipe is read in whole chunks (the last one shorter)."""
    translator = Translator.load(checkpoint)
    data = "".join(f"the number {i}{' is even' * (i % 3)}\n" for i in range(10)).encode()
    options = dict(sample=True, beam=1, seed=1, temperature=3.0, max_len_a=0.0, max_len_b=6)
    (tmp_path / "in.txt").write_bytes(data)
    with open(tmp_path / "in.txt", "rb") as src:
        translate_stream(translator, src, expected := io.StringIO(), "in.txt", chunk=4, **options)
    monkeypatch.setattr("aiayn.translate._ready", lambda fd: False)
    with piped(data) as src:
        translate_stream(translator, Trickle(src), got := io.StringIO(), "<pipe>", chunk=4, **options)
    assert got.getvalue() == expected.getvalue() and len(set(expected.getvalue().splitlines())) > 1
    with piped(data) as src:
        assert [len(b) for b in read_utf8_lines(Trickle(src), "<pipe>", 4, whole_chunks=True)] == [4, 4, 2]
    with piped(data) as src:  # a search still answers each line as it arrives
        assert [len(b) for b in read_utf8_lines(Trickle(src), "<pipe>", 4)] == [1] * 10


def test_cli_reads_a_pipe_with_progress_but_no_total(checkpoint, tmp_path, capsys, monkeypatch):
    """`-i /dev/stdin` on a pipe, or `-i <(...)`: read once, never rewound for a line count."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar is a terminal's
    out = tmp_path / "out.txt"
    read_end, write_end = os.pipe()
    os.write(write_end, ("\n".join(TEXTS) + "\n").encode())  # small: fits in the pipe's buffer
    os.close(write_end)
    try:
        args = ["translate", str(checkpoint), "-i", f"/dev/fd/{read_end}", "-o", str(out)] + OPTIONS_ARGS
        assert main(args) == 0
    finally:
        os.close(read_end)
    assert out.read_text(encoding="utf-8").split("\n") == [alone(Translator.load(checkpoint), t) for t in TEXTS] + [""]
    assert "6line" in capsys.readouterr().err  # tqdm without a total: lines done, no "/6"


@pytest.mark.parametrize("first", [TEXTS[0], "the\rnumber\r3"])
def test_a_slow_writer_on_a_pipe_gets_each_answer_before_it_writes_more(checkpoint, first):
    """A filter in a pipeline: the producer writes a line and waits for its translation before the next.
    Reading 10,000 lines before translating deadlocked that; each line must come back at once, a first
    line with CRs alone too (held for the next as a classic Mac file might be, it hung the session)."""
    texts = [first, *TEXTS[1:3]]
    translator = Translator.load(checkpoint)
    read_end, write_end = os.pipe()
    answered = threading.Event()

    class Output(io.StringIO):
        def write(self, text):
            answered.set()
            return super().write(text)

    def producer():
        for text in texts:
            answered.clear()
            os.write(write_end, (text + "\n").encode())
            waited.append(answered.wait(timeout=10))
        os.close(write_end)

    waited: list[bool] = []
    thread = threading.Thread(target=producer)
    thread.start()
    dst = Output()
    with os.fdopen(read_end, "rb") as src:
        assert translate_stream(translator, src, dst, "<pipe>", chunk=10_000, **OPTIONS) == 3
    thread.join()
    assert waited == [True, True, True]
    assert dst.getvalue().split("\n") == [alone(translator, t) for t in texts] + [""]


def piped(data: bytes):
    """The read end of a pipe that a thread fills with `data` (more than the pipe holds) and closes."""
    read_end, write_end = os.pipe()

    def fill():
        with os.fdopen(write_end, "wb") as f:
            f.write(data)

    threading.Thread(target=fill, daemon=True).start()
    return os.fdopen(read_end, "rb")


def test_lines_of_a_pipe_keep_their_numbers_and_an_unended_last_line():
    """Read as it arrives, in blocks that cut lines: the same lines, numbers and errors as from a file."""
    long = b"x" * 70_000  # longer than one 64 KiB block
    with piped(b"one\r\ntwo\n" + long + b"\nbad \xff\n") as src:
        with pytest.raises(UserError, match=r"^in\.txt:4: invalid UTF-8 \(byte 0xff\)$"):
            list(read_utf8_lines(src, "in.txt", chunk=2))
    with piped(b"one\r\ntwo\n" + long + b"\nlast") as src:
        got = [line for lines in read_utf8_lines(src, "in.txt", chunk=2) for line in lines]
    assert got == ["one", "two", long.decode(), "last"]
    # a stream of NULs with no newline (/dev/zero) was read on, its line growing, for good
    zeros = open("/dev/zero", "rb") if os.path.exists("/dev/zero") else piped(b"ok\n" + b"\0" * 10**6)
    with zeros as src, pytest.raises(UserError, match=r"^in\.txt:[12]: NUL byte"):
        list(read_utf8_lines(src, "in.txt", chunk=2))


def test_a_file_line_of_nul_bytes_with_no_end_is_refused_without_reading_it_whole(tmp_path):
    """`translate -i zeros` and `score --src zeros` read a file's line of NULs whole (readline) before its
    NUL byte was refused: twice the file. Now, as from a pipe, the reading stops with the read that finds
    it; what was read is all decoded (invalid UTF-8 after the NUL is named first), but for a character that
    read cut (an é over bytes 65,535-6 is no error)."""
    class CountedFile(io.BufferedReader):  # a regular file, whose longest read is kept
        longest = 0

        def readline(self, size=-1):
            line = super().readline(size)
            self.longest = max(self.longest, len(line))
            return line

    zeros = b"\0" * (4 << 20)
    nul = "NUL byte (binary or corrupt input?)"
    for data, error in ((b"eins\n" + zeros, f"2: {nul}"), (zeros, f"1: {nul}"),
                        (b"\0" + "é".encode() * (2 << 20), f"1: {nul}"),
                        (b"a\0\xff" + b"x" * (4 << 20) + b"\n", "1: invalid UTF-8 (byte 0xff)")):
        (tmp_path / "in.txt").write_bytes(data)
        with CountedFile(io.FileIO(tmp_path / "in.txt")) as src:
            with pytest.raises(UserError) as e:
                list(read_utf8_lines(src, "in.txt", chunk=2))
            assert str(e.value) == f"in.txt:{error}"
            assert src.longest <= 1 << 16  # of 4 MiB


def test_a_read_error_is_one_line_naming_the_input(checkpoint, tmp_path, capsys):
    """An I/O error while reading (a failing disk; /proc/self/mem, which opens but cannot be read) was an
    OSError traceback from readline: only opening an input was caught. A file and a pipe alike."""
    eio = OSError(errno.EIO, os.strerror(errno.EIO))

    class FailingFile(io.BytesIO):  # no descriptor: read by readline, as a regular file is
        def readline(self, size=-1):
            if self.tell():
                raise eio
            return super().readline(size)

    class FailingPipe(io.BufferedReader):  # a pipe's descriptor: read by read1, as it arrives
        def read1(self, size=-1):
            raise eio

    read_end, write_end = os.pipe()
    os.close(write_end)
    for stream in (FailingFile(b"one\ntwo\n"), FailingPipe(io.FileIO(read_end, "rb"))):
        with stream, pytest.raises(UserError, match=r"^in\.txt: cannot read \(Input/output error\)$"):
            list(read_utf8_lines(stream, "in.txt", chunk=1))
    if not os.path.exists("/proc/self/mem"):
        return
    src = tmp_path / "in.txt"
    src.write_text("the number 3\n", encoding="utf-8")
    for args in (["translate", str(checkpoint), "-i", "/proc/self/mem", "-q"],
                 ["score", str(checkpoint), "--src", str(src), "--tgt", "/proc/self/mem", "-q"]):
        assert main(args) == 2
        assert capsys.readouterr().err == "aiayn: error: /proc/self/mem: cannot read (Input/output error)\n"


def test_cli_refuses_bad_decoding_settings_in_one_line(checkpoint, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("the number 3\n", encoding="utf-8")
    cases = [(["--lenpen", "nan"], "error: --lenpen nan must be"), (["--lenpen=-inf"], "--lenpen -inf"),
             (["--max-len-a", "0", "--max-len-b", "0"], "allow no output token"),
             (["--temperature", "0.5"], "--temperature 0.5 needs --sample"),
             (["--seed", "3"], "--seed 3 needs --sample"),
             (["--sample", "--seed", "4294967297"],  # drew seed 1's samples on a CPU
              "error: --seed 4294967297 must be between 0 and 2**32 - 1 (4,294,967,295), the seeds"),
             (["--temperature", "1"], "--temperature 1.0 needs --sample"),  # its default: it was ignored
             (["--top-k", "0"], "--top-k 0 needs --sample"), (["--top-p", "1"], "--top-p 1.0 needs --sample"),
             (["--sample", "--beam", "1", "--temperature", "1e-50"], "error: --temperature 1e-50 must"),
             (["--n-best", "3", "--beam", "2"], "error: --n-best 3 must be between 1 and --beam 2"),
             # samples: no bound from the beam
             (["--sample", "--n-best", "0"], "error: --n-best 0 must be at least 1\n"),
             (["--sample", "--beam", "2"], "error: --sample needs --beam 1, not 2"),
             (["--device", "foo"], "device 'foo' is not a device name"),
             (["--device", "meta"], "device 'meta': aiayn runs models on cpu or cuda only"),
             (["--early-stopping", "--beam", "1"], "--early-stopping needs beam > 1, not 1"),
             (["--early-stopping", "--sample"], "--early-stopping needs beam > 1, not 1"),
             (["--lenpen", "1", "--lenpen-kind", "none"], "--lenpen 1.0 has no effect with --lenpen-kind"),
             # greedy search and one sample a line rank nothing: alpha was accepted and changed nothing
             (["--lenpen", "2", "--beam", "1"], "--lenpen 2.0 has no effect with one output a line and no"),
             (["--lenpen", "2", "--sample"], "--lenpen 2.0 has no effect with one output a line and no beam"),
             (["--int8", "--device", "cuda"], "int8 (--int8) is a CPU path"),
             # it said "drop it or dtype 'bfloat16'", naming no flag
             (["--int8", "--dtype", "bfloat16"],
              "int8 (--int8) quantizes float32 weights, not dtype bfloat16 (--dtype bfloat16): drop one\n"),
             (["--threads", "100000"], "--threads 100000 is more than 1,024"),  # a segfault, exit 139
             (["--sample", "--temperature", "1e39"],
              "--temperature 1e+39 must be a number in")]  # NaN: a traceback
    for extra, message in cases:
        assert main(["translate", str(checkpoint), "-i", str(src), "-q"] + extra) == 2, extra
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert "DecodeConfig" not in err and not re.search(r"\b[a-z_]+=", err), err  # named as the flags were
    assert main(["translate", str(checkpoint), "-i", str(src), "-q", "--lenpen-kind", "none"]) == 0  # alone
    for ranked in (["--beam", "2"], ["--sample", "--n-best", "2"], ["--beam", "2", "--n-best", "2"]):
        argv = ["translate", str(checkpoint), "-i", str(src), "-q", "--lenpen", "2", *ranked]
        assert main(argv) == 0, ranked
    src.write_bytes(b"fine\nbad\0byte\n")
    assert main(["translate", str(checkpoint), "-i", str(src), "-q"]) == 2
    assert f"{src}:2: NUL byte (binary or corrupt input?)" in capsys.readouterr().err


def test_load_refuses_devices_it_cannot_use(checkpoint, monkeypatch):
    for device in ("foo", "meta", "cuda:0" if not torch.cuda.is_available() else "cuda:99"):
        with pytest.raises(UserError, match=f"device '{device}'"):
            Translator.load(checkpoint, device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match=r"device 'cuda:9': this machine has 1 CUDA device\(s\), cuda:0 to cuda:0"):
        Translator.load(checkpoint, "cuda:9")


def test_int8_is_refused_on_cuda_before_anything_else(checkpoint, monkeypatch):
    """torch.ao's dynamic quantization has CPU kernels only: on a GPU machine int8 on cuda ended in a
    traceback from inside the first batch. One line, whether or not this machine has CUDA."""
    for count in (0, 1):
        monkeypatch.setattr(torch.cuda, "is_available", lambda count=count: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        for device in ("cuda", "cuda:0", torch.device("cuda")):
            with pytest.raises(UserError, match=r"^int8 \(--int8\) is a CPU path"):
                Translator.load(checkpoint, device, int8=True)


def test_api_checks_its_texts_and_counts(checkpoint):
    translator = Translator.load(checkpoint)
    texts = ["the number 3", "odd"]
    expected = translator.translate(texts, **OPTIONS)
    assert translator.translate(iter(texts), **OPTIONS) == expected  # any iterable, read once
    assert translator.translate(tuple(texts), **OPTIONS) == expected
    with pytest.raises(TypeError, match=r"not one str: pass \[text\]"):
        translator.translate("odd")  # would be translated letter by letter
    for bad, kind in [(None, "NoneType"), (b"odd", "bytes"), (7, "int")]:
        with pytest.raises(TypeError, match=rf"texts\[1\] is {kind}, not str"):
            translator.translate(["odd", bad])
    for value, error in [(0, ValueError), (-5, ValueError), (10.5, TypeError), ("100", TypeError), (True, TypeError)]:
        with pytest.raises(error, match="max_tokens"):
            translator.translate(texts, max_tokens=value)
    with pytest.raises(ValueError, match="chunk=0 must be at least 1"):
        translate_stream(translator, io.BytesIO(b"odd\n"), io.StringIO(), "in.txt", chunk=0)
    with pytest.raises(UserError, match=r"^text 2: not valid Unicode \(a lone surrogate, '\\udcff', at character 4"):
        translator.translate(["odd", "odd\udcff"])  # SentencePiece's binding failed with a pybind11 cast error


def test_api_is_unaffected_by_the_callers_torch_settings_and_takes_any_path(checkpoint):
    """A service may call translate inside its own bf16 autocast (the packed float32 Linears failed in
    oneDNN) or with another default dtype (greedy scores were summed in it); a checkpoint may come as
    any os.PathLike or bytes (an os.DirEntry was read as a list of checkpoints)."""
    texts = ["the number 3", "und die Zahl 7 ist odd"]
    translator = Translator.load(checkpoint)
    for beam in (1, 2):
        expected = translator.hypotheses(texts, beam=beam)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert translator.hypotheses(texts, beam=beam) == expected
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # bfloat16 is refused as a default by some torch builds
        try:
            assert translator.hypotheses(texts, beam=beam) == expected
        finally:
            torch.set_default_dtype(default)
    entry = next(e for e in os.scandir(checkpoint.parent) if e.name == checkpoint.name)
    for path in (entry, os.fsencode(checkpoint), str(checkpoint)):
        assert Translator.load(path).translate(texts) == translator.translate(texts)
    with pytest.raises(ValueError, match="no checkpoint given"):
        Translator.load([])
    for nothing in (None, 5):  # "'NoneType' object is not iterable"
        with pytest.raises(TypeError, match=f"^checkpoint is {type(nothing).__name__}: a checkpoint "):
            Translator.load(nothing)
    with pytest.raises(TypeError, match="int8 must be True or False, not str"):
        Translator.load(checkpoint, int8="yes")
    with pytest.raises(ValueError, match="generator is used only with sample=True"):
        translator.hypotheses(texts, generator=torch.Generator())


def test_one_translator_serves_several_threads(checkpoint):
    """A service shares one Translator between request threads: each call gets what it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    translator = Translator.load(checkpoint)
    jobs = [([t for t in TEXTS if t.strip()][i % 4 :] + [f"the number {i}"], dict(beam=1 + i % 3, max_len_b=6))
            for i in range(12)]
    alone_ = [translator.hypotheses(texts, **options) for texts, options in jobs]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda job: translator.hypotheses(job[0], **job[1]), jobs))
    assert together == alone_


def test_cli_streams_that_cannot_be_used_are_one_line(checkpoint, tmp_path, capsys):
    """Closed stdin or stdout, a full disk behind stdout, an -o that is a directory: one line, exit 2, and
    the ones that can be seen before the model loads are refused before it loads."""
    src = tmp_path / "in.txt"
    src.write_text("the number 3\n", encoding="utf-8")
    ref = tmp_path / "ref.txt"  # not in.txt again: that is noted as scoring a file against itself
    ref.write_text("the number 3\n", encoding="utf-8")
    base = ["translate", str(checkpoint), "-q", "--threads", "1"]

    def run(args, stdin=None, stdout=None, close=None):  # close: a descriptor the process starts without
        code = "import sys; from aiayn.cli import main; sys.exit(main(sys.argv[1:]))"
        return subprocess.run([sys.executable, "-c", code, *args], stdin=stdin, stdout=stdout,
                              stderr=subprocess.PIPE, text=True, timeout=120,
                              preexec_fn=None if close is None else lambda: os.close(close))

    for args, close, message in [(base, 0, "<stdin>: closed; give an input file with -i"),
                                 (base + ["-i", str(src)], 1, "<stdout>: closed; give an output file with -o"),
                                 (["evaluate", str(src), str(ref)], 1,
                                  "<stdout>: closed, so the results cannot be written")]:
        run_ = run(args, close=close)
        assert (run_.returncode, run_.stderr) == (2, f"aiayn: error: {message}\n"), args
    maps = tmp_path / "maps"  # a command whose stdout only names what it wrote: refused before writing it
    run_ = run(["attention", "--checkpoint", str(checkpoint), "--src", "the number 3", "--out", str(maps)],
               close=1)
    assert (run_.returncode, run_.stderr, maps.exists()) == (
        2, "aiayn: error: <stdout>: closed, so the results cannot be written\n", False)
    if os.path.exists("/dev/full"):
        for args in (base + ["-i", str(src)], ["evaluate", str(src), str(ref)]):
            with open("/dev/full", "w") as full:
                run_ = run(args, stdout=full)
            full_disk = "aiayn: error: <stdout>: cannot write (No space left on device)\n"
            assert (run_.returncode, run_.stderr) == (2, full_disk), args
    for output in (f"{tmp_path}/new/", f"{tmp_path}/new.txt/"):  # wrote a file named new.txt
        capsys.readouterr()
        assert main(base + ["-i", str(src), "-o", output]) == 2
        said = f"aiayn: error: {output}: ends with '/', a folder's name; -o names the output file\n"
        assert capsys.readouterr().err == said
        assert not os.path.exists(output.rstrip("/"))
    with open(src, "rb") as stdin:
        run_ = run(base + ["-o", str(tmp_path)], stdin=stdin)
    assert (run_.returncode, run_.stderr) == (2, f"aiayn: error: {tmp_path}: is a directory; -o names the output file\n")


def test_an_error_naming_a_file_is_one_line_with_the_name_as_typed(checkpoint, tmp_path, capsys):
    """A file name with a line feed split the error line in two ("aiayn: error: nl" and "name.en:2: ..."),
    and one with a byte that is no UTF-8 was shown as Python's surrogate \\udcff, not as the byte typed."""
    for name, shown in (("nl\nname.en", "nl\\nname.en"), ("bad\udcff.en", "bad\\xff.en")):
        src = tmp_path / name
        src.write_bytes(b"the number 3\nbad \xff\n")
        assert main(["translate", str(checkpoint), "-i", str(src)]) == 2
        assert capsys.readouterr().err == f"aiayn: error: {tmp_path}/{shown}:2: invalid UTF-8 (byte 0xff)\n"


def _cli(args, **popen):
    code = "import sys; from aiayn.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, *args], **popen)


@pytest.mark.parametrize("command", ["translate", "score"])
def test_off_a_terminal_progress_is_lines_not_a_bar(checkpoint, tmp_path, capsys, monkeypatch, command):
    """`2>log`: the bar's carriage-return frames filled the log, its last frame twice; there a line every
    PROGRESS_SECONDS instead, as the demo and training's data preparation give."""
    import aiayn.data.dataset

    monkeypatch.setattr(aiayn.data.dataset, "PROGRESS_SECONDS", 0.0)  # a line a batch
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    args = ["translate", str(checkpoint), "-i", str(src), "-o", str(tmp_path / "out.txt"), *OPTIONS_ARGS]
    if command == "score":
        args = ["score", str(checkpoint), "--src", str(src), "--tgt", str(src), "-o",
                str(tmp_path / "out.txt")]
    assert main(args) == 0
    err = capsys.readouterr().err
    unit, verb = ("line", "translated") if command == "translate" else ("pair", "scored")
    said = [line for line in err.splitlines() if line.startswith(f"aiayn: {verb} ")]
    assert "\r" not in err and said and said[-1].startswith(f"aiayn: {verb} 6 of 6 {unit}s (100%, "), err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: the bar, no lines
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "6/6" in err and f"aiayn: {verb} " not in err


def test_a_stderr_that_fails_never_costs_the_results(checkpoint, tmp_path):
    """The progress bar and the notes are for a person: stderr closed (2>&-), full (2>/dev/full) or read by
    a reader that went away loses them, not the translation; and an error line never lands in stdout."""
    src = tmp_path / "in.txt"
    src.write_text("the number 3\nthe number 4\n", encoding="utf-8")
    base = ["translate", str(checkpoint), "--threads", "1", "-i", str(src)]  # with the progress bar
    stderrs = [("closed", lambda: os.close(2))] + [("full", None)] * os.path.exists("/dev/full")
    for name, close in stderrs:
        err = subprocess.DEVNULL if close else open("/dev/full", "w")
        out = tmp_path / f"out_{name}.txt"
        for args in (base + ["-o", str(out)], base):
            proc = _cli(args, stdout=subprocess.PIPE, stderr=err, preexec_fn=close)
            stdout = proc.communicate(timeout=120)[0].decode()
            assert proc.returncode == 0, (name, args)
            lines = (out.read_text(encoding="utf-8") if "-o" in args else stdout).splitlines()
            assert len(lines) == 2, (name, args)
        bad = tmp_path / "bad.txt"
        bad.write_bytes(b"the number 3\n\xff\n")
        proc = _cli(base[:-1] + [str(bad), "-q"], stdout=subprocess.PIPE, stderr=err, preexec_fn=close)
        assert (proc.communicate(timeout=120)[0], proc.returncode) == (b"", 2), name  # no error in stdout
        if not close:
            err.close()


def test_sigterm_removes_the_output_being_written(checkpoint, tmp_path):
    """`timeout`, a scheduler or a closed terminal: SIGTERM or SIGHUP stops as Ctrl-C does, the old -o file
    kept and the temporary one removed (it was left behind, hidden, for good)."""
    src = tmp_path / "in.txt"
    src.write_text("the number 3 is odd\n" * 20_000, encoding="utf-8")
    out = tmp_path / "out.txt"
    out.write_text("OLD\n", encoding="utf-8")
    proc = _cli(["translate", str(checkpoint), "--threads", "1", "-q", "--chunk", "50", "-i", str(src), "-o",
                 str(out)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    # translating into the temporary file: some chunks written (it is made empty before the model loads)
    while not any(p.suffix == ".tmp" and p.stat().st_size for p in tmp_path.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=120)[1]
    assert (proc.returncode, stderr) == (128 + signal.SIGTERM, "aiayn: stopped by SIGTERM\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]
    assert out.read_text(encoding="utf-8") == "OLD\n"


def test_cli_writes_utf8_to_stdout_whatever_the_locale(checkpoint, tmp_path):
    """As -o files are: under an ASCII locale printing a non-ASCII path was a UnicodeEncodeError
    traceback (Latin-1 bytes under a Latin-1 one)."""
    out = tmp_path / "Aufmerksamkeit_für_zwölf"
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    run = subprocess.run([sys.executable, "-m", "aiayn", "attention", "--checkpoint", str(checkpoint), "--src",
                          "the number 12", "--out", str(out)], capture_output=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    printed = run.stdout.decode("utf-8").splitlines()
    assert printed and all(line.startswith(str(out)) for line in printed)
    assert {Path(line) for line in printed} <= set(out.iterdir())
    raw = os.fsencode(tmp_path) + b"/maps\xff"  # a folder name that is no UTF-8: printed as its own bytes
    run = subprocess.run([sys.executable, "-m", "aiayn", "attention", "--checkpoint", str(checkpoint), "--src",
                          "the number 12", "--out", raw], capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr  # was a UnicodeEncodeError traceback after the files were written
    printed = run.stdout.splitlines()
    assert printed and all(line.startswith(raw + b"/") and os.path.exists(line) for line in printed)


def test_ensemble_member_with_other_ids_is_named(checkpoint, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    meta = json.loads((other / "meta.json").read_text(encoding="utf-8"))
    meta["model"]["decoder_start_id"] += 1  # eos_id or pad_id: refused at load, against the tokenizer's
    (other / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(UserError, match=f"{other}: differs from {checkpoint} in decoder_start_id"):
        Translator.load([checkpoint, other])
    assert main(["translate", str(checkpoint), str(other), "-q"]) == 2
    assert f"{other}: differs from" in capsys.readouterr().err
    meta["model"]["decoder_start_id"] -= 1
    meta["model"]["pad_id"] = 5  # the model would attend the tokenizer's padding
    (other / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(UserError, match=r"meta.json: the tokenizer's pad id is 0, the model's pad_id 5: not "
                                        "the tokenizer this model was trained with$"):
        Translator.load([other])


def test_int8_model_stays_close_to_float():
    model = tiny_model()
    src, tgt = padded_batch([6, 4], 50), padded_batch([5, 5], 50)
    with torch.no_grad():
        ref = model(src, tgt)
        q = quantize_int8(model)(src, tgt)
    assert torch.nn.functional.cosine_similarity(ref.flatten(), q.flatten(), dim=0) > 0.99
    assert len(generate(quantize_int8(model), src, DecodeConfig(beam=2, max_len_b=4))) == 2


def test_version_and_a_pytorch_without_dynamic_quantization(monkeypatch, capsys):
    """`aiayn --version` said "the following arguments are required: command"; torch.ao.quantization is
    deprecated for torchao, and a PyTorch without it made --int8 an AttributeError traceback. Run from the
    source tree, uninstalled (PYTHONPATH=src, as benchmarks/gpu.sh runs), the test itself failed: the version
    is aiayn.__version__, which the installed metadata takes (pyproject's dynamic version)."""
    from importlib.metadata import PackageNotFoundError, version

    import aiayn

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"aiayn {aiayn.__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+", aiayn.__version__)
    with contextlib.suppress(PackageNotFoundError):  # installed: the same number
        assert version("aiayn") == aiayn.__version__
    monkeypatch.delattr(torch.ao.quantization, "quantize_dynamic")
    with pytest.raises(UserError, match=r"^int8 \(--int8\) uses torch.ao.quantization.quantize_dynamic, "
                                        r"which PyTorch .* no longer has; drop --int8$"):
        quantize_int8(tiny_model())


def test_help_says_what_aiayn_is_and_what_every_argument_is(capsys):
    """`aiayn --help` described the program as its module docstring does, for developers ("argparse
    subcommands, each one library call"); average's and plot's run_dir and export's --to had no help."""
    import argparse

    from aiayn.cli import build_parser

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    description = re.search(r'^description = "(.*)"$', pyproject, re.MULTILINE)[1]
    assert description in shown and "argparse" not in shown
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        for action in command._actions:
            assert action.help, f"aiayn {name} {action.option_strings or action.metavar or action.dest}"
    for name in ("average", "plot"):  # -o's help names RUN_DIR
        with pytest.raises(SystemExit):
            main([name, "--help"])
        usage = capsys.readouterr().out.splitlines()[0]
        assert usage.endswith(" RUN_DIR" if name == "average" else " RUN_DIR [RUN_DIR ...]")  # plot: several
        assert "run_dir" not in usage


@pytest.mark.parametrize("int8", [False, True])
def test_a_model_given_away_is_prepared_in_place_with_the_same_function(int8):
    """`Translator.load` owns the model it loaded: packing or quantizing a copy held two at once (a
    `base` checkpoint's loading peak 1,127 MB in float32, 930 MB in place)."""
    from aiayn.decoding.cpu import packing_available
    from aiayn.translate import prepare_for_inference

    model = tiny_model()
    src, tgt = padded_batch([6, 4], 50), padded_batch([5, 5], 50)
    with torch.no_grad():
        expected = prepare_for_inference(model, int8=int8)(src, tgt)
        assert type(model.generator) is torch.nn.Linear  # a copy: the caller's model as it was
        prepared = prepare_for_inference(model, int8=int8, own=True)
        assert (prepared is model) == (int8 or packing_available())  # in place
        torch.testing.assert_close(prepared(src, tgt), expected, atol=1e-6, rtol=0)


def test_cpu_packed_linears_compute_the_same_function():
    from aiayn.decoding.cpu import pack_for_cpu

    model = tiny_model()
    packed = pack_for_cpu(model)
    src, tgt = padded_batch([6, 4], 50), padded_batch([5, 5], 50)
    with torch.no_grad():
        torch.testing.assert_close(packed(src, tgt), model(src, tgt), atol=1e-5, rtol=1e-5)
    config = DecodeConfig(beam=3, max_len_b=6)
    tokens = [[h[0].tokens for h in generate(m, src, config)] for m in (packed, model)]
    assert tokens[0] == tokens[1]
    assert type(model.generator) is torch.nn.Linear  # the original is left as it was
    # One sentence, one new token: every decoder product has one row, which takes MKL's kernel.
    one, first = src[:1], tgt[:1, :1]
    with torch.no_grad():
        ours = packed.decode(first, packed.encode(one), None)  # (1, 1, V)
        torch.testing.assert_close(ours, model.decode(first, model.encode(one), None), atol=1e-5, rtol=1e-5)
    greedy = DecodeConfig(beam=1, max_len_b=6)
    assert [h[0].tokens for h in generate(packed, one, greedy)] == [h[0].tokens for h in generate(model, one, greedy)]


@pytest.mark.parametrize("int8", [False, True])
def test_a_translators_model_counts_the_parameters_its_checkpoint_has(checkpoint, int8):
    """Packed or quantized for decoding, the Linear weights are no parameters: the packed model counted
    its embeddings and norms alone. The tied output projection counts once, and Marian's logits bias, a
    buffer folded into the vocabulary product, not at all, as in the model that was packed."""
    from aiayn.checkpoint import load_checkpoint
    from aiayn.decoding.cpu import pack_for_cpu

    loaded = Translator.load(checkpoint, int8=int8).model
    assert loaded.num_parameters() == load_checkpoint(checkpoint).model.num_parameters()
    for model in (tiny_model(final_logits_bias=True), tiny_model(share_embeddings=False, tgt_vocab_size=40,
                                                                 tie_output=False)):
        prepared = quantize_int8(model) if int8 else pack_for_cpu(model)
        assert type(prepared.generator) is not torch.nn.Linear
        assert prepared.num_parameters() == model.num_parameters()


@pytest.mark.skipif(not packing_available(), reason="no oneDNN packing in this PyTorch")
def test_a_packed_model_refuses_gradients_casts_and_copies_in_one_line(checkpoint):
    """A `Translator`'s packed model decodes; a forward that would take gradients, a cast to another dtype
    or device, a copy or a pickle is one RuntimeError saying what to use instead, where oneDNN left every
    grad None, failed at the next translation after a cast, or could not copy an "OpaqueTensorImpl". A
    refused cast leaves the model whole; casts that change nothing go on."""
    import copy
    import pickle

    from aiayn.checkpoint import load_checkpoint

    translator = Translator.load(checkpoint)
    model, before = translator.model, translator.translate(TEXTS, **OPTIONS)
    src, tgt = padded_batch([6, 4], model.config.vocab_size), padded_batch([5, 5], model.config.vocab_size)
    with pytest.raises(RuntimeError, match=r"^this model is packed for CPU decoding \(Translator.load\): it "
                       r"has no gradients; .* load_checkpoint\(path\).model$"):
        model(src, tgt)
    with torch.no_grad():
        torch.testing.assert_close(model(src, tgt), load_checkpoint(checkpoint).model(src, tgt), atol=1e-5,
                                   rtol=1e-5)
    for cast in (lambda m: m.bfloat16(), lambda m: m.double(), lambda m: m.half(), lambda m: m.to("meta"),
                 lambda m: m.to(torch.float64)):
        with pytest.raises(RuntimeError, match=r"its weights stay float32 on the CPU; .*Translator.load\("
                           r"path, device, dtype=...\) or load_checkpoint\(path, device, dtype\)$"):
            cast(model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # nothing cast before the refusal
    assert model.float() is model and model.cpu() is model and model.to("cpu", torch.float32) is model
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the probe was made in the default dtype: .cpu() refused
    try:
        assert model.cpu() is model and model.to("cpu") is model
    finally:
        torch.set_default_dtype(default)
    for copied in (lambda: copy.deepcopy(translator), lambda: pickle.dumps(model)):
        with pytest.raises(RuntimeError, match=r"cannot be copied or pickled; load it again \(Translator"):
            copied()
    assert translator.translate(TEXTS, **OPTIONS) == before


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="no MKL")
def test_one_row_products_take_a_weight_block_per_thread_where_mkl_does_not_split_a_row(monkeypatch):
    """On Intel MKL splits a one-row product between threads itself: one block, W^T whole. Elsewhere (an
    AMD EPYC) it leaves the other threads idle: one block per thread. Either way the packed model computes
    what the model does, the logits bias folded in included, and greedy search finds the same tokens."""
    from aiayn.decoding import cpu

    threads = torch.get_num_threads()
    model = tiny_model(final_logits_bias=True)
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 1.0)
    one, first = padded_batch([6], 50), torch.tensor([[1]])
    try:
        for vendor, n, blocks in [("GenuineIntel", 2, 1), ("AuthenticAMD", 1, 1), ("AuthenticAMD", 2, 2),
                                  ("AuthenticAMD", 3, 3), ("", 1, 1), ("", 2, 0), ("HygonGenuine", 2, 0)]:
            monkeypatch.setattr(cpu, "_cpu_vendor", lambda vendor=vendor: vendor)
            torch.set_num_threads(n)
            assert cpu.one_row_blocks() == blocks
            packed = cpu.pack_for_cpu(model)
            one_row = packed.generator.one_row
            assert (one_row.blocks if one_row else 0) == blocks and packed.final_logits_bias is None
            with torch.no_grad():  # every decoder product of one sentence's first step has one row
                ours = packed.decode(first, packed.encode(one), None)
                torch.testing.assert_close(ours, model.decode(first, model.encode(one), None), atol=1e-5, rtol=1e-5)
            greedy = DecodeConfig(beam=1, max_len_b=6)
            assert [h[0].tokens for h in generate(packed, one, greedy)] == [
                h[0].tokens for h in generate(model, one, greedy)]
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert cpu.one_row_blocks() == 0 and cpu.pack_for_cpu(model).generator.one_row is None  # oneDNN then


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="no MKL")
def test_one_row_layouts_are_the_decoder_steps_own_and_share_huge_pages():
    """Only the Linears of a decoder step get a one-row layout (the encoder and the cross-attention's K/V
    projection read whole sentences), all in one mapping advised for huge pages on Linux; a one-token
    source, one row through the encoder, still gets the model's function from oneDNN."""
    from aiayn.decoding.cpu import PackedLinear, pack_for_cpu

    model = tiny_model()
    packed = pack_for_cpu(model)
    linears = {name: m for name, m in packed.named_modules() if type(m) is PackedLinear}
    one_row = {name for name, m in linears.items() if m.one_row is not None}
    assert one_row == {name for name in linears
                       if name.startswith("decoder.") and not name.endswith(".kv_proj") or name == "generator"}
    assert len(one_row) == 6 * len(packed.decoder) + 1
    if sys.platform.startswith("linux"):
        flags = {tuple(vm_flags(linears[name].one_row.weight.data_ptr())) for name in one_row}
        assert len(flags) == 1 and "hg" in next(iter(flags))
    one = torch.tensor([[model.config.eos_id]])  # a one-token source
    first = torch.tensor([[model.config.decoder_start_id]])
    with torch.no_grad():
        ours = packed.decode(first, packed.encode(one), None)
        torch.testing.assert_close(ours, model.decode(first, model.encode(one), None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("blocks", [1, 2, 3, 4])
@pytest.mark.parametrize("in_out", [(32, 96), (96, 32), (32, 32), (30, 50), (50, 30), (7, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_one_row_product_in_blocks_equals_the_float64_product(blocks, in_out, bias):
    """Cut by output columns (padded to equal widths where they do not divide) or by input rows (partial
    sums added), one row times the blocks is x W^T + b."""
    from aiayn.decoding.cpu import OneRowProduct

    torch.manual_seed(blocks)
    linear = torch.nn.Linear(*in_out, bias=bias)
    x = torch.randn(1, in_out[0])
    product = OneRowProduct(linear.weight, linear.bias, blocks)
    expected = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0.0)  # (1, out)
    got = product(x)
    assert got.shape == (1, in_out[1]) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    by_rows = blocks > 1 and in_out[1] <= in_out[0] and in_out[0] % blocks == 0
    assert product.by_rows is by_rows
    assert product.weight.shape[0] == blocks or blocks == 1


NO_ONEDNN_INT8 = "onednn" not in torch.backends.quantized.supported_engines


@pytest.mark.skipif(NO_ONEDNN_INT8, reason="no oneDNN int8 engine")
def test_int8_linear_computes_what_dynamic_quantization_does():
    """`Int8Linear` (fbgemm's packing below INT8_AMX_ROWS rows, oneDNN's from there up) gives what the
    `quantize_dynamic` Linear it wraps gives, at row counts on both sides of the switch, 2-D and 3-D."""
    import warnings

    from aiayn.decoding.cpu import INT8_AMX_ROWS, Int8Linear

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(torch.nn.Linear(64, 96)), {torch.nn.Linear}, dtype=torch.qint8)[0]
    both = Int8Linear(quantized)
    for shape in [(1, 64), (INT8_AMX_ROWS - 1, 64), (INT8_AMX_ROWS, 64), (5, 13, 64)]:
        x = torch.randn(shape)
        expected = quantized(x)
        assert expected.shape == (*shape[:-1], 96)
        torch.testing.assert_close(both(x), expected, atol=1e-5, rtol=1e-5)


def test_logits_bias_folded_into_the_vocabulary_product():
    """A model with Marian's bias on the logits, packed (float32) or quantized (int8), adds that bias
    inside its vocabulary product: the same logits as adding it afterwards, and the original model keeps
    its own bias."""
    import warnings

    from aiayn.decoding.cpu import pack_for_cpu, pack_int8_for_amx

    model = tiny_model(final_logits_bias=True)
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 1.0)
    src, tgt = padded_batch([6, 4], 50), padded_batch([5, 5], 50)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The same packings as `quantize_int8`: int8 rounding would turn their 1e-7 differences into 1e-2.
        quantized = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        unfolded = pack_int8_for_amx(quantized)
    for folded, reference in [(pack_for_cpu(model), model), (quantize_int8(model), unfolded)]:
        assert folded.final_logits_bias is None and reference.final_logits_bias is not None
        with torch.no_grad():
            torch.testing.assert_close(folded(src, tgt), reference(src, tgt), atol=1e-5, rtol=1e-5)
    assert model.final_logits_bias is not None


def test_bfloat16_translation_runs_in_bfloat16_and_stays_close_to_float32(checkpoint, tmp_path, capsys):
    """`dtype="bfloat16"` casts the weights, so the activations and the cache are bfloat16 too (not float32
    weights autocast per call); its logits stay near float32's, empty lines stay empty in their places, and
    the command gives what the API gives. Not that batching changes nothing: bfloat16 attention can round
    a text otherwise beside a longer one's padding, as `Translator.hypotheses` says."""
    fp32, bf16 = Translator.load(checkpoint), Translator.load(checkpoint, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    assert bf16.model.new_cache(2, 8).k.dtype == torch.bfloat16
    src = torch.tensor([fp32.tokenizer.encode_src("the number 12 is even")])  # (1, S)
    tgt = torch.tensor([[fp32.tokenizer.bos_id] + fp32.tokenizer.encode_tgt("the number")])  # (1, T)
    with torch.no_grad():
        ref, low = fp32.model(src, tgt).float(), bf16.model(src, tgt).float()
    assert torch.nn.functional.cosine_similarity(ref.flatten(), low.flatten(), dim=0) > 0.999
    out = bf16.translate(TEXTS, max_tokens=30, **OPTIONS)
    assert out[1] == out[4] == "" and any(out)
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    assert main(["translate", str(checkpoint), "-i", str(inp), "-q", "--dtype", "bfloat16", *OPTIONS_ARGS]) == 0
    assert capsys.readouterr().out.split("\n")[:-1] == bf16.translate(TEXTS, **OPTIONS)


def test_dtypes_that_cannot_run_are_one_line(checkpoint):
    with pytest.raises(UserError, match=r"^dtype float16 is for GPUs; on a CPU use bfloat16"):
        Translator.load(checkpoint, dtype="float16")
    with pytest.raises(UserError, match=r"^int8 \(--int8\) quantizes float32 weights, not dtype bfloat16 "
                                        r"\(--dtype bfloat16\): drop one$"):  # was "torch.bfloat16"
        Translator.load(checkpoint, int8=True, dtype=torch.bfloat16)
    with pytest.raises(UserError, match=r"^dtype 'half': choose one of float32, bfloat16, float16"):
        Translator.load(checkpoint, dtype="half")
    assert Translator.load(checkpoint, dtype=torch.float32).model.tgt_embed.embed.weight.dtype == torch.float32


def test_output_never_replaces_the_input_or_a_checkpoint_file(checkpoint, tmp_path, capsys):
    """`-o` over the input (or a link to it) or over a checkpoint's weights, metadata or tokenizer wrote the
    translation there and exited 0: the input, or the model, was gone."""
    src = tmp_path / "in.txt"
    src.write_text("the number 3\n", encoding="utf-8")
    (tmp_path / "link.txt").symlink_to(src)
    weights = (checkpoint / "model.safetensors").read_bytes()
    for out in (src, tmp_path / "link.txt", checkpoint / "model.safetensors", checkpoint / "meta.json"):
        assert main(["translate", str(checkpoint), "-i", str(src), "-o", str(out), "-q"]) == 2
        err = capsys.readouterr().err
        assert f"{out}: " in err and "the input" in err and "would destroy the input" in err
    assert src.read_text(encoding="utf-8") == "the number 3\n"
    assert (checkpoint / "model.safetensors").read_bytes() == weights
    assert main(["translate", str(checkpoint), "-i", str(src), "-o", str(checkpoint / "new.txt"), "-q"]) == 2
    err = capsys.readouterr().err  # a new file destroys nothing there (it said so); training may delete it
    assert "new.txt: lies inside the input" in err and "write it elsewhere" in err and "destroy" not in err
    assert not (checkpoint / "new.txt").exists()
    assert main(["translate", str(checkpoint), "-i", str(src), "-o", str(tmp_path / "out.txt"), "-q"]) == 0
    assert main(["translate", str(checkpoint), "-i", str(src), "-o", str(tmp_path / "out.txt"), "-q"]) == 0
    other = tmp_path / "other_checkpoint"  # not this command's input, but a keep_last may delete it whole
    shutil.copytree(checkpoint, other)
    assert main(["translate", str(checkpoint), "-i", str(src), "-o", str(other / "out.txt"), "-q"]) == 2
    assert f"lies inside the checkpoint {other}" in capsys.readouterr().err


def test_output_never_replaces_a_file_given_as_standard_input(checkpoint, tmp_path):
    """`aiayn translate CKPT -o f < f` wrote the translation over f, exit 0 (-i f, or -i /dev/stdin, was
    refused)."""
    src = tmp_path / "in.txt"
    src.write_text("the number 3\n", encoding="utf-8")
    command = [sys.executable, "-m", "aiayn", "translate", str(checkpoint), "-o", str(src), "-q"]
    with open(src, "rb") as stdin:
        done = subprocess.run(command, stdin=stdin, capture_output=True, text=True)
    assert done.returncode == 2 and "is the input (standard input)" in done.stderr
    assert src.read_text(encoding="utf-8") == "the number 3\n"


def test_standard_output_appending_to_an_input_is_refused_before_loading(checkpoint, tmp_path):
    """`translate CKPT -i f >> f` (`< f >> f`, `-o /dev/stdout >> f`, with --chunk 2 too) read its own
    translations back and appended them again, forever, growing f: refused as cat refuses it, before the
    model loads (a missing checkpoint is not reached), f unchanged; another file appended to is written."""
    import aiayn

    src = tmp_path / "in.txt"
    text = "the number 3\nthe number 4\n"
    src.write_text(text, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(Path(aiayn.__file__).parents[1])}  # this aiayn, not another

    def run(args, appended_to, stdin=os.devnull, ckpt=checkpoint):
        with open(stdin, "rb") as read, open(appended_to, "ab") as out:  # `< stdin >> appended_to`
            command = [sys.executable, "-m", "aiayn", "translate", str(ckpt), "-q", "--threads", "1", *args]
            return subprocess.run(command, stdin=read, stdout=out, stderr=subprocess.PIPE, text=True,
                                  check=False, timeout=60, env=env)

    said = "input file is output file ({} writes to it); write the results elsewhere"
    for args, stdin, name, where in [(["-i", str(src)], os.devnull, src, "standard output"),
                                     (["-i", str(src), "--chunk", "2"], os.devnull, src, "standard output"),
                                     ([], src, "<stdin>", "standard output"),
                                     (["-o", "-", "--chunk", "2"], src, "<stdin>", "standard output"),
                                     (["-i", str(src), "-o", "/dev/stdout"], os.devnull, src, "/dev/stdout")]:
        done = run(args, src, stdin)
        assert (done.returncode, done.stderr) == (2, f"aiayn: error: {name}: {said.format(where)}\n"), args
        assert src.read_text(encoding="utf-8") == text, args
    done = run(["-i", str(src)], src, ckpt=tmp_path / "missing")
    assert (done.returncode, done.stderr) == (2, f"aiayn: error: {src}: {said.format('standard output')}\n")
    other = tmp_path / "out.txt"
    other.write_text("earlier\n", encoding="utf-8")
    done = run(["-i", str(src)], other)
    assert done.returncode == 0, done.stderr
    assert len(other.read_text(encoding="utf-8").splitlines()) == 3


def test_a_missing_input_or_output_folder_fails_before_the_model_loads(checkpoint, tmp_path, capsys,
                                                                        monkeypatch):
    """`-o nodir/out.txt` (or `-i missing.txt`) was said only once the model had loaded, after --compile's
    10-40 s too; score already failed first."""
    src = tmp_path / "in.txt"
    src.write_text("the number 3\n", encoding="utf-8")

    def never(*args, **kwargs):
        raise AssertionError("loaded before the input or output was found unusable")

    monkeypatch.setattr(Translator, "load", never)
    for args, said in [(["-i", str(src), "-o", str(tmp_path / "nodir" / "out.txt")],
                        f"{tmp_path / 'nodir' / 'out.txt'}: cannot write (No such file or directory)"),
                       (["-i", str(tmp_path / "missing.txt")],
                        f"{tmp_path / 'missing.txt'}: cannot read (No such file or directory)")]:
        assert main(["translate", str(checkpoint), "-q", *args]) == 2
        assert capsys.readouterr().err == f"aiayn: error: {said}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_blank_is_what_training_calls_blank_whatever_the_normalization(checkpoint, monkeypatch):
    """With data.normalization=identity a zero-width space or a \\x01 is a piece of its own: such lines were
    translated (made up) though training drops them as blank; and a file's leading BOM is dropped."""
    translator = Translator.load(checkpoint)
    pieces = translator.tokenizer.encode_src
    monkeypatch.setattr(translator.tokenizer, "encode_src", lambda text: [7] + pieces(text))  # never EOS alone
    assert translator.hypotheses(["\u200b", "\x01", "\ufeff", " \t"]) == [[], [], [], []]
    assert translator.hypotheses(["the number 3"])[0]
    stream = io.BytesIO("\ufeffthe number 3\n\ufeffa\n".encode("utf-8"))
    assert list(read_utf8_lines(stream, "in.txt", 10)) == [["the number 3", "\ufeffa"]]  # the first line's only


def test_a_text_of_no_pieces_stays_empty(checkpoint, tmp_path, capsys):
    """A zero-width space or a lone BOM encodes to EOS alone, from which the model made up a sentence."""
    translator = Translator.load(checkpoint)
    texts = ["\u200b", "the number 3", "\u200c\u200b", "\x01"]
    assert [translator.tokenizer.encode_src(t) for t in texts[::2]] == [[translator.tokenizer.eos_id]] * 2
    out = translator.translate(texts, **OPTIONS)
    assert out[0] == out[2] == out[3] == "" and out[1] == alone(translator, texts[1])
    assert translator.hypotheses(texts[:1]) == [[]]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert main(["translate", str(checkpoint), "-i", str(src), "-q", *OPTIONS_ARGS]) == 0
    assert capsys.readouterr().out.split("\n") == out + [""]


@pytest.mark.parametrize("data, message", [
    (b"one\rtwo\r", "CR line ends and no LF"),
    (b"one\rtwo\rthree\n", "CR line ends and more CRs alone than LFs (2 to 1"),  # was translated as one line
    (b"\x1f\x8b\x08\x00\xff\xfe", "invalid UTF-8 (byte 0x8b); the file looks gzip-compressed"),
    ("one\ntwo\n".encode("utf-16"), "invalid UTF-8 (byte 0xff); the file looks like UTF-16"),
    # without a byte order mark: a bare "NUL byte", or "invalid UTF-8" for an ß
    ("one\ntwo\n".encode("utf-16-le"), ("in.txt:1: NUL byte (binary or corrupt input?); the file looks like "
                                         "UTF-16 without a byte order mark; convert it to UTF-8 (iconv -f "
                                         "UTF-16LE -t UTF-8)")),
    ("Fuß\n".encode("utf-16-be"), ("in.txt:1: invalid UTF-8 (byte 0xdf); the file looks like UTF-16 without "
                                   "a byte order mark; convert it to UTF-8 (iconv -f UTF-16BE -t UTF-8)")),
    # a first line of one ASCII character (the space), cut at its newline's 0x0A: the file's start says it
    ("Καλημέρα κόσμε\n".encode("utf-16-le") * 3, ("in.txt:1: invalid UTF-8 (byte 0x9a); the file looks like "
                                                 "UTF-16 without a byte order mark")),
])
def test_translate_names_what_an_unreadable_input_is(checkpoint, tmp_path, capsys, data, message):
    """As training and evaluate do: a CR-only file was translated as one line, exit 0."""
    src = tmp_path / "in.txt"
    src.write_bytes(data)
    assert main(["translate", str(checkpoint), "-i", str(src), "-q"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text", ["Привет\n", "Καλημέρα κόσμε\n"])
def test_utf16_from_a_pipe_is_named_from_the_bytes_read(text):
    """`cat in.txt | aiayn translate`: the name came from the lines read, which UTF-16 without a byte order
    mark fails by its second (cut at its 0x0A bytes), too few to tell it by; the pipe's first bytes say it."""
    from aiayn.translate import read_utf8_lines

    r, w = os.pipe()
    data = (text * 10).encode("utf-16-le")
    writer = threading.Thread(target=lambda: (os.write(w, data), os.close(w)))
    writer.start()
    with os.fdopen(r, "rb") as stream, pytest.raises(UserError, match="looks like UTF-16 without a byte"):
        list(read_utf8_lines(stream, "-", 10))
    writer.join()


def test_a_first_line_with_stray_crs_is_translated_when_more_lines_follow():
    """CRs alone outnumbering LFs are a classic Mac file only in a one-line input; held, the first line is
    then given with the next (one per list with chunk 1)."""
    from aiayn.translate import read_utf8_lines

    data = b"a\rb\rc\n" + b"more\n" * 3
    assert list(read_utf8_lines(io.BytesIO(data), "in", 1, whole_chunks=True)) == [
        ["a\rb\rc"], ["more"], ["more"], ["more"]]
    with pytest.raises(UserError, match=r"^in: CR line ends and more CRs alone than LFs \(2 to 1"):
        list(read_utf8_lines(io.BytesIO(b"a\rb\rc\n"), "in", 1))
    assert list(read_utf8_lines(io.BytesIO(b"the number 5\r\r"), "in", 1)) == [["the number 5"]]  # no LF


def test_a_cr_inside_a_line_is_warned_about_once_by_translate_score_and_evaluate(checkpoint, tmp_path,
                                                                                monkeypatch, capsys):
    """Training warned of a CR inside a line (another system's line end, running two sentences together);
    evaluate said it without the `aiayn: warning:` of its other messages, translate and score not at all
    (SentencePiece's nmt_nfkc reads the CR as a space: one sentence, silently). A file is read twice, checked
    and then translated, or named on both sides: said once."""
    crs = tmp_path / "cr.txt"
    crs.write_bytes(b"the number 3\ris odd\nthe number 4\r\nthe\rnumber\r5\n")  # the CRLF is a line end
    (tmp_path / "ref.txt").write_text("the number 3 is odd\nthe number 4\nthe number 5\n")
    tokenizer = Translator.load(checkpoint).tokenizer
    assert tokenizer.encode_src("the number 3\ris odd") == tokenizer.encode_src("the number 3 is odd")
    said = (f"aiayn: warning: {crs}:1: 3 CR(s) inside lines; lines end at LFs only, so where a CR ended a "
            "line, two sentences are {} as one")
    assert main(["translate", str(checkpoint), "-i", str(crs), "-q", *OPTIONS_ARGS]) == 0
    assert capsys.readouterr().err.splitlines() == [said.format("translated")]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(crs.read_bytes())))
    assert main(["translate", str(checkpoint), *OPTIONS_ARGS]) == 0
    assert capsys.readouterr().err.splitlines() == [said.format("translated").replace(str(crs), "<stdin>")]
    assert main(["score", str(checkpoint), "--src", str(tmp_path / "ref.txt"), "--tgt", str(crs), "-q"]) == 0
    assert capsys.readouterr().err.splitlines()[:-1] == [said.format("scored")]  # then the summary
    assert main(["evaluate", str(crs), str(tmp_path / "ref.txt")]) == 0
    assert capsys.readouterr().err.splitlines() == [said.format("scored")]
    # The same file on both sides: score said it twice (a stream each), evaluate once (a path)
    assert main(["score", str(checkpoint), "--src", str(crs), "--tgt", str(crs), "-q"]) == 0
    assert capsys.readouterr().err.splitlines()[:-1] == [said.format("scored")]
    assert main(["evaluate", str(crs), str(crs)]) == 0
    assert capsys.readouterr().err.splitlines()[:-1] == [said.format("scored")]  # then "against itself"


def test_a_file_or_a_run_directory_is_not_a_checkpoint(checkpoint, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    for step in ("step_999999", "step_1000000"):  # the newest by number, not by name
        shutil.copytree(checkpoint, run / "checkpoints" / step)
    assert main(["translate", str(run)]) == 2
    assert f"no meta.json); a run directory: name one of its checkpoints, e.g. {run}/checkpoints/step_1000000" in (
        capsys.readouterr().err)
    assert main(["translate", str(tmp_path)]) == 2  # a demo's --out folder, whose run is run/: no hint was
    assert capsys.readouterr().err == (f"aiayn: error: {tmp_path}: not an aiayn checkpoint (no meta.json); "
                                       f"its run is {run}: name one of its checkpoints, e.g. "
                                       f"{run}/checkpoints/step_1000000\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(run))}/checkpoints: not an aiayn checkpoint \(no "
                       r"meta.json\); a run's checkpoints folder: name one of its checkpoints, e.g. "
                       rf"{re.escape(str(run))}/checkpoints/step_1000000$"):
        Translator.load(run / "checkpoints")  # its checkpoints/ folder itself had no hint
    monkeypatch.chdir(run / "checkpoints")  # "." inside it: a name of "", which the hint missed
    with pytest.raises(UserError, match=r"^\.: not an aiayn checkpoint \(no meta.json\); a run's checkpoints "
                       r"folder: name one of its checkpoints, e.g. \.\./checkpoints/step_1000000$"):
        Translator.load(".")
    for name in ("meta.json", "model.safetensors"):  # a file of one: the directory to name is said
        assert main(["translate", str(checkpoint / name)]) == 2
        assert capsys.readouterr().err == (f"aiayn: error: {checkpoint / name}: is a file, not a checkpoint "
                                           f"directory; name the checkpoint it is in, {checkpoint}\n")
    monkeypatch.chdir(checkpoint)  # inside it: "name the checkpoint it is in, ."
    assert main(["info", "meta.json"]) == 2
    assert capsys.readouterr().err == ("aiayn: error: meta.json: is a file, not a checkpoint directory; name "
                                       "the checkpoint it is in, the current directory (.)\n")


def test_min_len_past_the_models_positions_is_refused_whatever_max_len_a(checkpoint, capsys):
    """With max_len_a > 0 the length limit depends on each source, but never passes the model's positions:
    a min_len beyond them would cut every output without EOS. Refused before anything is translated."""
    translator = Translator.load(checkpoint)
    limit = translator.model.config.max_len
    for min_len in (limit, limit + 1):  # at `limit` EOS could come at position limit + 1 only: cut, too
        with pytest.raises(ConfigError, match=rf"^min_len={min_len} leaves no room for EOS in the {limit} "):
            translator.translate(["the number 3"], min_len=min_len, max_len_a=2.0)
    assert translator.translate(["the number 3"], min_len=2, max_len_a=2.0, beam=1)  # within: translated
    # DecodeConfig forces exactly max_len_b tokens so (benchmarks); text would come without its EOS
    with pytest.raises(ConfigError, match=r"^min_len=4 leaves no room for EOS in the max_len_b=4 tokens"):
        translator.translate(["the number 3"], min_len=4, max_len_a=0.0, max_len_b=4)
    assert translator.translate(["the number 3"], min_len=3, max_len_a=0.0, max_len_b=4, beam=1)
    src = Path(capsys.readouterr() and checkpoint).parent / "one.txt"
    src.write_text("the number 3\n")
    assert main(["translate", str(checkpoint), "-i", str(src), "--min-len", str(limit + 1)]) != 0
    err = capsys.readouterr().err.strip()
    assert err == (f"aiayn: error: --min-len {limit + 1} leaves no room for EOS in the {limit} output "
                   "positions of this model")


def test_a_huge_max_len_b_means_the_models_own_limit(checkpoint):
    """max_len_b=10**309 (or --max-len-b) failed with "OverflowError: int too large to convert to float"."""
    translator = Translator.load(checkpoint)
    limit = translator.model.config.max_len
    for a in (0.0, 1.0):
        assert translator.translate(["the number 3"], max_len_a=a, max_len_b=10**309, beam=1) == (
            translator.translate(["the number 3"], max_len_a=a, max_len_b=limit, beam=1))


def test_min_len_past_a_sentences_own_limit_is_said(checkpoint, caplog):
    """With max_len_a the limit is each sentence's own, so it cannot be refused up front: a min_len of 10
    under 0.5 x length + 1 cut every output, without EOS, and nothing said so."""
    translator = Translator.load(checkpoint)
    n = len(translator.tokenizer.encode_src("the number 3"))  # the limit is int(0.5 * n + 1)
    with caplog.at_level("WARNING", logger="aiayn.translate"):
        out = translator.hypotheses(["the number 3", ""], min_len=10, max_len_a=0.5, max_len_b=1, beam=1)
    assert out[0][0].tokens[-1] != translator.tokenizer.eos_id and len(out[0][0].tokens) == int(0.5 * n + 1)
    said = ("min_len=10 leaves no room for EOS in the length limit (0.5 x source length + 1) of 1 text(s), "
            "the first 'the number 3': they end cut, without EOS")
    assert caplog.messages == [said]
    caplog.clear()
    with caplog.at_level("WARNING", logger="aiayn.translate"):
        translator.hypotheses(["the number 3"], min_len=2, max_len_a=2.0, max_len_b=5, beam=1)
    assert caplog.messages == []


def test_min_len_past_a_lines_own_limit_is_said_once_per_stream_in_flags(checkpoint, monkeypatch, capsys):
    """`aiayn translate` said it once per chunk (3 times for 6 piped lines in chunks of 2), in the
    library's words (min_len=10) and without the `aiayn:` of its other messages."""
    lines = ["the number 3 beam=5", "", "odd", "the number 4", "the number 5 is odd", "7"]  # beam=5: the
    # line as written, not in flags (it was shown as "--beam 5")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(("\n".join(lines) + "\n").encode())))
    args = ["--min-len", "10", "--max-len-a", "0.5", "--max-len-b", "1", "--beam", "1", "--chunk", "2"]
    assert main(["translate", str(checkpoint), *args]) == 0
    out, err = capsys.readouterr()
    assert len(out.split("\n")) == 7
    assert err == ("aiayn: warning: --min-len 10 leaves no room for EOS in the length limit (0.5 x source "
                   "length + 1) of <stdin> line 1 ('the number 3 beam=5') and any line as short: they end "
                   "cut, without EOS\n")


def test_translate_stream_of_text_is_a_type_error_naming_the_fix(checkpoint):
    """A text stream (io.StringIO, sys.stdin) failed at its first line: 'str' object has no attribute
    'decode'."""
    translator = Translator.load(checkpoint)
    with pytest.raises(TypeError, match=r"^<text>: translate_stream reads bytes .* open\(path, 'rb'\) or "
                                        r"sys.stdin.buffer$"):
        translate_stream(translator, io.StringIO("the number 3\n"), io.StringIO(), "<text>", **OPTIONS)
    out = io.StringIO()
    assert translate_stream(translator, io.BytesIO(b"the number 3\n"), out, "<bytes>", **OPTIONS) == 1
    assert out.getvalue().count("\n") == 1
    from aiayn.translate import score_stream

    with pytest.raises(TypeError, match=r"^<tgt>: score_stream reads bytes .* open\(path, 'rb'\) or "):
        score_stream(translator, io.BytesIO(b"the number 3\n"), io.StringIO("die Zahl 3\n"), io.StringIO(),
                     ("<src>", "<tgt>"))
    assert score_stream(translator, io.BytesIO(b"the number 3\n"), io.BytesIO(b"die Zahl 3\n"), io.StringIO(),
                        ("<src>", "<tgt>")).pairs == 1

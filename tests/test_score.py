"""Forced decoding (`aiayn score`): log P(target | source) of given translations equals what a search
scored when it found them, and a float64 full forward pass of the model."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import numbers_checkpoint, padded_batch, tiny_model

from aiayn.checkpoint import save_checkpoint
from aiayn.cli import main
from aiayn.data.batching import right_pad
from aiayn.decoding import DecodeConfig, Ensemble, generate
from aiayn.decoding.score import force_decode
from aiayn.errors import SentenceTooLong, UserError
from aiayn.translate import Translator

pytestmark = pytest.mark.usefixtures("one_thread")


def full_forward_log_prob(model, src_row, tokens):
    """log P(tokens | src) from one uncached forward pass in float64, padding never an output."""
    model = model.double()
    tgt_in = torch.tensor([[model.config.decoder_start_id] + tokens[:-1]])
    with torch.no_grad():
        logits = model(src_row[None], tgt_in)[0]  # (T, V)
    logits[:, model.config.pad_id] = -math.inf
    log_probs = logits.log_softmax(-1)
    model.float()
    return log_probs.gather(1, torch.tensor(tokens)[:, None]).sum().item()


def test_found_hypotheses_score_what_the_search_scored_them():
    torch.manual_seed(0)
    model = tiny_model()
    src = padded_batch([5, 3, 7], 50)
    found = generate(model, src, DecodeConfig(beam=4, n_best=4, max_len_a=0.0, max_len_b=6))
    rows = [i for i, hyps in enumerate(found) for _ in hyps]
    targets = [h.tokens for hyps in found for h in hyps]  # some end with EOS, some were cut at 6
    scored = force_decode(model, src[rows], targets)
    assert scored == pytest.approx([h.log_prob for hyps in found for h in hyps], abs=1e-4)
    for r, tokens, log_prob in zip(rows, targets, scored):
        length = int((src[r] != model.config.pad_id).sum())
        assert log_prob == pytest.approx(full_forward_log_prob(model, src[r, :length], tokens), abs=1e-4)


def test_an_ensemble_scores_the_mean_of_its_members_probabilities():
    torch.manual_seed(0)
    models = [tiny_model(), tiny_model(d_model=16, d_ff=32, n_layers=3)]
    ensemble = Ensemble(models)
    src = padded_batch([4, 6], 50)
    found = generate(ensemble, src, DecodeConfig(beam=3, n_best=3, max_len_a=0.0, max_len_b=5))
    rows = [i for i, hyps in enumerate(found) for _ in hyps]
    scored = force_decode(ensemble, src[rows], [h.tokens for hyps in found for h in hyps])
    assert scored == pytest.approx([h.log_prob for hyps in found for h in hyps], abs=1e-4)


def test_a_batch_scores_as_each_pair_alone():
    torch.manual_seed(0)
    model = tiny_model()
    src = padded_batch([2, 7, 4], 50)
    targets = [[5, 6, 2], [7, 2], [9, 10, 11, 12, 2]]
    alone = [force_decode(model, src[i : i + 1, : int((src[i] != 0).sum())], [t])[0]
             for i, t in enumerate(targets)]
    assert force_decode(model, src, targets) == pytest.approx(alone, abs=1e-5)
    with pytest.raises(ValueError, match=r"^targets\[1\] is empty: end each target with EOS \(2\)$"):
        force_decode(model, src, [[5, 2], [], [2]])  # "or an empty one", which, not said
    with pytest.raises(ValueError, match=r"^2 targets for 3 sources: one for each, ending with EOS$"):
        force_decode(model, src, [[5, 2], [2]])
    for bad in (50, -1):  # the gather's "index 50 is out of bounds for dimension 1 with size 50"
        with pytest.raises(ValueError, match=rf"^targets\[1\] holds id {bad}, outside the target vocabulary "
                                             r"of 50 \(ids 0 to 49\)$"):
            force_decode(model, src, [[5, 2], [7, bad, 2], [2]])
    # 7.9 was scored as 7 (right_pad's int cast); numpy's integers and 0-d tensors are ids
    with pytest.raises(TypeError, match=r"^targets\[2\] holds 7.9, a float: token ids are integers$"):
        force_decode(model, src, [[5, 2], [7, 2], [7.9, 2]])
    assert force_decode(model, src, [[5, 2], [np.int64(7), torch.tensor(2)], [2]]) == pytest.approx(
        force_decode(model, src, [[5, 2], [7, 2], [2]]))
    # a tensor of rows failed in `all` ("Boolean value of Tensor ... is ambiguous"); its padding is not EOS
    refusal = r"^targets holds a Tensor: force_decode takes one list of token ids per source, each ending"
    for rows in (right_pad(targets, 0), [torch.tensor(t) for t in targets]):
        with pytest.raises(TypeError, match=refusal):
            force_decode(model, src, rows)


def test_a_source_of_padding_alone_is_refused_as_the_searches_refuse_it():
    """It was "src_mask row 1 is False everywhere ... unlike torch's key_padding_mask", blaming a mask the
    caller never passed; a model and an ensemble alike."""
    model = tiny_model().eval()
    src = padded_batch([4, 0], 50)
    for scorer in (model, Ensemble([model, model])):
        with pytest.raises(ValueError, match=r"^src row 1 does not end with EOS \(2\): every source does "
                                             r"\(Tokenizer\.encode_src\)$"):
            force_decode(scorer, src, [[5, 2], [6, 2]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return numbers_checkpoint(tmp_path_factory.mktemp("score"), max_len=40)


SOURCES = ["the number 3 is odd", "the number 12", "", "die Zahl 7"]


def test_texts_score_as_their_pieces_alone_in_float64_and_every_pair_is_scored(checkpoint):
    """Translator.score encodes, batches (several batches here) and sums as one pair alone through a
    float64 full forward pass of the checkpoint's model would."""
    from aiayn.checkpoint import load_checkpoint

    translator = Translator.load(checkpoint)
    model, tokenizer = load_checkpoint(checkpoint).model, translator.tokenizer
    targets = ["die Zahl 3 ist ungerade", "die Zahl 12", "", "the number 7 is odd"]
    scored = translator.score(SOURCES, targets, max_tokens=8)
    for source, target, s in zip(SOURCES, targets, scored):
        tokens = tokenizer.encode_tgt(target) + [tokenizer.eos_id]
        expected = full_forward_log_prob(model, torch.tensor(tokenizer.encode_src(source)), tokens)
        assert s.tokens == len(tokens) and s.log_prob == pytest.approx(expected, abs=1e-4)
        assert s.per_token == s.log_prob / s.tokens
    assert scored[2].tokens == 1 and scored[2].log_prob < 0  # an empty pair: P(EOS | EOS)
    with pytest.raises(ValueError, match="4 sources but 3 targets"):
        translator.score(SOURCES, targets[:3])


def test_a_side_that_is_no_list_of_strings_is_named(checkpoint):
    """`score(["a"], "b")` said "texts must be a list of strings", naming neither the targets nor the
    sources: each side is named as its argument, and a text in it by its side."""
    translator = Translator.load(checkpoint)
    with pytest.raises(TypeError, match=r"^targets must be a list of strings, not one str: pass \[target\]$"):
        translator.score(["a"], "b")
    with pytest.raises(TypeError, match=r"^sources\[1\] is int, not str$"):
        translator.score(["a", 3], ["b", "c"])
    with pytest.raises(UserError, match=r"^target 2: not valid Unicode"):
        translator.score(["a", "b"], ["b", "c\udcff"])
    # None: "'NoneType' object is not iterable"
    with pytest.raises(TypeError, match=r"^sources must be a list of strings, not NoneType$"):
        translator.score(None, None)
    with pytest.raises(TypeError, match=r"^texts must be a list of strings, not NoneType$"):
        translator.translate(None)


def test_an_ensemble_past_its_shortest_members_positions_and_out_of_memory_are_named(checkpoint, tmp_path,
                                                                                    monkeypatch):
    from aiayn.checkpoint import load_checkpoint
    from aiayn.errors import OutOfMemory

    ck = load_checkpoint(checkpoint)
    narrow = tiny_model(vocab_size=ck.tokenizer.src_vocab_size, max_len=20)
    short = save_checkpoint(tmp_path / "short", narrow, ck.tokenizer)
    ensemble = Translator.load([checkpoint, short])
    with pytest.raises(SentenceTooLong, match=r"^text 1 \(target\): \d+ tokens \(with the EOS scoring "
                                              r"appends, which needs a position too\), more than the 20 "
                                              r"positions of the ensemble's shortest model$"):
        ensemble.score(["a"], ["die Zahl 4 " * 10])

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr("aiayn.translate.force_decode", no_memory)
    with pytest.raises(OutOfMemory, match=r"^text 1: out of memory scoring a batch of 2 pair\(s\); use fewer "
                                          r"tokens per batch \(--max-tokens\)$"):  # it spoke of a beam
        Translator.load(checkpoint).score(["a", "b"], ["c", "d"])
    with pytest.raises(OutOfMemory, match=r"^text 1: out of memory scoring a batch of 1 pair\(s\); the pair "
                                          r"alone needs more memory$"):  # no batch is smaller
        Translator.load(checkpoint).score(["a"], ["c"])


def test_the_cli_writes_one_score_per_line_and_the_perplexity(checkpoint, tmp_path, capsys):
    translator = Translator.load(checkpoint)
    targets = ["die Zahl 3 ist ungerade", "die Zahl 12", "", "the number 7"]
    expected = translator.score(SOURCES, targets)
    (tmp_path / "src").write_text("\n".join(SOURCES) + "\n")
    (tmp_path / "tgt").write_text("\n".join(targets) + "\n")
    argv = ["score", str(checkpoint), "--src", str(tmp_path / "src"), "--tgt", str(tmp_path / "tgt"), "-q"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert [float(x) for x in out.split()] == pytest.approx([s.log_prob for s in expected], abs=1e-6)
    tokens = sum(s.tokens for s in expected)
    nll = -sum(s.log_prob for s in expected) / tokens
    assert err == (f"4 pairs, {tokens} target tokens (EOS included): log P per token {-nll:.4f}, "
                   f"perplexity {math.exp(nll):.3f}\n")
    assert main([*argv, "--normalize", "-o", str(tmp_path / "out")]) == 0
    written = [float(x) for x in (tmp_path / "out").read_text().split()]
    assert written == pytest.approx([s.per_token for s in expected], abs=1e-6)


def test_a_source_of_no_pieces_is_scored_0_by_n_best_and_not_by_score_as_the_readme_says(checkpoint, tmp_path,
                                                                                         capsys):
    """The README: a translation scores what `--n-best` reported for it, with exceptions. It left out a
    source line of no pieces (empty, blank, a zero-width space): not searched, reported scored 0, while
    `aiayn score` gives log P(EOS | a source of EOS alone)."""
    src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
    src.write_text("\n   \n\u200b\n", encoding="utf-8")
    tgt.write_text("\n\n\n")
    assert main(["translate", str(checkpoint), "-i", str(src), "-q", "--beam", "2", "--n-best", "2"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows == [f"{i} |||  ||| F0= 0.0000 ||| 0.0000" for i in (0, 0, 1, 1, 2, 2)]
    assert main(["score", str(checkpoint), "--src", str(src), "--tgt", str(tgt), "-q"]) == 0
    scores = [float(line) for line in capsys.readouterr().out.splitlines()]
    assert len(scores) == 3 and all(s < 0 for s in scores)
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").split())
    exceptions = readme.split("scores what `--n-best` reported for it")[1].split("`--normalize`")[0]
    said = ("a line of none, empty, blank or only characters the tokenizer drops, is not searched, and "
            "`--n-best` reports its empty rows scored 0 where `aiayn score` gives the log P of EOS")
    assert said in exceptions


def test_bad_pairs_are_one_line_naming_the_file(checkpoint, tmp_path, capsys, monkeypatch):
    """Line counts that differ are named at the first line the shorter file lacks, as evaluate and training
    name them ("tgt: 1 line, but src has 2 lines" had no line), before loading or, from a pipe, where the
    stream ends; -o keeps what it held."""
    import os
    import sys

    (tmp_path / "src").write_text("the number 3\nthe number 4\n")
    (tmp_path / "tgt").write_text("die Zahl 3\n")
    (tmp_path / "out").write_text("kept\n")
    argv = ["score", str(checkpoint), "--src", str(tmp_path / "src"), "--tgt", str(tmp_path / "tgt"), "-q"]
    tgt, src = tmp_path / "tgt", tmp_path / "src"
    assert main([*argv, "-o", str(tmp_path / "out")]) == 2
    err = f"aiayn: error: {src}:2: line counts differ: {src} has 2 lines, {tgt} has 1\n"
    assert capsys.readouterr().err == err
    assert (tmp_path / "out").read_text() == "kept\n"
    read_end, write_end = os.pipe()
    os.write(write_end, b"die Zahl 3\ndie Zahl 4\nmehr\n")
    os.close(write_end)
    with open(read_end, encoding="utf-8") as pipe:
        monkeypatch.setattr(sys, "stdin", pipe)
        assert main([*argv[:4], "--tgt", "-", "-q", "-o", str(tmp_path / "out")]) == 2
    err = f"aiayn: error: <stdin>:3: line counts differ: {src} has 2 lines, <stdin> has 3\n"
    assert capsys.readouterr().err == err and (tmp_path / "out").read_text() == "kept\n"
    (tmp_path / "tgt").write_text("die Zahl 3\n" + "die Zahl 4 " * 30 + "\n")  # past max_len=40
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"aiayn: error: {tmp_path / 'tgt'}:2: ") and "more than the 40 positions" in err
    assert main([*argv, "-o", str(tmp_path / "src")]) == 2  # never over an input
    assert "writing it would destroy the input" in capsys.readouterr().err
    with pytest.raises(SentenceTooLong, match=r"^text 2 \(target\): "):
        Translator.load(checkpoint).score(["a", "b"], ["c", "d " * 60])


def test_empty_input_is_refused_as_evaluate_refuses_it(checkpoint, tmp_path, capsys, monkeypatch):
    """Two empty files exited 0 with no output and no perplexity on stderr, which the README says it
    always gets; evaluate says "e0: empty, nothing to score". Files are refused before the model loads;
    a pipe, once read; -o keeps what it held."""
    import io
    import os
    import sys

    from aiayn.translate import score_stream

    (tmp_path / "e0").write_bytes(b"")
    (tmp_path / "out").write_text("kept\n")
    e0 = str(tmp_path / "e0")
    argv = ["score", str(checkpoint), "--src", e0, "--tgt", e0, "-q", "-o", str(tmp_path / "out")]
    with monkeypatch.context() as patched:
        patched.setattr(Translator, "load", lambda *a, **k: pytest.fail("loaded for an empty input"))
        assert main(argv) == 2
    assert capsys.readouterr().err == f"aiayn: error: {e0}: empty, nothing to score\n"
    read_end, write_end = os.pipe()
    os.close(write_end)
    with open(read_end, encoding="utf-8") as pipe:
        monkeypatch.setattr(sys, "stdin", pipe)
        assert main([*argv[:4], "--tgt", "-", *argv[6:]]) == 2
    assert capsys.readouterr().err == f"aiayn: error: {e0}: empty, nothing to score\n"
    assert (tmp_path / "out").read_text() == "kept\n"
    with pytest.raises(UserError, match=r"^s: empty, nothing to score$"):
        score_stream(Translator.load(checkpoint), io.BytesIO(), io.BytesIO(), io.StringIO(), ("s", "t"))


def test_a_too_long_line_late_in_a_file_fails_before_anything_is_scored(checkpoint, tmp_path, capsys,
                                                                         monkeypatch):
    """Line 10,031 past the model's positions was found after the 10,000 pairs before it were scored, and
    the work thrown away; regular files are checked whole first, as translate's input."""
    def scored(*args, **kwargs):
        raise AssertionError("a chunk was scored before the input was checked")

    monkeypatch.setattr(Translator, "score", scored)
    for side, text in (("src", "the number 12 " * 30), ("tgt", "die Zahl 4 " * 30)):
        lines = {"src": ["the number 3"] * 10_031, "tgt": ["die Zahl 3"] * 10_031}
        lines[side][-1] = text
        for name in lines:
            (tmp_path / name).write_text("\n".join(lines[name]) + "\n")
        assert main(["score", str(checkpoint), "--src", str(tmp_path / "src"), "--tgt", str(tmp_path / "tgt"),
                     "-q", "-o", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"aiayn: error: {tmp_path / side}:10031: ")
        assert "more than the 40 positions" in err
    assert not (tmp_path / "out").exists()


def test_a_stream_is_scored_chunk_by_chunk_as_a_whole(checkpoint):
    """Memory stays one chunk's (a 400,000-pair file read whole took 670 MB); the numbers do not move."""
    import io

    from aiayn.translate import score_stream

    translator = Translator.load(checkpoint)
    sources = [f"the number {i} is {'odd' if i % 2 else 'even'}" for i in range(7)]
    targets = [f"die Zahl {i}" for i in range(7)]
    whole = translator.score(sources, targets)

    def streams(src, tgt):
        return io.BytesIO(("\n".join(src) + "\n").encode()), io.BytesIO(("\n".join(tgt) + "\n").encode())

    out = io.StringIO()
    done = score_stream(translator, *streams(sources, targets), out, ("s", "t"), chunk=2)
    assert [float(x) for x in out.getvalue().split()] == pytest.approx([s.log_prob for s in whole], abs=1e-5)
    assert (done.pairs, done.tokens) == (7, sum(s.tokens for s in whole))
    assert done.perplexity == pytest.approx(math.exp(-sum(s.log_prob for s in whole) / done.tokens))
    with pytest.raises(UserError, match=r"^s:6: line counts differ: s has 7 lines, t has 5$"):  # where t ends
        score_stream(translator, *streams(sources, targets[:5]), io.StringIO(), ("s", "t"), chunk=2)
    long = targets[:5] + ["die Zahl 4 " * 30] + targets[6:]
    with pytest.raises(UserError, match=r"^t:6: \d+ tokens \(with the EOS scoring appends, which needs a "
                                        r"position too\), more than the 40 positions"):
        score_stream(translator, *streams(sources, long), io.StringIO(), ("s", "t"), chunk=2)


def test_a_stop_python_dropped_ends_the_scoring_at_the_chunk_it_came_in(checkpoint, monkeypatch):
    """A Ctrl-C that Python dropped (the CLI records it) while a chunk was scored: the stream scored every
    chunk after it, with -o all of them thrown away at the end. It stops there, that chunk unwritten."""
    import io

    from aiayn import files
    from aiayn.translate import score_stream

    translator = Translator.load(checkpoint)
    score, chunks = translator.score, []

    def scored(sources, targets, *args):
        chunks.append(len(sources))
        files.record_dropped_stop(KeyboardInterrupt())
        return score(sources, targets, *args)

    monkeypatch.setattr(translator, "score", scored)
    lines = [io.BytesIO(b"the number 3\n" * 7), io.BytesIO(b"die Zahl 3\n" * 7)]
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        score_stream(translator, *lines, out, ("s", "t"), chunk=2)
    assert chunks == [2] and out.getvalue() == ""


def test_a_stream_scores_the_pairs_before_a_too_long_line_first(checkpoint, tmp_path, capsys, monkeypatch):
    """A pipe's too long line (a file is checked whole first) lost the pairs before it in its chunk: none
    written of 10,000, then the line named. They are scored and written first; a file's too long lines
    are all named, the first and the others counted."""
    import io
    import sys
    from types import SimpleNamespace

    from aiayn.translate import score_stream

    translator = Translator.load(checkpoint)
    sources = [f"the number {i}" for i in range(8)]
    targets = [f"die Zahl {i}" for i in range(8)]
    targets[5] = targets[7] = "die Zahl 4 " * 30  # past max_len=40
    streams = [io.BytesIO(("\n".join(side) + "\n").encode()) for side in (sources, targets)]
    out = io.StringIO()
    with pytest.raises(SentenceTooLong, match=r"^t:6: .* positions of this model; and 1 more in the 8 lines "
                                              r"read: line 8$"):
        score_stream(translator, *streams, out, ("s", "t"))
    assert [float(x) for x in out.getvalue().split()] == pytest.approx(
        [s.log_prob for s in translator.score(sources[:5], targets[:5])], abs=1e-5)
    # a source line too long after a target's: the source side is checked first, so its line was named,
    # and the retry's error on the target's line left the handler, writing nothing
    both = [sources[:5] + ["the number 4 " * 30] + sources[6:], targets[:2] + [targets[5]] + targets[3:5]
            + sources[5:]]
    out = io.StringIO()
    with pytest.raises(SentenceTooLong, match=r"^t:3: "):
        score_stream(translator, *[io.BytesIO(("\n".join(side) + "\n").encode()) for side in both], out,
                     ("s", "t"))
    assert [float(x) for x in out.getvalue().split()] == pytest.approx(
        [s.log_prob for s in translator.score(sources[:2], targets[:2])], abs=1e-5)
    (tmp_path / "src").write_text("\n".join(sources) + "\n")
    piped = io.BytesIO(("\n".join(targets) + "\n").encode())
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=piped))
    assert main(["score", str(checkpoint), "--src", str(tmp_path / "src"), "--tgt", "-", "-q"]) == 2
    said = capsys.readouterr()
    assert len(said.out.split()) == 5 and said.err.startswith("aiayn: error: <stdin>:6: ")
    (tmp_path / "tgt").write_text("\n".join(targets) + "\n")
    assert main(["score", str(checkpoint), "--src", str(tmp_path / "src"), "--tgt", str(tmp_path / "tgt"),
                 "-q"]) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err.startswith(f"aiayn: error: {tmp_path / 'tgt'}:6: ")
    assert said.err.endswith("positions of this model; and 1 more: line 8\n")


@pytest.mark.parametrize("side", [0, 1])
def test_a_stream_scores_the_pairs_before_a_bad_byte_first(checkpoint, side):
    """A pipe's invalid UTF-8 (or NUL byte) on either side lost the pairs read before it in its chunk,
    as a too long line's once did: they are scored and written first, then the line named."""
    import io

    from aiayn.translate import score_stream

    translator = Translator.load(checkpoint)
    sides = [[f"the number {i}" for i in range(8)], [f"die Zahl {i}" for i in range(8)]]
    data = [b"".join(line.encode() + b"\xff" * (s == side and i == 5) + b"\n" for i, line in enumerate(lines))
            for s, lines in enumerate(sides)]  # line 6 of one side ends in a byte no UTF-8 has
    out = io.StringIO()
    with pytest.raises(UserError, match=r"^[st]:6: invalid UTF-8 \(byte 0xff\)$"):
        score_stream(translator, *map(io.BytesIO, data), out, ("s", "t"))
    assert [float(x) for x in out.getvalue().split()] == pytest.approx(
        [s.log_prob for s in translator.score(sides[0][:5], sides[1][:5])], abs=1e-5)
    # the other side bad further on, or long: the first bad line is named, the other side not read on
    other = [line.encode() + b"\n" for line in sides[1 - side]] * 20
    other[99 if side else 9] += b"\xff"  # its line 100 or 10: after the side's line 6
    data[1 - side] = b"".join(other)
    for chunk in (10_000, 2):
        out = io.StringIO()
        with pytest.raises(UserError, match=rf"^{'st'[side]}:6: invalid UTF-8"):
            score_stream(translator, *map(io.BytesIO, data), out, ("s", "t"), chunk=chunk)
        assert len(out.getvalue().split()) == 5


def test_the_cli_reads_standard_input_and_refuses_a_missing_output_folder_first(checkpoint, tmp_path, capsys,
                                                                               monkeypatch):
    import io
    import sys
    from types import SimpleNamespace

    (tmp_path / "src").write_text("the number 3\nthe number 4\n")
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(b"die Zahl 3\ndie Zahl 4\n")))
    assert main(["score", str(checkpoint), "--src", str(tmp_path / "src"), "--tgt", "-", "-q"]) == 0
    out = capsys.readouterr().out.split()
    assert [float(x) for x in out] == pytest.approx(
        [s.log_prob for s in Translator.load(checkpoint).score(["the number 3", "the number 4"],
                                                               ["die Zahl 3", "die Zahl 4"])], abs=1e-6)

    def never(*args, **kwargs):
        raise AssertionError("scored before the output was found unwritable")

    monkeypatch.setattr(Translator, "score", never)
    argv = ["score", str(checkpoint), "--src", str(tmp_path / "src"), "--tgt", str(tmp_path / "src"), "-q"]
    assert main([*argv, "-o", str(tmp_path / "no" / "such" / "out")]) == 2
    assert "cannot write (No such file or directory)" in capsys.readouterr().err
    assert main([*argv[:2], "--src", "-", "--tgt", "-"]) == 2
    assert "cannot both be standard input" in capsys.readouterr().err
    assert main([*argv, "--threads", "100000"]) == 2  # libgomp segfaulted; translate refused it already
    assert "--threads 100000 is more than" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", None)  # started with stdin closed
    assert main([*argv[:2], "--src", "-", "--tgt", str(tmp_path / "src")]) == 2
    assert capsys.readouterr().err == "aiayn: error: <stdin>: closed; give an input file with --src FILE\n"


def test_both_sides_from_standard_input_by_any_name_are_refused(checkpoint, tmp_path, capsys, monkeypatch):
    """`cat f | aiayn score CK --src - --tgt /dev/stdin`: the second read of the pipe was empty, said as
    "/dev/stdin: 0 lines, but <stdin> has 2 lines"; only `--src - --tgt -` was caught. /proc/self/fd/N
    names the pipe here as /dev/stdin names fd 0."""
    import os
    import sys

    read_end, write_end = os.pipe()
    os.write(write_end, b"the number 3\nthe number 4\n")
    os.close(write_end)
    with open(read_end, encoding="utf-8") as pipe:
        monkeypatch.setattr(sys, "stdin", pipe)
        this = f"/proc/self/fd/{read_end}"
        for src, tgt in (("-", this), (this, this), (this, "-")):
            assert main(["score", str(checkpoint), "--src", src, "--tgt", tgt, "-q"]) == 2
            said = f"aiayn: error: --src {src} and --tgt {tgt} cannot both be standard input\n"
            assert capsys.readouterr().err == said


def test_standard_output_appending_to_an_input_is_refused_before_loading(checkpoint, tmp_path):
    """`score CKPT --src e --tgt f >> f` appended its scores to f, read them as targets and blamed the
    data ("line counts differ"); `--src - < e >> e` too: refused as cat refuses it, before the model loads
    (a missing checkpoint is not reached), the input unchanged."""
    import os
    import subprocess
    import sys

    import aiayn

    src, tgt = tmp_path / "src", tmp_path / "tgt"
    src.write_text("the number 3\nthe number 4\n", encoding="utf-8")
    tgt.write_text("die Zahl 3\ndie Zahl 4\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(Path(aiayn.__file__).parents[1])}  # this aiayn, not another
    said = "input file is output file (standard output writes to it); write the results elsewhere"
    for ckpt, args, stdin, appended_to, name in [
            (checkpoint, ["--src", str(src), "--tgt", str(tgt)], os.devnull, tgt, tgt),
            (tmp_path / "missing", ["--src", str(src), "--tgt", str(tgt)], os.devnull, tgt, tgt),
            (checkpoint, ["--src", "-", "--tgt", str(tgt)], src, src, "<stdin>")]:
        before = appended_to.read_text(encoding="utf-8")
        with open(stdin, "rb") as read, open(appended_to, "ab") as out:
            command = [sys.executable, "-m", "aiayn", "score", str(ckpt), "-q", "--threads", "1", *args]
            done = subprocess.run(command, stdin=read, stdout=out, stderr=subprocess.PIPE, text=True,
                                  check=False, timeout=60, env=env)
        assert (done.returncode, done.stderr) == (2, f"aiayn: error: {name}: {said}\n"), args
        assert appended_to.read_text(encoding="utf-8") == before


def test_cr_line_ends_on_standard_input_are_told_a_conversion_that_runs(checkpoint, tmp_path, capsys,
                                                                        monkeypatch):
    """`printf 'A.\\rB.\\r' | aiayn score CK --src two --tgt -` suggested `tr '\\r' '\\n' < <stdin> >
    <stdin>.lf`, which no shell can run."""
    import io
    import sys
    from types import SimpleNamespace

    (tmp_path / "two").write_text("the number 3\nthe number 4\n")
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BytesIO(b"die Zahl 3\rdie Zahl 4\r")))
    assert main(["score", str(checkpoint), "--src", str(tmp_path / "two"), "--tgt", "-", "-q"]) == 2
    assert capsys.readouterr().err == (
        "aiayn: error: <stdin>: CR line ends and no LF (a classic Mac OS file?), so it reads as one line; "
        "convert it, e.g. pipe it through tr '\\r' '\\n' before aiayn\n")


def test_one_pair_is_said_in_the_singular(checkpoint, tmp_path, capsys):
    """stderr said "1 pairs, 1 target tokens" of one pair whose target is empty (its EOS alone)."""
    (tmp_path / "src").write_text("the number 3\n")
    (tmp_path / "tgt").write_text("\n")
    assert main(["score", str(checkpoint), "--src", str(tmp_path / "src"), "--tgt", str(tmp_path / "tgt"),
                 "-q"]) == 0
    assert capsys.readouterr().err.startswith("1 pair, 1 target token (EOS included): log P per token -")


def test_a_hypothesis_cut_at_the_length_limit_scores_its_eos_too_as_the_docs_say(checkpoint, tmp_path,
                                                                                   capsys):
    """A hypothesis the search cut at the length limit has no EOS, and --n-best reports its log P so;
    score appends EOS to every target and adds its log P. The README's and --help's exceptions left it out."""
    src = tmp_path / "src"
    src.write_text("the number 3 is odd\n")
    argv = ["--beam", "2", "--n-best", "2", "--max-len-a", "0", "--max-len-b", "3"]
    assert main(["translate", str(checkpoint), "-i", str(src), "-q", *argv]) == 0
    rows = [line.split(" ||| ") for line in capsys.readouterr().out.splitlines()]
    (tmp_path / "tgt").write_text("".join(f"{text}\n" for _, text, _, _ in rows))
    src.write_text("the number 3 is odd\n" * len(rows))
    assert main(["score", str(checkpoint), "--src", str(src), "--tgt", str(tmp_path / "tgt"), "-q"]) == 0
    scores = [float(x) for x in capsys.readouterr().out.split()]
    translator = Translator.load(checkpoint)
    tok, model = translator.tokenizer, translator.model
    source = torch.tensor([tok.encode_src("the number 3 is odd")])
    checked = 0
    for (_, text, features, _), score in zip(rows, scores):
        pieces = tok.encode_tgt(text)
        if len(pieces) != 3 or tok.eos_id in pieces:  # not text that encodes back to the search's 3 pieces
            continue
        found = float(features.removeprefix("F0= "))
        assert found == pytest.approx(force_decode(model, source, [pieces])[0], abs=1e-4)  # no EOS in it
        assert score == pytest.approx(force_decode(model, source, [pieces + [tok.eos_id]])[0], abs=1e-4)
        assert score < found - 0.01  # log P(EOS) added
        checked += 1
    assert checked
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").split())
    exceptions = readme.split("scores what `--n-best` reported for it")[1].split("`--normalize`")[0]
    said = "when the search ended it with EOS: one cut at the"
    limits = "limit of `--max-len-a` and `--max-len-b`"
    assert f"{said} length {limits} has none, and `aiayn score` adds its log P" in exceptions
    with pytest.raises(SystemExit):
        main(["score", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # and the README's other exceptions, as it lists them
    assert f"{said} limit of --max-len-a and --max-len-b has none, and score adds its log P" in shown
    assert "when the source line has pieces" in shown and "source line has pieces" in exceptions


def test_a_translation_cut_at_the_models_positions_cannot_be_scored_as_the_docs_say(checkpoint, tmp_path,
                                                                                     capsys):
    """A hypothesis cut at the model's positions fills them all, so the EOS score appends has none: score
    refuses the line, where the README, --help and `Translator.score` said it added the EOS's log P as it
    does for a cut at --max-len-a and --max-len-b; the refusal says the EOS needs a position too."""
    translator = Translator.load(checkpoint)
    limit = translator.model.config.max_len  # 40
    sources = ["die Zahl 7", "the number 3 is odd", "the number 12"]
    found = translator.hypotheses(sources, beam=1, max_len_a=0.0, max_len_b=1000)
    filled = [s for s, [h] in zip(sources, found)
              if len(h.tokens) == limit and translator.tokenizer.encode_tgt(h.text) == h.tokens]
    assert filled  # a random model runs on: its greedy search is cut at the positions, no EOS
    src, tgt = tmp_path / "src", tmp_path / "tgt"
    src.write_text(f"{filled[0]}\n", encoding="utf-8")
    argv = ["--beam", "1", "--max-len-a", "0", "--max-len-b", "1000", "-q"]
    assert main(["translate", str(checkpoint), "-i", str(src), "-o", str(tgt), *argv]) == 0
    assert main(["score", str(checkpoint), "--src", str(src), "--tgt", str(tgt), "-q"]) == 2
    assert capsys.readouterr().err == (
        f"aiayn: error: {tgt}:1: {limit + 1} tokens (with the EOS scoring appends, which needs a position "
        f"too), more than the {limit} positions of this model\n")
    said = ("one cut at the model's positions, which it fills, cannot be scored, its EOS having no position "
            "left")
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").split())
    assert f"{said} (the line is refused)" in readme
    assert f"{said} (a `SentenceTooLong`)" in " ".join(Translator.score.__doc__.split())
    with pytest.raises(SystemExit):
        main(["score", "--help"])
    assert f"{said};" in " ".join(capsys.readouterr().out.split())


def test_the_exceptions_name_bfloat16_whose_rounding_depends_on_the_batch(capsys):
    """In bfloat16 a pair's score depends on the padding of the pairs batched with it, and score batches
    otherwise than the search: a demo model's beam-4 hypotheses scored up to 0.049 nats from their
    log_prob (4e-6 in float32), which the README's, --help's and `Translator.score`'s exceptions left out."""
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8").split())
    exceptions = readme.split("scores what `--n-best` reported for it")[1].split("`--normalize`")[0]
    said = "in float32: bfloat16 and float16 round a line by the padding of the lines batched with it"
    assert said in exceptions
    with pytest.raises(SystemExit):
        main(["score", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "in float32: --dtype bfloat16 and float16 round a line by the padding of the lines" in shown
    doc = " ".join(Translator.score.__doc__.split())
    assert "nor in bfloat16 or float16, which round a text by the padding of the texts batched with it" in doc

"""`aiayn.decoding.compiled`: the compiled one-row decoder step computes what full recomputation does, at
every step and for every source length and length limit after one warm-up, and runs only where it applies."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from aiayn.checkpoint import save_checkpoint
from aiayn.cli import main
from aiayn.data.tokenizer import Tokenizer, train_sentencepiece
from aiayn.decoding import DecodeConfig, generate
from aiayn.decoding.compiled import has_cxx_compiler
from aiayn.errors import UserError
from aiayn.translate import Translator, prepare_for_inference

needs_compiler = pytest.mark.skipif(not has_cxx_compiler(), reason="torch.compile needs a C++ compiler here")


@pytest.fixture(scope="module")
def models():
    """(model, packed, compiled): one tiny model, its packed copy, and a packed copy with a compiled step."""
    torch.manual_seed(0)
    model = tiny_model(vocab_size=40)
    return model, prepare_for_inference(model), prepare_for_inference(model, compile=True)


def source(length: int, vocab: int = 40) -> torch.Tensor:
    src = torch.randint(3, vocab, (1, length))
    src[0, -1] = tiny_model().config.eos_id
    return src  # (1, S)


def compiles() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@needs_compiler
def test_compiled_steps_equal_full_recomputation_at_every_step(models):
    model, _, compiled = models
    step = compiled.one_row_step
    before = compiles()
    with torch.inference_mode():
        for length, limit in [(2, 4), (5, 9), (9, 3), (13, 12)]:  # sizes other than the warm-up's
            src = source(length)
            memory, cache = compiled.encode(src), compiled.new_cache(1, limit)
            tokens = torch.full((1, 1), model.config.decoder_start_id)  # (1, 1)
            full_memory = model.encode(src)
            for t in range(limit):
                tgt_in = tokens[:, -1:]
                assert step.applies(tgt_in, None, cache) == (t > 0)
                decode = step if t > 0 else compiled.decode
                logits = decode(tgt_in, memory, None, cache)[:, -1]  # (1, V)
                full = model.decode(tokens, full_memory, None)[:, -1]  # the whole prefix again, unpacked
                torch.testing.assert_close(logits, full, atol=1e-5, rtol=1e-5)
                tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    assert compiles() == before  # the warm-up's graphs serve every source length and limit


@needs_compiler
def test_compiled_step_runs_only_for_one_row_and_searches_match_eager(models, monkeypatch):
    model, packed, compiled = models
    step = compiled.one_row_step
    calls = []
    original = step.run_only  # (model, tgt_in, memory, src_mask, cache) -> logits
    monkeypatch.setattr(step, "run_only", lambda *a: calls.append(a[1].shape) or original(*a))
    one, two = source(7), torch.cat([source(7), source(7)])
    for src, config, used in [
        (one, DecodeConfig(beam=1, max_len_b=8), True),  # greedy search of one sentence
        (one, DecodeConfig(beam=1, max_len_b=8, sample=True, seed=3, top_k=5), True),
        (one, DecodeConfig(beam=3, max_len_b=8), False),  # three rows a step
        (two, DecodeConfig(beam=1, max_len_b=8), None),  # two rows, then one if the other ends first
    ]:
        calls.clear()
        ours, eager = generate(compiled, src, config), generate(packed, src, config)
        assert [[h.tokens for h in hyps] for hyps in ours] == [[h.tokens for h in hyps] for hyps in eager]
        for mine, theirs in zip(ours, eager):
            assert [h.log_prob for h in mine] == pytest.approx([h.log_prob for h in theirs], abs=1e-4)
        assert all(shape == (1, 1) for shape in calls)
        if used is not None:
            assert bool(calls) == used
    assert type(model.generator) is torch.nn.Linear and model.one_row_step is None  # untouched


@needs_compiler
def test_nothing_compiles_after_loading(models):
    """Past attention's math-backend length (256), a padded source's last row, a thread count changed
    after loading: each decodes as the eager model does, and none compiles a graph."""
    _, packed, compiled = models
    threads = torch.get_num_threads()
    before = compiles()
    long = torch.cat([torch.randint(3, 40, (1, 299)), source(1)], dim=1)  # 300 tokens, EOS last
    cases = [(long, DecodeConfig(beam=1, max_len_a=0.0, max_len_b=300, min_len=300)),
             (torch.nn.utils.rnn.pad_sequence([source(9)[0], source(4)[0]], batch_first=True),
              DecodeConfig(beam=1, max_len_a=0.0, max_len_b=12, min_len=3))]
    try:
        for src, config in cases + [(source(6), DecodeConfig(beam=1, max_len_b=8))]:
            ours, eager = generate(compiled, src, config), generate(packed, src, config)
            assert [[h.tokens for h in hyps] for hyps in ours] == [[h.tokens for h in hyps] for hyps in eager]
            torch.set_num_threads(threads % 2 + 1)  # the last case at another count than the loading's
    finally:
        torch.set_num_threads(threads)
    assert len(cases[0][0][0]) == 300 and compiles() == before


def word_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint of a tiny untrained model with a 40-piece tokenizer of "word N and M" lines."""
    lines = [f"word {i} and {i + 1}" for i in range(200)]
    tokenizer = Tokenizer(train_sentencepiece(lines, tmp_path / "spm", vocab_size=40))
    return save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer)


def test_compile_is_refused_where_it_does_not_apply(tmp_path):
    model = tiny_model()
    int8 = r"^compile \(--compile\) decodes float32 weights, not int8 \(--int8\)"
    with pytest.raises(UserError, match=int8):
        prepare_for_inference(model, int8=True, compile=True)
    with pytest.raises(UserError, match=r"not dtype bfloat16 \(--dtype bfloat16\): drop one$"):
        prepare_for_inference(tiny_model().bfloat16(), compile=True)
    ck = word_checkpoint(tmp_path)
    with pytest.raises(UserError, match="decodes one model: drop it to decode an ensemble"):
        Translator.load([ck, ck], compile=True)
    for dtype in ("bfloat16", "float16"):  # float16's advice on a CPU, bfloat16, would be refused too
        refused = f"decodes float32 weights, not dtype {dtype} \\(--dtype {dtype}\\): drop one"
        with pytest.raises(UserError, match=refused):
            Translator.load(ck, dtype=dtype, compile=True)
    with pytest.raises(TypeError, match="compile must be True or False, not str"):
        Translator.load(ck, compile="yes")
    assert main(["translate", str(ck), "--compile", "--int8"]) == 2


def test_translate_compile_says_it_compiles_before_it_does(tmp_path, capsys, monkeypatch):
    """translate --compile was silent for its 10-40 s of compiling (26 s on a demo checkpoint): a note on
    stderr comes first, -q or not (-q drops the progress bar); a refused --compile is still one line."""
    import logging

    from aiayn.decoding import compiled

    said_by_then = []

    class Step:  # the compilation, stubbed: what was said when it would begin
        def __init__(self, model):
            pass

        def warm_up(self):
            said_by_then.append(capsys.readouterr().err)

        def applies(self, *args):
            return False

    monkeypatch.setattr(compiled, "OneRowStep", Step)
    monkeypatch.setattr(compiled, "has_cxx_compiler", lambda: True)
    ck = word_checkpoint(tmp_path)
    src = tmp_path / "in.txt"
    src.write_text("word 3\n", encoding="utf-8")
    note = ("aiayn: note: torch.compile: compiling the decoder step of one sentence before translating "
            "(10-40 s)\n")
    args = ["-i", str(src), "-q", "--compile", "--beam", "1", "--max-len-b", "3"]
    assert main(["translate", str(ck), *args]) == 0
    assert said_by_then == [note] and capsys.readouterr().err == ""
    assert logging.getLogger("aiayn.decoding.compiled").level == logging.NOTSET  # the CLI's level undone
    assert main(["translate", str(ck), "-i", str(src), "--compile", "--int8"]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and said_by_then == [note]


def test_translate_compile_finds_a_bad_input_line_before_compiling(tmp_path, capsys, monkeypatch):
    """Invalid UTF-8 in the input was refused after the 10-40 s of compiling (22 s on a demo checkpoint)."""
    from aiayn.decoding import compiled

    def never(model):
        raise AssertionError("compiled")

    monkeypatch.setattr(compiled, "OneRowStep", never)
    monkeypatch.setattr(compiled, "has_cxx_compiler", lambda: True)
    ck = word_checkpoint(tmp_path)
    src = tmp_path / "in.txt"
    src.write_bytes(b"word 3\nbad \xff line\n")
    assert main(["translate", str(ck), "-i", str(src), "-q", "--compile", "--beam", "1"]) == 2
    assert capsys.readouterr().err == f"aiayn: error: {src}:2: invalid UTF-8 (byte 0xff)\n"


def test_torch_compile_refusing_is_one_line(monkeypatch):
    """torch.compile itself raising (it refuses Python versions newer than it knows) is one line too."""
    def refuse(*args, **kwargs):
        raise RuntimeError("torch.compile is not supported on Python 3.15+\nsee the release notes")

    monkeypatch.setattr(torch, "compile", refuse)
    refusal = (r"^compile \(--compile\): torch.compile failed here: torch.compile is not supported on "
               r"Python 3.15\+$")
    with pytest.raises(UserError, match=refusal):
        prepare_for_inference(tiny_model(), compile=True)


@pytest.mark.slow
@needs_compiler
def test_translate_compile_gives_the_same_lines(tmp_path, capsys):
    lines = [f"the number {i} is {'even' if i % 2 == 0 else 'odd'}" for i in range(200)]
    tokenizer = Tokenizer(train_sentencepiece(lines, tmp_path / "spm", vocab_size=40))
    ck = save_checkpoint(tmp_path / "ck", tiny_model(vocab_size=tokenizer.src_vocab_size), tokenizer)
    src = tmp_path / "in.txt"
    src.write_text("the number 3 is odd\n\nthe number 12 is even\n")
    outs = []
    for extra in ([], ["--compile"]):
        out = tmp_path / f"out{len(extra)}.txt"
        args = ["-i", str(src), "-o", str(out), "-q", "--chunk", "1", "--beam", "1", *extra]
        assert main(["translate", str(ck), *args]) == 0
        outs.append(out.read_text())
    assert outs[0] == outs[1] and outs[0].count("\n") == 3


@pytest.mark.slow
@needs_compiler
def test_each_model_compiles_its_own_step_past_dynamos_limit_of_8():
    """Dynamo keeps up to 8 graphs per code object; each step has a code object of its own, so a fifth
    model (two graphs each) still gets compiled graphs instead of decoding eagerly."""
    for width in (8, 16, 24, 32, 40):
        before = compiles()
        model = tiny_model(d_model=width, n_heads=2)
        compiled, eager = prepare_for_inference(model, compile=True), prepare_for_inference(model)
        assert compiles() > before, width
        src, config = source(5), DecodeConfig(beam=1, max_len_b=6)
        assert [h.tokens for h in generate(compiled, src, config)[0]] == [
            h.tokens for h in generate(eager, src, config)[0]]


def test_no_cxx_compiler_is_said_before_compiling(monkeypatch):
    """Without g++ on PATH, translate --compile said "torch.compile failed here: backend='inductor'
    raised:" and no reason (it is on the next line of inductor's message): said first, as training does."""
    from aiayn.decoding import compiled

    monkeypatch.setattr(compiled, "has_cxx_compiler", lambda: False)
    # the setting as Python and the command line name it ("or leave out --compile" was the CLI's alone)
    no_compiler = (r"^compile \(--compile\) needs the C\+\+ compiler torch.compile's CPU code is built with, "
                   r".* or decode without compiling$")
    with pytest.raises(UserError, match=no_compiler):
        prepare_for_inference(tiny_model(), compile=True)
    with pytest.raises(UserError, match=no_compiler):  # before the checkpoint is read (it is not there)
        Translator.load("no-such-checkpoint", compile=True)
    monkeypatch.undo()

    def inductor_fails(*args, **kwargs):
        raise RuntimeError("backend='inductor' raised:\nCalledProcessError: g++ returned 1\n\nSet TORCH_LOGS")

    monkeypatch.setattr(torch, "compile", inductor_fails)
    with pytest.raises(UserError, match=r"^compile \(--compile\): torch.compile failed here: "
                                        r"backend='inductor' raised: CalledProcessError: g\+\+ returned 1$"):
        prepare_for_inference(tiny_model(), compile=True)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the compiler's path is set the Linux way")
def test_a_failed_compilation_is_one_line():
    import torch._inductor.config as inductor

    # Inductor's own patch: monkeypatch's undo deleted the config entries, which later compiles then missed.
    # No FX graph cache: compile, rather than reuse an earlier test's code.
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}):
        with pytest.raises(UserError, match=r"^compile \(--compile\): torch.compile failed here: .+") as e:
            prepare_for_inference(tiny_model(d_model=48, n_heads=4), compile=True)
    assert "\n" not in str(e.value) and "C++ compiler" in str(e.value)
    assert inductor.fx_graph_cache is not False and inductor.cpp.cxx != ("/nonexistent/c++",)


def test_the_compiler_checked_is_the_one_inductor_runs(monkeypatch):
    """Any of g++, c++ or clang++ on PATH passed the check; inductor runs $CXX or g++ alone, and failed at
    the first compiled call with "No working C++ compiler found"."""
    from aiayn.decoding import compiled

    on_path = {"c++", "clang++"}
    monkeypatch.setattr(compiled.shutil, "which",
                        lambda name: f"/usr/bin/{name}" if name in on_path else None)
    monkeypatch.setattr(compiled.sys, "platform", "linux")
    monkeypatch.delenv("CXX", raising=False)
    assert not compiled.has_cxx_compiler() and "g++" in compiled.missing_compiler("--compile")
    monkeypatch.setenv("CXX", "clang++")
    assert compiled.has_cxx_compiler()
    monkeypatch.setenv("CXX", "icpx")
    assert not compiled.has_cxx_compiler() and "icpx" in compiled.missing_compiler("--compile")


def test_translate_compile_is_refused_with_beam_search(tmp_path, capsys, monkeypatch):
    """--compile at beam 4 (translate's default) spent its 10-40 s compiling a step that beam search never
    takes: refused before the checkpoint loads, naming the beam and how it was set."""
    from aiayn.decoding import compiled

    monkeypatch.setattr(compiled, "has_cxx_compiler", lambda: True)
    missing = str(tmp_path / "no-checkpoint")  # refused before it is looked for
    assert main(["translate", missing, "--compile"]) == 2
    assert capsys.readouterr().err == (
        "aiayn: error: --compile compiles the step of greedy search and sampling; beam search (beam 4, the "
        "default) decodes as without it: add --beam 1 or --sample, or drop --compile\n")
    assert main(["translate", missing, "--compile", "--beam", "5"]) == 2
    assert "beam search (--beam 5) decodes as without it" in capsys.readouterr().err
    for ok in (["--beam", "1"], ["--sample"]):  # these go on to load the checkpoint, which is not there
        assert main(["translate", missing, "--compile", *ok]) == 2
        assert "no-checkpoint" in capsys.readouterr().err

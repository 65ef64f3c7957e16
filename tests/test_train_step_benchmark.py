"""The training-step benchmark's arithmetic, checked against PyTorch's own FLOP counter.

A slow test also runs the whole benchmark on a tiny shape (every system, both precisions, compiled).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from aiayn.config import model_config
from aiayn.errors import UserError
from aiayn.model import Transformer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import train_step  # noqa: E402


@pytest.mark.parametrize("s, t", [(6, 5), (3, 9)])
def test_model_flops_equals_torch_flop_counter(s, t):
    """`model_flops` is what torch counts in every matmul of forward + backward (attention included,
    through SDPA's math path, whose two matmuls the counter sees)."""
    torch.manual_seed(0)
    c = model_config("tiny", vocab_size=500, dropout=0.0, n_decoder_layers=3)
    model = Transformer(c)
    src, tgt_in, tgt_out = (torch.randint(3, 500, (4, n)) for n in (s, t, t))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        train_step.label_smoothed_loss(model(src, tgt_in), tgt_out).backward()
    assert train_step.model_flops(c, 4, s, t) == counter.get_total_flops()


def test_the_floor_makes_the_linear_products_that_torch_counts():
    """The floor's products are those of the model's Linear layers: each (rows, in, out) forward,
    input gradient and weight gradient, 6 x rows x in x out FLOPs, equal the mm/addmm FLOPs that
    torch counts in forward + backward (attention's products are bmm, outside the floor)."""
    torch.manual_seed(0)
    c = model_config("tiny", vocab_size=500, dropout=0.0, n_decoder_layers=3)
    s, t = 6, 5
    src, tgt_in, tgt_out = (torch.randint(3, 500, (4, n)) for n in (s, t, t))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        train_step.label_smoothed_loss(Transformer(c)(src, tgt_in), tgt_out).backward()
    counted = counter.get_flop_counts()["Global"]
    linear = sum(n for op, n in counted.items() if op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    assert 6 * sum(n * i * o for n, i, o in train_step.linear_shapes(c, 4, s, t)) == linear
    with FlopCounterMode(display=False) as floor:  # what the benchmark times as the floor, in its rounds
        train_step.linear_products(c, 4, s, t, torch.float32)()
    assert floor.get_flop_counts()["Global"] == {torch.ops.aten.mm: linear}


def test_peers_have_the_same_shapes():
    """nn.Transformer and Marian get our matmul weights: the same count of parameters in Linear layers
    (biases and the tied embedding aside, where their layouts differ); and the same count of trainable
    parameters in all, so that every system has one embedding, shared by both sides and tied to the output
    (the Linear count alone passed a Marian with untied, unshared embeddings: 1,117,696 against 989,696).
    Marian's one extra: its sinusoidal position tables, kept as frozen parameters."""
    c = model_config("tiny", vocab_size=500)
    systems = {name: train_step.build(name, c) for name in ("aiayn", "nn.Transformer", "Marian")}

    def linear_weights(m):
        return sum(x.weight.numel() for x in m.modules() if isinstance(x, torch.nn.Linear)
                   and x.weight.shape[0] != c.vocab_size)  # the tied output projection aside

    def mha_weights(m):  # nn.MultiheadAttention keeps Q, K, V in one in_proj_weight
        return sum(x.in_proj_weight.numel() for x in m.modules()
                   if isinstance(x, torch.nn.MultiheadAttention))

    ours = linear_weights(systems["aiayn"])
    assert linear_weights(systems["nn.Transformer"]) + mha_weights(systems["nn.Transformer"]) == ours
    assert linear_weights(systems["Marian"]) == ours
    trainable = {name: sum(p.numel() for p in m.parameters() if p.requires_grad)
                 for name, m in systems.items()}
    assert trainable == dict.fromkeys(systems, sum(p.numel() for p in systems["aiayn"].parameters()))
    frozen = {name: [n for n, p in m.named_parameters() if not p.requires_grad]
              for name, m in systems.items()}
    assert frozen == {"aiayn": [], "nn.Transformer": [], "Marian": [
        "model.model.encoder.embed_positions.weight", "model.model.decoder.embed_positions.weight"]}


def test_peers_drop_out_where_the_paper_does():
    """nn.Transformer(dropout=0.1) also dropped attention weights, which took its attention off SDPA's
    fused kernel, and the FFN's inner activation, and kept a final encoder LayerNorm: aiayn and Marian
    have none of them, so every figure against it measured another model."""
    c = model_config("tiny", vocab_size=500)
    peer = train_step.build("nn.Transformer", c)
    assert all(m.dropout == 0.0 for m in peer.modules() if isinstance(m, torch.nn.MultiheadAttention))
    # each sub-layer's output (2 per encoder layer, 3 per decoder layer), and one module for both embeddings
    dropouts = [m for m in peer.modules() if isinstance(m, torch.nn.Dropout) and m.p == c.dropout > 0]
    assert len(dropouts) == 2 * c.n_layers + 3 * c.decoder_layers + 1
    assert not [m for m in peer.modules() if isinstance(m, torch.nn.Dropout) and m not in dropouts]

    def layer_norms(m):
        return sum(isinstance(x, torch.nn.LayerNorm) for x in m.modules())

    assert layer_norms(peer) == layer_norms(Transformer(c)) == layer_norms(train_step.build("Marian", c))


@pytest.mark.slow
def test_benchmark_runs_end_to_end(tmp_path):
    out = tmp_path / "train_step.md"
    train_step.main(["--configs", "tiny", "--steps", "1", "--warmup", "1", "--loss-steps", "3",
                     "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert {(r["system"], r["precision"]) for r in rows} == {
        (s, p) for s in ("aiayn", "nn.Transformer", "Marian", "aiayn (compiled)") for p in ("fp32", "bf16")}
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_the_loss_curve_says_how_far_it_has_got(tmp_path, monkeypatch, capsys):
    """The timed rounds print one line each; the loss curve's 2 x 150 steps ran ~100 s on a CPU after the
    matmul-peak line without a word. Now a line every tenth of its steps (here each of 3), and the last."""
    monkeypatch.setattr(train_step, "matmul_peak", lambda dtype, device: 1e12)  # not what this test is about
    train_step.main(["--configs", "", "--loss-steps", "3", "--out", str(tmp_path / "loss.md")])
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[loss curve]")]
    assert [line.split(":")[0] for line in said] == [
        f"[loss curve] {precision} step {i}/3" for precision in ("fp32", "bf16") for i in (1, 2, 3)]
    saved = json.loads((tmp_path / "loss.json").read_text())["loss_curve"]
    assert [float(line.split(": loss ")[1]) for line in said] == [
        round(x, 4) for x in saved["fp32"] + saved["bf16"]]


def test_the_loss_curve_is_drawn_beside_the_report(tmp_path, monkeypatch):
    """The bf16 loss curve was an 11-row table alone; now a PNG of both curves, every step, beside the .md,
    named in it; and a committed one is not written over without --force."""
    import matplotlib.image

    curve = {"steps": 4, "fp32": [3.0, 2.5, 2.0, 1.5], "bf16": [3.0, 2.6, 2.0, 1.6], "max_abs_diff": 0.1,
             "max_rel_diff": 0.0625, "final_fp32": 1.5, "final_bf16": 1.6}
    monkeypatch.setattr(train_step, "loss_curve", lambda steps, device: curve)
    out = tmp_path / "loss.md"
    train_step.main(["--configs", "", "--loss-steps", "4", "--out", str(out)])
    image = matplotlib.image.imread(tmp_path / "loss.png")
    assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # a drawing, not a blank
    assert "The curves, every step: loss.png" in out.read_text()
    monkeypatch.setattr(train_step, "check_out", lambda path, files, force: checked.extend(files))
    checked = []
    train_step.main(["--configs", "", "--loss-steps", "4", "--out", str(out)])
    assert tmp_path / "loss.png" in checked


def test_the_loss_curve_alone_measures_and_reports_no_timing(tmp_path, monkeypatch, capsys):
    """--configs '': the report read "shapes: . tokens/s counts source + target tokens", explained the
    columns of a table that was not there and quoted a matmul peak that was measured (and printed) for
    nothing."""
    monkeypatch.setattr(train_step, "matmul_peak", lambda dtype, device: pytest.fail("a peak for nothing"))
    curve = {"steps": 2, "fp32": [2.0, 1.0], "bf16": [2.0, 1.1], "max_abs_diff": 0.1, "max_rel_diff": 0.1,
             "final_fp32": 1.0, "final_bf16": 1.1}
    monkeypatch.setattr(train_step, "loss_curve", lambda steps, device: curve)
    out = tmp_path / "loss.md"
    train_step.main(["--configs", "", "--loss-steps", "2", "--out", str(out)])
    text = out.read_text()
    assert "No step timed in this run (`--configs ''`): the bf16 loss curve alone." in text
    for timing in ("shapes:", "tokens/s", "MFU", "matmul peak", "no timing"):
        assert timing not in text
    assert "## bf16 loss curve vs fp32 (aiayn small, 2 steps" in text
    assert "matmul peak" not in capsys.readouterr().out
    assert json.loads(out.with_suffix(".json").read_text())["peaks"] == {}


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--warmup", "0"], ["--loss-steps", "-1"],
                                 ["--precisions", "fp16"], ["--configs", "tny"], ["--precisions", ""],
                                 ["--threads", "3000000000"],  # torch's OverflowError traceback
                                 ["--quick", "--steps", "9"]])  # --quick replaced it silently
def test_bad_arguments_are_usage_errors(bad, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        train_step.main([*bad, "--out", str(tmp_path / "train_step.md")])
    assert stopped.value.code == 2
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv, message", [
    (["--quick", "--loss-steps", "100"], "give --loss-steps, or --quick, not both"),  # cut to 40 silently
    (["--quick", "--loss-steps", "150"], "give --loss-steps, or --quick, not both"),  # given, if the default
    (["--quick", "--configs", "small,base", "--warmup", "2"], "give --configs and --warmup, or --quick"),
    (["--no-compile", "--compile-peers"], "which --no-compile leaves out"),  # --compile-peers was ignored
    (["--configs", "", "--loss-steps", "0"], "nothing to measure"),  # the peaks, an empty report, exit 0
    # the timing's options were ignored without a word beside the loss curve alone
    (["--configs", "", "--precisions", "bf16"], ("--configs '' times no step (the loss curve alone): "
                                                 "--precisions would be ignored; give a configuration, or "
                                                 "leave it out")),
    (["--configs", "", "--steps", "5", "--warmup", "2", "--no-compile", "--compile-peers"],
     "--steps and --warmup and --no-compile and --compile-peers would be ignored"),
])
def test_options_it_would_ignore_or_that_leave_nothing_to_measure_are_refused(argv, message, tmp_path,
                                                                               monkeypatch, capsys):
    monkeypatch.setattr(train_step, "matmul_peak", lambda dtype, device: pytest.fail("measuring began"))
    with pytest.raises(SystemExit) as stopped:
        train_step.main([*argv, "--out", str(tmp_path / "train_step.md")])
    assert stopped.value.code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_quick_or_the_defaults_fill_the_options_not_given():
    def settled(**given):
        args = train_step.argparse.Namespace(**{"configs": None, "steps": None, "warmup": None,
                                                "loss_steps": None, "no_compile": False,
                                                "compile_peers": False, "quick": False, "precisions": None,
                                                **given})
        train_step.settle(train_step.argparse.ArgumentParser(), args)
        assert args.precisions == given.get("precisions", ["fp32", "bf16"])
        return args.configs, args.steps, args.warmup, args.loss_steps

    assert settled() == (["small", "base"], 5, 2, 150)
    assert settled(precisions=["bf16"]) == (["small", "base"], 5, 2, 150)
    assert settled(quick=True) == (["small"], 3, 1, 40)
    assert settled(quick=True, loss_steps=0) == (["small"], 3, 1, 0)  # the quick timing without the curve
    assert settled(steps=7, loss_steps=0) == (["small", "base"], 7, 2, 0)


def test_without_transformers_marian_is_skipped_and_results_go_to_the_local_folder(
        tmp_path, monkeypatch, capsys):
    """No transformers: one line says Marian is skipped, the other systems are timed and compared; no
    --out: the report lands in LOCAL_RESULTS (here a temporary one), not over benchmarks/results/."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when absent
    monkeypatch.setattr(train_step, "LOCAL_RESULTS", tmp_path / "local")
    monkeypatch.setattr(train_step, "matmul_peak", lambda dtype, device: 1e12)  # not what this test is about
    threads = torch.get_num_threads()
    try:
        train_step.main(["--configs", "tiny", "--precisions", "fp32", "--steps", "1", "--warmup", "1",
                         "--loss-steps", "0", "--no-compile", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    err = [line for line in capsys.readouterr().err.splitlines() if "transformers" in line]
    assert len(err) == 1 and "Marian" in err[0] and "pip install -e '.[bench]'" in err[0]
    rows = json.loads((tmp_path / "local" / "train_step.json").read_text())["rows"]
    assert [r["system"] for r in rows] == ["aiayn", "nn.Transformer"]
    assert all(r["fastest_peer"] == "nn.Transformer" for r in rows)


def _broken_compiler(setting):
    raise UserError(f"{setting}: torch.compile failed here: C++ compile error (fatal error: Python.h)")


@pytest.mark.parametrize("compiler", ["missing", "broken"])
def test_without_a_compiler_that_works_the_compiled_rows_are_skipped_in_one_line(
        tmp_path, monkeypatch, capsys, compiler):
    """No C++ compiler (or one that cannot build inductor's code, as without Python's headers): the first
    compiled step was an 84-line InductorError traceback, and the eager rows already timed were lost."""
    if compiler == "missing":
        monkeypatch.setenv("CXX", str(tmp_path / "nowhere" / "g++"))
    else:
        monkeypatch.setattr(train_step, "check_compile_works", _broken_compiler)
    monkeypatch.setitem(sys.modules, "transformers", None)  # Marian aside: not what this test is about
    monkeypatch.setattr(train_step, "matmul_peak", lambda dtype, device: 1e12)
    out = tmp_path / "train_step.md"
    threads = torch.get_num_threads()
    try:
        train_step.main(["--configs", "tiny", "--precisions", "fp32", "--steps", "1", "--warmup", "1",
                         "--loss-steps", "0", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["system"] for r in rows] == ["aiayn", "nn.Transformer"]
    skipped = [line for line in capsys.readouterr().err.splitlines() if "compiled" in line]
    why = "needs the C++ compiler" if compiler == "missing" else "torch.compile failed here: C++ compile error"
    assert len(skipped) == 1 and skipped[0].startswith("skipping the compiled rows: torch.compile on a CPU")
    assert why in skipped[0]
    # and in the results, whose command line (no --no-compile) does not say it
    assert why in json.loads(out.with_suffix(".json").read_text())["compiled_rows_skipped"]
    assert "No compiled rows: torch.compile could not build here" in out.read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_cuda_without_a_device_is_refused_before_any_work(tmp_path):
    out = tmp_path / "train_step.md"
    with pytest.raises(SystemExit, match="no such CUDA device"):
        train_step.main(["--device", "cuda", "--configs", "tiny", "--out", str(out)])
    assert not out.exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_benchmark_runs_on_a_gpu(tmp_path):
    """Every system's step, the peak and the floor on the GPU, both precisions."""
    out = tmp_path / "train_step.md"
    train_step.main(["--device", "cuda", "--configs", "tiny", "--steps", "1", "--warmup", "1",
                     "--loss-steps", "3", "--no-compile", "--out", str(out)])
    saved = json.loads(out.with_suffix(".json").read_text())
    assert {(r["system"], r["precision"]) for r in saved["rows"]} == {
        (s, p) for s in ("aiayn", "nn.Transformer", "Marian") for p in ("fp32", "bf16")}
    assert saved["environment"]["gpu"] and saved["loss_curve"]["steps"] == 3


@pytest.mark.parametrize("out, message", [
    ("r.json", "ending in .md"),  # the markdown was written there, then replaced by the json
    ("FILE/x.md", "is not a directory"),  # a traceback, after all the timing for a directory in the way
])
def test_an_output_it_cannot_write_is_refused_before_timing(tmp_path, capsys, out, message):
    (tmp_path / "FILE").write_text("mine")
    with pytest.raises(SystemExit) as stopped:
        train_step.main(["--configs", "tiny", "--out", str(tmp_path / out)])
    assert message in capsys.readouterr().err + str(stopped.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="a folder no one may write in: Linux's /proc")
def test_a_folder_root_cannot_write_in_is_refused_before_timing(capsys):
    """os.access says yes to root everywhere: /proc, /sys or a read-only mount was a PermissionError
    traceback after all the timing (benchmarks run as root on the lent GPU machines)."""
    with pytest.raises(SystemExit) as stopped:
        train_step.main(["--configs", "tiny", "--out", "/proc/aiayn_benchmark.md"])
    assert "--out /proc/aiayn_benchmark.md: /proc is not writable (" in str(stopped.value)


def test_a_floor_above_a_measured_step_is_said_to_bound_nothing():
    """The floor is timed once after the rounds: with the machine's load changed it read 2,357 ms against
    a 638 ms step, printed as "no step can be more than 0.30x" and "-1,719 ms outside them"."""
    assert "NOT a bound in this run" in train_step._floor_caveat(
        {"linear_floor_ms": 2357.0, "step_ms": 638.0, "peer_over_floor": 0.30})
    quiet = {"linear_floor_ms": 300.0, "step_ms": 400.0, "peer_over_floor": 1.5}
    assert train_step._floor_caveat(quiet) == ""


def test_an_mfu_over_100_percent_is_said_to_mean_nothing(tmp_path):
    """MFU divides by a matmul peak measured once, before the rounds: train_step_base_v2 printed aiayn fp32
    at 121.8% and Marian at 122.1% with no word, where the Linear floor has `_floor_caveat`."""
    def run(system, precision, seconds):
        return train_step.Run(system, precision, False, step=None, first_s=seconds, times=[seconds])

    info = {"config": "tiny", "tokens": 1000, "flops": 1e9, "linear_floor_s": {"fp32": 0.5, "bf16": 0.5}}
    peaks = {"fp32": 1e9, "bf16": 1e10}  # fp32 steps of 0.8 s: 125%; bf16 steps of 1 s: 10%
    rows = train_step.summarise([run("aiayn", "fp32", 0.8), run("Marian", "fp32", 0.8),
                                 run("aiayn", "bf16", 1.0), run("Marian", "bf16", 1.0)], info, peaks)
    args = train_step.argparse.Namespace(argv=[], configs=["tiny"], device="cpu")
    out = tmp_path / "r.md"
    train_step.write_report(rows, peaks, None, {}, args, str(out))
    cells = [line.split(" | ")[7] for line in out.read_text().splitlines() if line.startswith("| tiny |")]
    assert cells == ["125.0% (NOT meaningful: over 100%)"] * 2 + ["10.0%"] * 2
    assert ("MFU over 100% is NOT meaningful in this run: the matmul peak, measured once before the rounds, "
            "read lower than the step's own matmuls ran") in out.read_text()
    train_step.write_report(rows[2:], peaks, None, {}, args, str(out))  # bf16 alone: nothing to say
    assert "NOT meaningful" not in out.read_text()


def test_the_title_names_the_peers_timed(tmp_path):
    """The report's title said "vs MarianMT" when Marian was skipped (transformers missing)."""
    def run(system, compiled=False):
        return train_step.Run(system, "fp32", compiled, step=None, first_s=1.0, times=[1.0])

    info = {"config": "tiny", "tokens": 1000, "flops": 1e9, "linear_floor_s": {"fp32": 0.5}}
    peaks = {"fp32": 1e10, "bf16": 1e10}
    args = train_step.argparse.Namespace(argv=[], configs=["tiny"], device="cpu")
    out = tmp_path / "r.md"
    for systems, title in ((["aiayn", "nn.Transformer"], "aiayn vs torch.nn.Transformer"),
                           (["aiayn", "nn.Transformer", "Marian"],
                            "aiayn vs torch.nn.Transformer vs MarianMT")):
        rows = train_step.summarise([*map(run, systems), run("aiayn", compiled=True)], info, peaks)
        train_step.write_report(rows, peaks, None, {}, args, str(out))
        assert out.read_text().splitlines()[0] == f"# Training step: {title}"
    train_step.write_report([], {}, None, {}, args, str(out))  # --configs '': the loss curve of aiayn alone
    assert out.read_text().splitlines()[0] == "# Training step: aiayn"


def test_thread_counts_and_repeated_choices():
    from common import comma_choices, thread_counts

    assert thread_counts("2,1,2") == [1, 2]
    for bad in ("0", "1025", "two", "1,"):
        with pytest.raises(train_step.argparse.ArgumentTypeError):
            thread_counts(bad)
    assert comma_choices(["tiny", "small"])("tiny,tiny,small") == ["tiny", "small"]  # was timed twice


def test_the_json_keeps_what_recomputes_each_rows_mfu(tmp_path, monkeypatch):
    """time_config computed the parameter count and a step's FLOPs, but the json kept neither, nor the
    shape: a row's MFU could not be recomputed from the file."""
    monkeypatch.setattr(train_step, "matmul_peak", lambda dtype, device: 1e12)  # not what this test is about
    out = tmp_path / "train_step.md"
    threads = torch.get_num_threads()
    try:
        train_step.main(["--configs", "tiny", "--precisions", "fp32", "--steps", "1", "--warmup", "1",
                         "--loss-steps", "0", "--no-compile", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    saved = json.loads(out.with_suffix(".json").read_text())
    shape = train_step.SHAPES["tiny"]
    c = model_config(shape["preset"], vocab_size=shape["vocab"])
    tiny = saved["configs"]["tiny"]
    assert {k: tiny[k] for k in shape} == shape
    assert tiny["parameters"] == sum(p.numel() for p in Transformer(c).parameters())
    dims = shape["batch"], shape["src_len"], shape["tgt_len"]
    assert tiny["flops_per_step"] == train_step.model_flops(c, *dims)
    assert tiny["tokens"] == shape["batch"] * (shape["src_len"] + shape["tgt_len"])
    for row in saved["rows"]:
        recomputed = tiny["flops_per_step"] / (row["step_ms"] / 1000) / saved["peaks"][row["precision"]]
        assert recomputed == pytest.approx(row["mfu"])

"""The layer-time and attention-memory benchmarks: what they time is the paper's formula, their
crossover and slope arithmetic give known answers, and a tiny run of each writes sane results."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from reference import naive_attention

from aiayn.model import MultiHeadAttention
from aiayn.model.attention import merge_heads, split_heads

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    """Import benchmarks/NAME.py (benchmarks/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


layers = _load("layers")
attention_memory = _load("attention_memory")


@pytest.mark.parametrize("d", [16, 128])
def test_benchmarked_attention_layer_is_equation_1(d):
    """The model's MultiHeadAttention, as benchmarked, = W^O(Concat(softmax(QK^T/sqrt(d_k))V)) in float64."""
    h = layers.n_heads(d, 64)
    mha = MultiHeadAttention(d, h, self_attention=True).double()
    x = torch.randn(2, 24, d, dtype=torch.float64)
    q, k, v = (split_heads(t, h) for t in mha.qkv_proj(x).chunk(3, dim=-1))  # 3 x (B, H, n, D)
    expected = mha.out_proj(merge_heads(naive_attention(q, k, v)))
    torch.testing.assert_close(mha(x), expected)


@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
@pytest.mark.parametrize("mode", ["forward", "train"])
def test_memory_benchmark_computes_equation_1(impl, mode):
    """Both sides of the memory benchmark, and their gradients, equal the float64 oracle."""
    q, k, v = (torch.randn(1, 8, 64, 64, requires_grad=True) for _ in range(3))  # (B, H, n, D)
    out = attention_memory.ATTENTION[impl](q, k, v)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = naive_attention(*ref_inputs)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)
    if mode == "train":
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(grad.double())
        for ours, theirs in zip((q, k, v), ref_inputs):
            torch.testing.assert_close(ours.grad.double(), theirs.grad, atol=1e-5, rtol=1e-4)


def test_every_benchmarked_layer_maps_the_input_shape():
    cfg = layers.GridConfig(batch=2)
    expected = {"attention": (2, 8, 32), "sdpa": (2, 1, 8, 32), "lstm": (2, 8, 32), "conv": (2, 32, 8)}
    for name in layers.LAYERS:
        assert layers.build_layer(name, 8, 32, cfg, torch.device("cpu"))().shape == expected[name]


def test_crossover_known_answers():
    lengths = [16, 32, 64, 128, 256, 512]
    quadratic = [n * n for n in lengths]
    linear = [100.0 * n for n in lengths]  # equal to n^2 at n = 100
    assert layers.crossover(lengths, quadratic, linear) == pytest.approx(100.0)
    assert layers.crossover(lengths, linear, quadratic) is None  # never slower
    assert layers.crossover(lengths, [10.0 * t for t in linear], linear) == 0.0  # always slower
    noisy = [1.2, 0.9, 0.8, 0.5, 2.0, 4.0]  # slower at n=16 by noise; the crossing that stays is 128..256
    n_star = layers.crossover(lengths, noisy, [1.0] * 6)
    assert 128 < n_star < 256


def test_growth_exponent_and_flop_parity_known_answers():
    lengths = [256, 512, 1024]
    assert layers.growth_exponent(lengths, [n**2 * 1e-9 for n in lengths]) == pytest.approx(2.0)
    assert layers.growth_exponent(lengths, [n * 1e-6 for n in lengths]) == pytest.approx(1.0)
    d = 512
    assert layers.flop_parity("attention", "lstm", d, 3) == 2 * d  # 4d^2 + 2nd = 8d^2
    assert layers.flop_parity("sdpa", "lstm", d, 3) == 4 * d  # 2nd = 8d^2
    assert layers.flop_parity("sdpa", "conv", d, 3) == 1.5 * d  # 2nd = 3d^2
    assert layers.flop_parity("attention", "conv", d, 3) == 0.0  # 4d^2 + 2nd > 3d^2 for every n


def test_layers_tiny_grid_writes_results(tmp_path):
    result = layers.main(
        ["--lengths", "8", "16", "--widths", "16", "64", "--batch", "1", "--out", str(tmp_path)]
    )
    for suffix in ("json", "md", "png"):
        assert (tmp_path / f"layers_cpu.{suffix}").stat().st_size > 0
    saved = json.loads((tmp_path / "layers_cpu.json").read_text())
    assert saved["environment"]["torch"] == torch.__version__
    assert set(saved["times"]) == {"16", "64"}
    for cells in result["times"].values():
        assert set(cells) == {8, 16}
        for cell in cells.values():
            assert all(
                math.isfinite(cell[x][m]) and cell[x][m] > 0 for x in layers.LAYERS for m in layers.MODES
            )
    assert set(result["crossovers"][16]) == {
        "attention_vs_lstm",
        "attention_vs_conv",
        "sdpa_vs_lstm",
        "sdpa_vs_conv",
    }
    markdown = (tmp_path / "layers_cpu.md").read_text()
    assert "## Crossover" in markdown
    layers.main(["--replot", str(tmp_path / "layers_cpu.json")])  # redraws from the json alone
    assert (tmp_path / "layers_cpu.md").read_text() == markdown


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < (2, 11), reason=(
    "torch's CPU flash backward holds more than one n x n matrix before 2.11 (2.5: about 10.0 MB "
    "against its 8,388,608 bytes at n = 512); seen below it on 2.11 and 2.13, 2.6 to 2.10 untried"))
def test_attention_memory_sees_the_n_by_n_matrix_and_flash_does_not_build_it():
    """Two fresh-process measurements at n = 1,024: explicit attention's peak holds at least its float32
    (B, H, n, n) scores; SDPA's flash kernel, even with its backward, stays below one such matrix. Not at
    n = 512: torch 2.13's CUDA build, run on a CPU, peaks there at 9.8 MB, above the 8.4 MB square (its
    CPU build: 6.5 MB), though linear in n like the CPU build's (14.2 and 13.1 MB at n = 1,024)."""
    n = 1024
    cfg = attention_memory.MemoryConfig()
    square = cfg.batch * cfg.heads * n * n * 4
    explicit = attention_memory.measure_in_subprocess("explicit", n, "forward", cfg)
    sdpa = attention_memory.measure_in_subprocess("sdpa", n, "train", cfg)
    assert explicit["peak_bytes"] >= square
    assert 0 < sdpa["peak_bytes"] < square


@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_predicted_peak_follows_the_last_slope(impl):
    points = [
        {"n": 256, "peak_bytes": 100, "measured": True},
        {"n": 512, "peak_bytes": 400, "measured": True},
    ]
    assert attention_memory.predicted_peak(impl, points, 1024) == pytest.approx(1600)  # slope 2
    linear = [
        {"n": 256, "peak_bytes": 100, "measured": True},
        {"n": 512, "peak_bytes": 200, "measured": True},
    ]
    assert attention_memory.predicted_peak(impl, linear, 1024) == pytest.approx(400)
    assert attention_memory.predicted_peak(impl, [], 1024) is None


def test_one_point_is_extrapolated_along_the_slope_of_its_formulas_memory():
    """One point measured, SDPA was extrapolated as n^2 too: `--lengths 256 30000 --budget-gib 0.5` left
    out its n = 30,000 as "predicted 15289 MiB > budget", where it measures 61 MiB."""
    point = [{"n": 256, "peak_bytes": 2**19, "measured": True}]  # SDPA forward's 0.5 MiB here
    assert attention_memory.predicted_peak("sdpa", point, 30000) == pytest.approx(2**19 * 30000 / 256)
    assert attention_memory.predicted_peak("explicit", point, 1024) == pytest.approx(2**19 * 16)


def test_a_first_length_past_the_budget_is_not_started(monkeypatch):
    """Nothing measured yet, the first length was run whatever it needed (--lengths 100000: the explicit
    form on ~300 GiB); its least need, from the shapes, now keeps it within the budget."""
    cfg = attention_memory.MemoryConfig(lengths=(4096,), budget_gib=0.05)
    # (B, H, n, n) float32 scores of the explicit form alone: 8 * 4096^2 * 4 bytes = 512 MiB
    assert attention_memory.least_peak("explicit", 4096, cfg) > 8 * 4096**2 * 4
    started = []
    monkeypatch.setattr(attention_memory, "measure_in_subprocess",
                        lambda impl, n, mode, cfg: started.append((impl, mode)) or {"peak_bytes": 1})
    series = attention_memory.run_all(cfg)
    assert ("explicit", "forward") not in started and not series["explicit"]["forward"][0]["measured"]
    assert ("sdpa", "forward") in started  # its output, 8 MiB, fits 51 MiB


@pytest.mark.slow
def test_attention_memory_tiny_run_writes_results(tmp_path):
    """The whole pipeline; a 40 MiB budget makes the explicit n = 1,024 runs predicted, not run."""
    result = attention_memory.main(
        ["--lengths", "512", "1024", "--budget-gib", str(40 / 1024), "--out", str(tmp_path)]
    )
    for mode in attention_memory.MODES:
        explicit, sdpa = result["series"]["explicit"][mode], result["series"]["sdpa"][mode]
        assert explicit[0]["measured"] and not explicit[1]["measured"]
        assert explicit[1]["peak_bytes"] == pytest.approx(4 * explicit[0]["peak_bytes"], rel=1e-6)
        assert all(p["measured"] and p["peak_bytes"] < 8 * p["n"] ** 2 * 4 for p in sdpa)
    for suffix in ("json", "md", "png"):
        assert (tmp_path / f"attention_memory_cpu.{suffix}").stat().st_size > 0
    assert "predicted" in (tmp_path / "attention_memory_cpu.md").read_text()


def test_checkpoint_activations_tiny_run_writes_results(tmp_path):
    """The whole pipeline at the tiny shapes, aiayn and (where transformers is) Marian with HuggingFace's
    own gradient checkpointing: each recomputed step keeps a fraction of the activations the step that
    keeps them holds (saved_tensors_hooks' count), and each peak is measured in its own process."""
    systems = ["aiayn", "Marian"] if importlib.util.find_spec("transformers") else ["aiayn"]
    _load("checkpoint_activations").main(["--configs", "tiny", "--precisions", "fp32", "--rounds", "1",
                                          "--steps", "1", "--systems", ",".join(systems),
                                          "--out", str(tmp_path / "ck")])
    rows = json.loads((tmp_path / "ck.json").read_text())["rows"]
    assert [row["system"] for row in rows] == systems
    for row in rows:
        assert 0 < 3 * row["recomputed_kept_bytes"] < row["kept_kept_bytes"]
        assert row["kept_peak_bytes"] > 0 and row["recomputed_peak_bytes"] > 0
        assert row["kept_s"] > 0 and row["recomputed_s"] > 0
    report = (tmp_path / "ck.md").read_text()
    assert "| aiayn | tiny | fp32 |" in report
    assert ("| tiny | fp32 | recomputed |" in report) == ("Marian" in systems)  # the peer over aiayn


def test_checkpoint_activations_writes_after_each_configuration_and_names_a_failed_peak(tmp_path,
                                                                                       monkeypatch):
    """gpu.sh stops a step at its time limit: the report was written only after every configuration, so a
    run cut short left nothing. A child that fails is named with its error under the table (it was "failed"
    in a cell, its error in the .json alone, and the footer's method could read None)."""
    module = _load("checkpoint_activations")
    reports = []

    def child(system, config, precision, mode, device):  # no child processes: seconds, not 15
        measured = {"peak_bytes": 2**20, "method": "VmHWM"}
        return {"error": "exit -9: killed"} if mode == "recomputed" else measured

    def recording(files, *args):
        reports.append(module_write(files, *args))
        return reports[-1]

    module_write = module.write_report
    monkeypatch.setattr(module, "measure_in_child", child)
    monkeypatch.setattr(module, "write_report", recording)
    module.main(["--configs", "tiny", "--precisions", "fp32,bf16", "--rounds", "1", "--steps", "1",
                 "--systems", "aiayn", "--out", str(tmp_path / "ck")])
    assert len(reports) == 2 and "| aiayn | tiny | fp32 |" in reports[0]
    assert "| tiny | bf16 |" not in reports[0]  # written before the second configuration was measured
    assert "- peak of aiayn tiny fp32 recomputed failed: exit -9: killed" in reports[1]
    assert "\npeak: VmHWM; batch:" in reports[1]  # the method of the figures measured
    assert (tmp_path / "ck.md").read_text() == reports[1]


def test_outputs_default_to_a_folder_git_ignores():
    """No --out: results go to benchmarks/results/local/, never over the committed benchmarks/results/."""
    assert layers.LOCAL_RESULTS == BENCHMARKS / "results" / "local"
    assert layers.parse_args([])[1] == layers.LOCAL_RESULTS
    ignored = subprocess.run(["git", "check-ignore", "-q", str(layers.LOCAL_RESULTS / "layers_cpu.json")],
                             cwd=BENCHMARKS, capture_output=True)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0


def _committed(folder: Path, files: dict[str, str]) -> Path:
    """`folder` made a git checkout whose one commit holds `files` (name -> text), as benchmarks/results/
    holds the committed results."""
    if shutil.which("git") is None:
        pytest.skip("no git here")
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(folder)]
    for command in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "results"]):
        subprocess.run([*git, *command], check=True, capture_output=True)
    return folder


COMMITTED = r": would write over .*, which git tracks \(a committed result\): --out another place, or --force"


def test_a_replot_over_committed_results_needs_force(tmp_path):
    """`--replot benchmarks/results/layers_cpu_d1024.json`, as RESULTS.md quoted it, rewrote the committed
    md and png beside the json."""
    layers.main(["--lengths", "8", "--widths", "16", "--batch", "1", "--cell-limit", "0",
                 "--out", str(tmp_path / "run")])
    repo = _committed(tmp_path / "results", {p.name: p.read_text(errors="replace")
                                             for p in (tmp_path / "run").iterdir() if p.suffix != ".png"})
    saved, md = repo / "layers_cpu.json", repo / "layers_cpu.md"
    md.write_text("committed")
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com",
                    "commit", "-qam", "edited"], check=True)
    with pytest.raises(SystemExit, match=rf"^--replot {re.escape(str(saved))}{COMMITTED}"):
        layers.main(["--replot", str(saved)])
    assert md.read_text() == "committed" and not (repo / "layers_cpu.png").exists()
    layers.main(["--replot", str(saved), "--out", str(tmp_path / "mine")])  # elsewhere: written
    assert (tmp_path / "mine" / "layers_cpu.md").read_text().startswith("#")
    layers.main(["--replot", str(saved), "--force"])
    assert md.read_text() != "committed"


@pytest.mark.parametrize("script, files, argv", [
    ("train_step", ["train_step.md"], ["--configs", "tiny", "--out", "REPO/train_step.md"]),
    ("train_step", ["train_step.json"], ["--configs", "tiny", "--out", "REPO/train_step.md"]),
    ("decode", ["decode_cpu.json"], ["--out", "REPO/decode_cpu"]),
    ("layers", ["layers_cpu.png"], ["--lengths", "8", "--out", "REPO"]),
    ("attention_memory", ["attention_memory_cpu.md"], ["--lengths", "8", "--out", "REPO"]),
    ("one_row", ["one_row_cpu.md"], ["--threads", "1", "--out", "REPO/one_row_cpu"]),
    ("checkpoint_activations", ["ck.json"], ["--configs", "tiny", "--out", "REPO/ck"]),
])
def test_a_run_over_committed_results_is_refused_before_measuring(tmp_path, monkeypatch, script, files, argv):
    """RESULTS.md's commands name the committed files (`--out benchmarks/results/train_step_small_v2.md`):
    run again, they replaced the figures the page quotes. Refused before any measuring, unless --force."""
    repo = _committed(tmp_path / "results", {name: "committed" for name in files})
    module = _load(script)
    monkeypatch.setattr(module, "environment", lambda: pytest.fail("measuring began"))
    argv = [a.replace("REPO", str(repo)) for a in argv]
    with pytest.raises(SystemExit, match=rf"^--out {re.escape(argv[-1])}{COMMITTED} to replace it$"):
        module.main(argv)
    assert sorted(p.name for p in repo.iterdir()) == sorted([".git", *files])


@pytest.mark.parametrize("script", [layers, attention_memory])
def test_a_folder_out_is_named_as_typed_with_every_file_it_would_replace(script, tmp_path, monkeypatch):
    """`layers.py --out benchmarks/results` said "--out benchmarks/results/layers_cpu: would write over
    benchmarks/results/layers_cpu.json", a stem the user never typed, and one file of the three."""
    stem = "layers_cpu" if script is layers else "attention_memory_cpu"
    repo = _committed(tmp_path / "results", {f"{stem}.{s}": "committed" for s in ("json", "md", "png")})
    monkeypatch.setattr(script, "environment", lambda: pytest.fail("measuring began"))
    with pytest.raises(SystemExit) as stopped:
        script.main(["--lengths", "8", "--out", str(repo)])
    assert stopped.value.code == (f"--out {repo}: would write over {repo / stem}.json, {repo / stem}.md and "
                                  f"{repo / stem}.png, which git tracks (committed results): --out another "
                                  "place, or --force to replace it")


def test_a_name_with_glob_characters_is_tracked_only_as_itself(tmp_path):
    """`r[1].md` was read as a glob and matched a tracked r1.md: a new file refused as committed."""
    tracked_by_git = _load("common").tracked_by_git
    repo = _committed(tmp_path / "results", {"r1.md": "committed"})
    (repo / "r[1].md").write_text("mine")
    (repo / ":r.md").write_text("mine")  # a leading ":" was pathspec magic
    assert tracked_by_git(repo / "r1.md")
    assert not tracked_by_git(repo / "r[1].md") and not tracked_by_git(repo / ":r.md")
    os.environ["GIT_LITERAL_PATHSPECS"] = "1"  # ":(literal)r1.md" was then a name of its own: nothing tracked
    try:
        assert tracked_by_git(repo / "r1.md")
    finally:
        del os.environ["GIT_LITERAL_PATHSPECS"]


def test_results_files_rewritten_do_not_make_the_commit_dirty(tmp_path, monkeypatch):
    """git_commit's docstring said results files do not count, but a modified committed one (a run's
    figures written again) made every report say "+dirty"; a change to the code still does."""
    import aiayn

    git_commit = _load("common").git_commit
    repo = _committed(tmp_path / "repo", {"src/aiayn/__init__.py": "", "benchmarks/results/r.md": "figures"})
    monkeypatch.setattr(aiayn, "__file__", str(repo / "src" / "aiayn" / "__init__.py"))
    clean = git_commit()
    assert len(clean) >= 7 and "+" not in clean
    (repo / "benchmarks" / "results" / "r.md").write_text("figures measured again")
    (repo / "benchmarks" / "results" / "new.json").write_text("{}")
    assert git_commit() == clean
    (repo / "src" / "aiayn" / "__init__.py").write_text("x = 1")
    assert git_commit() == clean + "+dirty"


def test_layers_with_one_length_per_width_writes_every_output(tmp_path):
    """A zero cell limit stops each width after its first length: the notes say so, and md, png and
    json are all written."""
    layers.main(["--lengths", "8", "16", "--widths", "16", "32", "--batch", "1", "--cell-limit", "0",
                 "--out", str(tmp_path)])
    for suffix in ("json", "md", "png"):
        assert (tmp_path / f"layers_cpu.{suffix}").stat().st_size > 0
    assert "only n = 8 was measured" in (tmp_path / "layers_cpu.md").read_text()
    saved = json.loads((tmp_path / "layers_cpu.json").read_text())
    assert {"load_average", "load_average_after"} <= set(saved["environment"])


@pytest.mark.parametrize("script", [layers, attention_memory])
@pytest.mark.parametrize("bad", [["--lengths", "0"], ["--device", "cuda:x"]])
def test_bad_arguments_stop_before_any_work(script, bad, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        script.main([*bad, "--out", str(tmp_path)])
    assert stopped.value.code != 0
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("script, given, message", [
    (layers, ["--lengths", "8"], ("--quick sets --lengths 16 64 256 --widths 16 64 128 --batch 2: give "
                                  "--lengths, or --quick, not both")),
    (layers, ["--widths", "16", "--batch", "1"], "give --widths and --batch, or --quick, not both"),
    (attention_memory, ["--lengths", "8"], ("--quick sets --lengths 256 512 1024: give --lengths, or "
                                            "--quick, not both")),
])
def test_quick_with_an_option_it_sets_is_refused(script, given, message, tmp_path, capsys):
    """--quick --lengths 8 replaced the quick grid's lengths without a word, in files still named _quick;
    train_step.py refuses the same (its wording)."""
    with pytest.raises(SystemExit) as stopped:
        script.main(["--quick", *given, "--out", str(tmp_path)])
    assert stopped.value.code == 2 and message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
@pytest.mark.parametrize("script", [layers, attention_memory])
def test_cuda_without_a_device_is_refused_up_front(script, tmp_path):
    with pytest.raises(SystemExit, match="no such CUDA device"):
        script.main(["--device", "cuda", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_cuda_n_is_synchronised_measured_and_named_as_itself(monkeypatch):
    """--device cuda:1 passes require_device, but torch.cuda.synchronize(), the memory counters and the
    GPU's name without a device took the current one, cuda:0: the timers (train_step's matmul peak,
    layers' cells) timed kernel launches, attention_memory read cuda:0's peaks, the report named GPU 0.
    Every call is recorded here with the device it was given (no GPU needed)."""
    common = _load("common")
    calls = []

    def record(name):
        def call(device=None):
            calls.append((name, str(device)))
            return 0 if name != "get_device_name" else "GPU"
        return call

    for name in ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated",
                 "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, record(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # a CUDA build of torch on a machine without a GPU: cudnn.version() asks the devices (none), min([])
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    monkeypatch.setattr(attention_memory, "run_once", lambda *args: None)
    common.timeit(lambda: None, repeats=2, warmup=1, device="cuda:1")  # train_step.matmul_peak's timer
    layers.seconds(lambda: None, torch.device("cuda:1"))
    q = types.SimpleNamespace(device=torch.device("cuda:1"))  # a tensor on cuda:1, as far as it looks
    attention_memory.cuda_peak_bytes("sdpa", "forward", q, q, q, q)
    common.environment("cuda:1")
    assert {name for name, _ in calls} == {"synchronize", "reset_peak_memory_stats", "memory_allocated",
                                           "max_memory_allocated", "get_device_name"}
    assert [call for call in calls if call[1] != "cuda:1"] == []


def test_attention_memory_writes_its_default_folder(tmp_path, monkeypatch):
    """No --out: md, png and json land in LOCAL_RESULTS (here a temporary one); figures faked."""
    def fake(impl, n, mode, cfg):
        return {"impl": impl, "n": n, "mode": mode, "peak_bytes": n * n, "seconds": 0.0, "method": "fake"}

    monkeypatch.setattr(attention_memory, "LOCAL_RESULTS", tmp_path / "local")
    monkeypatch.setattr(attention_memory, "measure_in_subprocess", fake)
    attention_memory.main(["--lengths", "32", "16"])
    for suffix in ("json", "md", "png"):
        assert (tmp_path / "local" / f"attention_memory_cpu.{suffix}").stat().st_size > 0


@pytest.mark.parametrize("script", [layers, attention_memory])
@pytest.mark.parametrize("bad, message", [
    (["--device", "meta"], "the benchmarks run on cpu or cuda"),  # meta tensors "ran" in no time, exit 0
    (["--out", "FILE"], "is not a directory"),  # a FileExistsError after the whole run
])
def test_a_device_or_folder_it_cannot_use_is_refused_before_measuring(script, bad, message, tmp_path):
    (tmp_path / "FILE").write_text("mine")
    argv = [tmp_path / "FILE" if a == "FILE" else a for a in bad]
    with pytest.raises(SystemExit, match=message):
        out = [] if "--out" in bad else ["--out", str(tmp_path)]
        script.main([*map(str, argv), "--lengths", "8", *out])
    assert (tmp_path / "FILE").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]


def test_replot_writes_where_out_says_and_a_tag_keeps_its_dots(tmp_path, capsys):
    """--replot ignored --out and rewrote the md beside the json (the committed results); a --tag of
    b8.v2 was written as ..._b8.{json,md,png} while the log said _b8.v2."""
    layers.main(["--lengths", "8", "--widths", "16", "--batch", "1", "--cell-limit", "0", "--tag", "b8.v2",
                 "--out", str(tmp_path / "run")])
    saved = tmp_path / "run" / "layers_cpu_b8.v2.json"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "layers_cpu_b8.v2.json", "layers_cpu_b8.v2.md", "layers_cpu_b8.v2.png"]
    before = (tmp_path / "run" / "layers_cpu_b8.v2.md").stat().st_mtime_ns
    layers.main(["--replot", str(saved), "--out", str(tmp_path / "again")])
    again = sorted(p.name for p in (tmp_path / "again").iterdir())
    assert again == ["layers_cpu_b8.v2.md", "layers_cpu_b8.v2.png"]
    assert (tmp_path / "run" / "layers_cpu_b8.v2.md").stat().st_mtime_ns == before
    with pytest.raises(SystemExit, match="cannot read a saved run"):
        layers.main(["--replot", str(tmp_path / "missing.json")])
    for text in ('{"config": {}}', "[1]", '{"config": {"lengths": [8]}, "times": {"x": {}}}'):
        (tmp_path / "other.json").write_text(text)  # JSON, not this script's: was a KeyError traceback
        with pytest.raises(SystemExit, match="not a saved run of layers.py"):
            layers.main(["--replot", str(tmp_path / "other.json")])
    with pytest.raises(SystemExit):  # a reshape traceback in the model, once timing began
        layers.main(["--widths", "129", "--out", str(tmp_path)])
    assert "--widths 129: not divisible by its 2 heads" in capsys.readouterr().err


@pytest.mark.parametrize("given", [["--tag", "b8"], ["--widths", "16"], ["--lengths", "8"], ["--batch", "1"],
                                   ["--threads", "2"], ["--cell-limit", "0"], ["--device", "cpu"],
                                   ["--quick"]])
def test_replot_refuses_the_grid_options_it_would_ignore(given, tmp_path, capsys):
    """--replot redraws the saved run under its own name and grid: --tag b8 (or --widths 16, ...) was
    silently ignored, exit 0, and the md and png were written under the saved name."""
    saved = tmp_path / "layers_cpu.json"
    shutil.copy(BENCHMARKS / "results" / "layers_cpu.json", saved)
    with pytest.raises(SystemExit) as stopped:
        layers.main(["--replot", str(saved), *given, "--out", str(tmp_path / "again")])
    assert stopped.value.code == 2
    assert f"give {given[0]}, or --replot, not both" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layers_cpu.json"]


def test_a_width_given_twice_is_timed_once(tmp_path):
    """--widths 16 16 timed width 16 twice, the second overwriting the first; --lengths was deduplicated."""
    cfg = layers.parse_args(["--widths", "64", "16", "16", "--out", str(tmp_path)])[0]
    assert cfg.widths == (16, 64)


@pytest.mark.parametrize("name", ["decode", "layers", "attention_memory", "one_row", "batch_fill",
                                  "batching", "profile_step"])
def test_help_shows_the_docstring_and_what_each_option_does(name, capsys, monkeypatch):
    """--help gave the docstring's first line alone (no commands, no outputs), and decode.py's --repeats and
    --seed neither a word nor their default."""
    script = _load(name)
    parsers = []
    print_help = argparse.ArgumentParser.print_help
    monkeypatch.setattr(argparse.ArgumentParser, "print_help",
                        lambda self, file=None: (parsers.append(self), print_help(self, file))[1])
    with pytest.raises(SystemExit) as stopped:
        script.main(["--help"])
    assert stopped.value.code == 0
    assert script.__doc__.strip() in capsys.readouterr().out  # as written: its commands and what it writes
    options = [a for a in parsers[0]._actions if a.help != argparse.SUPPRESS]
    assert [a.option_strings[0] for a in options if not a.help] == []
    assert [a.option_strings[0] for a in options  # a default the script sets is said
            if a.default not in (None, False, argparse.SUPPRESS) and "default" not in a.help] == []


def test_batch_fill_counts_real_tokens_against_max_tokens():
    """Pairs of 4 + 4 tokens fill batches of 8 padded tokens exactly; a 2-token pair among 4-token ones
    pads its batch: 6 real tokens of 8, and the last batch, half empty, counts as a batch."""
    batch_fill = _load("batch_fill")
    assert batch_fill.fill([4] * 10, [4] * 10, 8) == (1.0, 1.0, 5)
    share_tgt, share_src, n = batch_fill.fill([4, 4, 4], [2, 4, 4], 8)  # batches [2, 4] and [4]
    assert n == 2 and share_tgt == pytest.approx(10 / 2 / 8) and share_src == pytest.approx(12 / 2 / 8)


def test_batch_fill_and_profile_step_say_bad_input_in_one_line(tmp_path, monkeypatch):
    """batch_fill's --max-tokens abc, a missing corpus, a budget below a pair; profile_step's Marian
    without transformers: each was a traceback."""
    batch_fill = _load("batch_fill")
    with pytest.raises(SystemExit):  # argparse's own line
        batch_fill.main(["--max-tokens", "abc"])
    with pytest.raises(SystemExit, match=f"^batch_fill: {tmp_path / 'none.en'}: file not found$"):
        batch_fill.main(["--src", str(tmp_path / "none.en"), "--tgt", str(tmp_path / "none.de")])
    profile_step = _load("profile_step")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers"
                        else find_spec(name, *a))
    with pytest.raises(SystemExit, match=r"^--system Marian needs transformers: pip install -e '\.\[bench"):
        profile_step.main(["--config", "tiny", "--system", "Marian"])


def test_profile_step_compile_without_a_compiler_is_refused_up_front(tmp_path, monkeypatch):
    """--compile on a CPU without the C++ compiler inductor runs was an 84-line InductorError traceback at
    the first warm-up step."""
    profile_step = _load("profile_step")
    monkeypatch.setenv("CXX", str(tmp_path / "nowhere" / "g++"))
    with pytest.raises(SystemExit, match=r"^--compile on a CPU needs the C\+\+ compiler .*nowhere/g\+\+ .*"
                                         r"install it or set CXX; or leave out --compile$"):
        profile_step.main(["--config", "tiny", "--compile"])


def test_a_bound_from_the_shapes_is_reported_as_at_least_never_as_predicted(tmp_path, monkeypatch):
    """With nothing measured in a series, the figure past the budget is `least_peak`, a lower bound from
    the shapes; it was labelled "predicted by the (n / n_last)^slope rule" and "(..., predicted)"."""
    def fake(impl, n, mode, cfg):
        return {"impl": impl, "n": n, "mode": mode, "peak_bytes": 8 * n * n, "seconds": 0.0, "method": "fake"}

    monkeypatch.setattr(attention_memory, "measure_in_subprocess", fake)
    # 0.75 MiB: SDPA's output at n = 256 (0.5 MiB) fits and is run, its 1 MiB predicted at 512 (slope 1)
    # not; explicit's n x n scores (2 MiB) do not fit at 256, with nothing measured to predict from
    result = attention_memory.main(["--lengths", "256", "512", "--budget-gib", str(0.75 / 1024),
                                    "--out", str(tmp_path)])
    text = (tmp_path / "attention_memory_cpu.md").read_text()
    growth = [line for line in text.splitlines() if line.startswith("- explicit")]
    assert len(growth) == 2 and all("at least 2.5 MiB" in line and "predicted" not in line for line in growth)
    rows = [line for line in text.splitlines() if line.startswith("| 256 |")]
    assert rows and all("(at least 2.5, not run)" in row and "predicted" not in row for row in rows)
    assert "| 256 | 0.5 | 0.5 | (at least 2.5, not run) | at least 5.0x | at least 1.25 |" in text
    # a bound over a prediction: neither a bound nor a prediction
    assert "| 512 | 1.0 | (1.0, predicted) | (at least 9.0, not run) | - | at least 1.12 |" in text
    explicit = result["series"]["explicit"]["forward"]  # the json says which figures are bounds
    assert [(p["measured"], p.get("lower_bound")) for p in explicit] == [(False, True)] * 2
    assert explicit[0]["peak_bytes"] == attention_memory.least_peak("explicit", 256, attention_memory.QUICK)


@pytest.mark.parametrize("budget", ["0", "-1", "nan"])
def test_a_budget_of_zero_or_less_is_refused(budget, tmp_path, monkeypatch, capsys):
    """--budget-gib 0 ran nothing and wrote every figure as a prediction; -1 was refused as "must be at
    least 0.0", a bound that 0 then failed."""
    monkeypatch.setattr(attention_memory, "measure_in_subprocess", lambda *a: pytest.fail("measured"))
    with pytest.raises(SystemExit) as stopped:
        attention_memory.main(["--lengths", "256", f"--budget-gib={budget}", "--out", str(tmp_path)])
    said = capsys.readouterr().err
    assert stopped.value.code == 2 and f"--budget-gib: must be more than 0: '{budget}'" in said
    assert not any(tmp_path.iterdir())


def test_batch_fill_prints_the_pieces_sentencepiece_made(tmp_path, capsys):
    """--vocab-size 100000 on Multi30k printed "100000 pieces" where SentencePiece made 83,510."""
    batch_fill = _load("batch_fill")
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "to", "its", "house"]
    for name, shift in (("a.en", 0), ("a.de", 3)):
        (tmp_path / name).write_text("".join(" ".join(words[(i + shift + j) % len(words)] for j in range(5))
                                             + "\n" for i in range(40)))
    batch_fill.main(["--src", str(tmp_path / "a.en"), "--tgt", str(tmp_path / "a.de"), "--vocab-size", "500",
                     "--max-tokens", "64"])
    line = next(line for line in capsys.readouterr().out.splitlines() if " pairs, " in line)
    pieces = int(line.split(" pairs, ")[1].removesuffix(" pieces"))
    assert 11 < pieces < 500  # the words at least, far fewer than asked


def test_batch_fill_names_the_longest_pairs_line_for_a_max_tokens_below_it(tmp_path):
    """--max-tokens 5 said "batch_fill: pair 246 has 10 tokens, more than max_tokens=5": no file, and the
    pair numbered among those kept (pairs with an empty side, or longer than data.max_len, dropped
    before it), the shortest of those too long. Now the longest pair, by its line, and what would do."""
    batch_fill = _load("batch_fill")
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "to", "its", "house"]
    for name, shift in (("a.en", 0), ("a.de", 3)):
        lines = [" ".join(words[(i + shift + j) % len(words)] for j in range(5)) for i in range(40)]
        lines[2 if name == "a.en" else 6] = ""  # two pairs dropped for an empty side
        lines[9] = " ".join(words * 30)  # 330 words: dropped as longer than data.max_len
        lines[29] = " ".join(words)  # line 30: the longest pair kept
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    src, tgt = tmp_path / "a.en", tmp_path / "a.de"
    said = (rf"^batch_fill: --max-tokens 5: the longest pair, line 30 of {re.escape(str(src))} and "
            rf"{re.escape(str(tgt))}, has (\d+) tokens a side \(with EOS\); give at least \1$")
    with pytest.raises(SystemExit, match=said):
        batch_fill.main(["--src", str(src), "--tgt", str(tgt), "--vocab-size", "100", "--max-tokens", "64,5"])


def test_batch_fill_shows_the_data_preparations_progress_on_stderr(tmp_path):
    """The script set up no logging: the tokenizer's training and "encoded N pairs", minutes on a WMT-size
    corpus, went nowhere, and a run said nothing until its table."""
    import aiayn

    for name in ("a.en", "a.de"):
        (tmp_path / name).write_text("".join(f"the cat {i} sat on the mat {i}\n" for i in range(40)))
    env = {**os.environ, "PYTHONPATH": str(Path(aiayn.__file__).parents[1])}  # this aiayn, not another
    done = subprocess.run([sys.executable, str(BENCHMARKS / "batch_fill.py"), "--src", str(tmp_path / "a.en"),
                           "--tgt", str(tmp_path / "a.de"), "--vocab-size", "100", "--max-tokens", "64"],
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    said = done.stderr.splitlines()
    timed = r"\d\d:\d\d:\d\d "  # aiayn train's form: the time, then the library's message
    assert any(re.fullmatch(timed + r"training a \w+ SentencePiece model .* on 40 pairs", s) for s in said)
    assert any(re.search(r"a\.en: encoded 40 pairs", line) for line in said)
    assert "| max_tokens |" in done.stdout and "encoded" not in done.stdout


def test_batching_says_bad_input_in_one_line(capsys):
    """--pairs -1 was numpy's ValueError traceback, 99999999999999 its _ArrayMemoryError's; a --max-tokens
    below a pair, aiayn's UserError's."""
    batching = _load("batching")
    with pytest.raises(SystemExit) as stopped:
        batching.main(["--pairs", "-1"])
    assert stopped.value.code == 2 and "argument --pairs: must be at least 1: '-1'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:  # numpy's _ArrayMemoryError traceback
        batching.main(["--pairs", "99999999999999"])
    assert stopped.value.code == 2
    assert "argument --pairs: must be at most 90,000,000: '99999999999999'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"^batching: pair \d+ has \d+ tokens, more than max_tokens=10 "
                                         r"\(the pairs drawn have 5 to 80 tokens a side\)$"):
        batching.main(["--pairs", "1000", "--max-tokens", "10"])


def test_batch_fill_names_its_own_flag_for_a_value_the_config_refuses(tmp_path):
    """--vocab-size 0 was "batch_fill: --set 'data.vocab_size=0': ...": a --set flag the script lacks."""
    batch_fill = _load("batch_fill")
    corpus = ["--src", str(tmp_path / "none.en"), "--tgt", str(tmp_path / "none.de")]
    with pytest.raises(SystemExit, match=r"^batch_fill: --vocab-size 0: data\.vocab_size=0 must be >= 8$"):
        batch_fill.main(["--vocab-size", "0", *corpus])


def test_the_docs_name_every_script_that_prints_and_writes_no_file():
    """RESULTS.md said profile_step.py and batch_fill.py print to the terminal (batching.py does too), and
    the README that the scripts write to benchmarks/results/local/ unless --out: those three have none."""
    printing = sorted(p.name for p in BENCHMARKS.glob("*.py")
                      if p.name != "common.py" and '"--out"' not in p.read_text())
    assert printing == ["batch_fill.py", "batching.py", "profile_step.py"]
    results = " ".join((BENCHMARKS / "RESULTS.md").read_text().split())
    readme = " ".join((BENCHMARKS.parent / "README.md").read_text().split())
    said = {"RESULTS.md": results.split(" print to the terminal")[0].rsplit("(", 1)[-1],
            "README.md": readme.split(" have no `--out`")[0].rsplit(";", 1)[-1]}
    assert {doc: [name for name in printing if f"`{name}`" not in text] for doc, text in said.items()} == {
        "RESULTS.md": [], "README.md": []}


def test_profile_step_prints_the_environment_beside_its_figures(capsys):
    """RESULTS.md quotes profile_step's output as figures; it printed the operator table alone, with no
    hardware, versions or commit."""
    profile_step = _load("profile_step")
    threads = torch.get_num_threads()
    try:
        profile_step.main(["--config", "tiny", "--precision", "fp32", "--steps", "1", "--top", "3"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("command: python benchmarks/profile_step.py --config tiny --precision fp32 --steps 1 "
                      "--top 3")
    environment = out[1]
    assert environment.startswith("environment: {") and f"'torch': '{torch.__version__}'" in environment
    assert "'commit': " in environment and "'cpu': " in environment
    assert "ms of CPU operator self time per step" in out[2]


def run_gpu_script(tmp_path, **env) -> subprocess.CompletedProcess:
    """gpu.sh with a 10 s budget (the least: were its up-front checks gone, each step would be skipped for
    want of time, the suite too), this interpreter's python3 first on PATH, OUT under `tmp_path`."""
    env = {**os.environ, "OUT": str(tmp_path / "out"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **env}
    return subprocess.run(["bash", str(BENCHMARKS / "gpu.sh"), "10"], cwd=BENCHMARKS.parent, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def test_gpu_script_without_pytest_timeout_stops_first_in_one_line(tmp_path):
    """pyproject.toml's addopts pass --timeout, which pytest refuses without pytest-timeout: every test step
    of gpu.sh failed, minutes into a lent machine, and its header named pytest alone."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "pytest_timeout.py").write_text("raise ImportError('hidden by the test')\n")
    done = run_gpu_script(tmp_path, PYTHONPATH=str(hidden))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [("gpu.sh: the tests need pytest and pytest-timeout (pyproject.toml's "
                                         "addopts pass --timeout): pip install pytest pytest-timeout")]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["layers_cpu", "layers_cpu_d1024"])
def test_committed_layer_reports_are_what_replot_writes_from_their_json(name, tmp_path, monkeypatch):
    """The committed md said "slope 0.85 over the last four lengths" of a run with three: written by an
    older layers.py, its text no longer what the code says of its json."""
    monkeypatch.setattr(layers, "plot", lambda *a: None)  # the text is the subject, not the picture
    committed = BENCHMARKS / "results" / f"{name}.md"
    layers.main(["--replot", str(committed.with_suffix(".json")), "--out", str(tmp_path)])
    assert (tmp_path / f"{name}.md").read_text() == committed.read_text()


def test_a_point_that_times_out_is_failed_and_the_run_keeps_the_others(tmp_path, monkeypatch, caplog):
    """subprocess.run's TimeoutExpired went uncaught: a traceback, and no file held the points measured
    before it (they are written after the whole grid)."""
    monkeypatch.setattr(attention_memory, "CHILD_TIMEOUT_S", 0.01)  # a real child, killed before its import
    point = attention_memory.measure_in_subprocess("sdpa", 16, "forward", attention_memory.QUICK)
    assert point == {"impl": "sdpa", "n": 16, "mode": "forward", "error": "timed out after 0.01 s"}

    def run(cmd, timeout, **kwargs):  # n = 32 times out; the others answer as a child does
        impl, n, mode = cmd[cmd.index("--measure") + 1:][:3]
        if n == "32":
            raise subprocess.TimeoutExpired(cmd, timeout)
        line = json.dumps({"impl": impl, "n": int(n), "mode": mode, "peak_bytes": 2**20, "seconds": 0.0,
                           "method": "fake"})
        return subprocess.CompletedProcess(cmd, 0, stdout=line + "\n", stderr="")

    monkeypatch.setattr(attention_memory, "subprocess",  # this script's subprocess alone: git runs in common
                        types.SimpleNamespace(run=run, TimeoutExpired=subprocess.TimeoutExpired))
    caplog.set_level("INFO", logger="benchmarks.attention_memory")
    result = attention_memory.main(["--lengths", "16", "32", "64", "--out", str(tmp_path)])
    for series in result["series"].values():
        for points in series.values():
            assert [p.get("error") for p in points] == [None, "timed out after 0.01 s", None]
            assert points[0]["peak_bytes"] == points[2]["peak_bytes"] == 2**20
    assert caplog.messages.count("sdpa forward n=32: timed out after 0.01 s") == 1
    assert "| 32 | 0.1 | failed (timed out after 0.01 s) | failed (timed out after 0.01 s) | - | - |" in (
        tmp_path / "attention_memory_cpu.md").read_text()
    assert json.loads((tmp_path / "attention_memory_cpu.json").read_text())["series"] == result["series"]


def test_gpu_script_says_why_torch_cannot_be_imported(tmp_path):
    """A torch that fails to import (its CUDA libraries missing) was said to be "no CUDA device here", its
    own error thrown away."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    failing = 'raise ImportError("libcudart.so.13: cannot open shared object file")\n'
    (fake / "__init__.py").write_text(failing)
    done = run_gpu_script(tmp_path, PYTHONPATH=str(tmp_path / "fake"))
    assert done.returncode == 2 and done.stdout == ""
    said = "gpu.sh: python3 cannot import torch: ImportError: libcudart.so.13: cannot open shared object file"
    assert done.stderr.splitlines() == [said]
    assert not (tmp_path / "out").exists()


def test_gpu_script_runs_from_the_repository_root_wherever_it_is_started(tmp_path):
    """gpu.sh named tests/, benchmarks/ and src/ from the folder it was started in: started elsewhere, every
    step failed. Stubs stand in for python3 and nvidia-smi (so no GPU is needed) and record the folder each
    ran in; an OUT given relative is taken from where the script was started, as typed."""
    stubs, calls, elsewhere = tmp_path / "bin", tmp_path / "calls", tmp_path / "elsewhere"
    stubs.mkdir()
    elsewhere.mkdir()
    for name in ("python3", "nvidia-smi"):
        (stubs / name).write_text(f'#!/bin/sh\npwd -P >> "{calls}"\n')
        (stubs / name).chmod(0o755)
    env = {**os.environ, "OUT": "out", "PATH": f"{stubs}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", str(BENCHMARKS / "gpu.sh"), "10"], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert set(calls.read_text().splitlines()) == {str(BENCHMARKS.parent)}
    assert f"--out {elsewhere / 'out'}/train_step_gpu.md" in done.stdout
    assert (elsewhere / "out" / "log.txt").is_file()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")
def test_gpu_script_without_cuda_stops_at_once_in_one_line(tmp_path):
    """Without CUDA nvidia-smi failed, a 15-line traceback followed, every --device cuda step failed, and
    the CPU test suite ran for all the time left."""
    done = run_gpu_script(tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [("gpu.sh: no CUDA device here (python3 -c 'import torch; assert "
                                         "torch.cuda.is_available()' fails): run it on a machine with one")]
    assert not (tmp_path / "out").exists()


def test_the_environment_records_the_settings_that_change_timings(monkeypatch):
    """RESULTS.md shows AIAYN_SYSTEM_MALLOC, THP_MEM_ALLOC_ENABLE and MKL_NUM_THREADS change the figures,
    and that keeping freed memory does; the record held none of them, nor the machine's memory."""
    common = _load("common")
    monkeypatch.setenv("AIAYN_SYSTEM_MALLOC", "1")
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = common.environment(keeps_freed_memory=False)
    assert env["AIAYN_SYSTEM_MALLOC"] == env["THP_MEM_ALLOC_ENABLE"] == env["MKL_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in env and env["keeps_freed_memory"] is False
    assert env["ram_gb"] > 0 and "keeps_freed_memory" not in common.environment()


def test_a_profile_records_whether_freed_memory_was_kept(monkeypatch, capsys):
    """profile_step (as train_step and decode's workers) threw keep_freed_memory()'s answer away."""
    profile_step = _load("profile_step")
    monkeypatch.setattr(profile_step, "keep_freed_memory", lambda: False)  # as with AIAYN_SYSTEM_MALLOC=1
    threads = torch.get_num_threads()
    try:
        profile_step.main(["--config", "tiny", "--precision", "fp32", "--steps", "1", "--top", "1"])
    finally:
        torch.set_num_threads(threads)
    assert "'keeps_freed_memory': False" in capsys.readouterr().out.splitlines()[1]


def test_aiayn_run_from_outside_a_checkout_has_no_commit_said(tmp_path, monkeypatch):
    """aiayn imported from a copy git ignores inside a checkout (a venv's site-packages): the record gave
    that checkout's HEAD, a commit of code that did not run; nor did it say where aiayn came from."""
    import aiayn

    common = _load("common")
    repo = _committed(tmp_path / "repo", {"src/aiayn/__init__.py": "", ".gitignore": ".venv/\n"})
    (repo / ".venv" / "aiayn").mkdir(parents=True)
    (repo / ".venv" / "aiayn" / "__init__.py").write_text("")
    monkeypatch.setattr(aiayn, "__file__", str(repo / ".venv" / "aiayn" / "__init__.py"))
    assert common.git_commit() == f"unknown (not a git checkout; aiayn {aiayn.__version__})"
    where = common.aiayn_source()
    assert where.startswith(f"{aiayn.__version__} from {repo / '.venv' / 'aiayn'}")
    assert f"(not {BENCHMARKS.parent / 'src' / 'aiayn'}, beside this script)" in where
    monkeypatch.setattr(aiayn, "__file__", str(BENCHMARKS.parent / "src" / "aiayn" / "__init__.py"))
    assert common.aiayn_source() == f"{aiayn.__version__} from {BENCHMARKS.parent / 'src' / 'aiayn'}"


def test_the_recorded_command_runs_again_as_written():
    """A run without arguments was recorded as "python benchmarks/decode.py " (a space at its end); an
    argument with a space is quoted as a shell takes it."""
    common = _load("common")
    assert common.command_line("/x/benchmarks/decode.py", []) == "python benchmarks/decode.py"
    assert (common.command_line("decode.py", ["--engines", "CT2 float32,HF"])
            == "python benchmarks/decode.py --engines 'CT2 float32,HF'")


def test_batch_fill_records_the_environment_before_its_work(tmp_path, monkeypatch):
    """batch_fill took the environment after the tokenizer's training and the encoding: its load average
    was its own work's, where the other scripts record the machine's before they begin."""
    batch_fill = _load("batch_fill")
    order, prepare = [], batch_fill.loop.prepare_data
    monkeypatch.setattr(batch_fill, "environment", lambda: order.append("environment") or {})
    monkeypatch.setattr(batch_fill.loop, "prepare_data", lambda *a: order.append("work") or prepare(*a))
    for name in ("a.en", "a.de"):
        (tmp_path / name).write_text("".join(f"the cat sat on mat {i % 7}\n" for i in range(30)))
    batch_fill.main(["--src", str(tmp_path / "a.en"), "--tgt", str(tmp_path / "a.de"), "--vocab-size", "40",
                     "--max-tokens", "64"])
    assert order == ["environment", "work"]


def test_gpu_script_help_prints_its_usage(tmp_path):
    """`bash gpu.sh --help` said "SECONDS must be a whole number of seconds, at least 10, not '--help'"."""
    for flag in ("--help", "-h"):
        done = subprocess.run(["bash", str(BENCHMARKS / "gpu.sh"), flag], cwd=tmp_path, capture_output=True,
                              text=True, timeout=30, check=False)
        assert done.returncode == 0 and done.stderr == ""
        assert done.stdout.splitlines()[:3] == [
            "The checks that only a CUDA GPU can make, in one go, for a machine lent for minutes:", "",
            "  OUT=some/folder bash benchmarks/gpu.sh [SECONDS]"]
        assert done.stdout.rstrip().endswith("(OUT: default benchmarks/results/local/gpu in the repository).")

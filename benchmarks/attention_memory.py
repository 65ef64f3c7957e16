"""Peak memory of attention: `scaled_dot_product_attention` against the explicit softmax(Q K^T / sqrt(d)) V.

The explicit formula materializes the (B, H, n, n) score and probability matrices, so its memory grows
as n^2; a fused "flash" kernel works on blocks of keys with an online softmax and keeps only O(n) per
head (the output and one log-sum-exp per query). This script measures both, forward (under `no_grad`)
and forward+backward, for B = 1, H = 8, D = 64 (the base model's heads) and n from 256 to 8,192.

Method, CPU: every measurement runs in a fresh Python process, so that no allocator cache from an
earlier one hides memory. That process builds Q, K, V (and the output gradient), runs the operation once
at n = 16 to load its code paths, resets the kernel's peak-RSS counter (writing 5 to
/proc/self/clear_refs, Linux >= 4.0), records the resident set, runs the operation, and reports the
peak resident set (VmHWM) minus that baseline: every byte the operation touched at its peak, whoever
allocated it (torch's CPU allocator keeps no statistics, and tracemalloc does not see it). Where
clear_refs is not writable it falls back to getrusage's ru_maxrss, which cannot be reset and so can only
see peaks above the import's. SDPA is pinned to the fused backends (flash on CPU; flash or
memory-efficient on GPU) with no dropout, no mask, not causal, so a silent fallback to the math path
cannot pass for a fused kernel.

Method, GPU: torch.cuda.max_memory_allocated after reset_peak_memory_stats, minus the allocation before.

A run that would pass the memory budget is not started: its peak is predicted from the largest n
measured along the last measured log-log slope (with one n measured: 1 for SDPA, 2 for the explicit
formula) and reported as predicted.
Before a series has a measured n to extrapolate from, its peak is bounded from the shapes alone (the
output, and for the explicit formula one n x n matrix) and reported as that: "at least", not predicted.
A figure whose process fails (killed for memory, say) or runs past 10 minutes is reported as failed, in
one line and in the results, and the run goes on.

    python benchmarks/attention_memory.py                # CPU, n = 256 .. 8192, budget 4 GiB
    python benchmarks/attention_memory.py --quick        # n = 256, 512, 1024
    python benchmarks/attention_memory.py --device cuda

Writes benchmarks/results/local/attention_memory_{device}[_quick].{json,md,png} (ignored by git), or to
the folder --out names (the committed figures: `--out benchmarks/results`; over files git tracks, as
those now are, only with --force).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` beside this file, however it is run
from common import (
    LOCAL_RESULTS,
    at_least,
    check_out,
    command_line,
    environment,
    load_average,
    markdown_table,
    require_device,
    status_kib,
    with_suffix_added,
)

log = logging.getLogger("benchmarks.attention_memory")

IMPLS = ("sdpa", "explicit")
MODES = ("forward", "train")  # train = forward + backward
MIB = 2**20
CHILD_TIMEOUT_S = 600  # one figure's process at most (swapping, say): then a failed point


@dataclass(frozen=True)
class MemoryConfig:
    """What one run measures."""

    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)  # sequence lengths n
    batch: int = 1  # B
    heads: int = 8  # H, the base model's
    head_dim: int = 64  # D = d_k = d_v
    budget_gib: float = 4.0  # no run whose predicted (or least) peak exceeds this is started
    device: str = "cpu"


QUICK = MemoryConfig(lengths=(256, 512, 1024))


def explicit_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Equation 1 as written: softmax(Q K^T / sqrt(d_k)) V, (B, H, n, D) -> (B, H, n, D)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, n, n)
    return torch.softmax(scores, dim=-1) @ v  # (B, H, n, D)


def fused_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """SDPA pinned to a fused kernel: raises rather than fall back to the O(n^2) math path.

    On a CPU that is the flash kernel; on a GPU flash takes only half precision, so float32 gets the
    memory-efficient kernel, which is O(n) in memory as well.
    """
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v)  # (B, H, n, D)


ATTENTION = {"sdpa": fused_attention, "explicit": explicit_attention}


def run_once(impl: str, mode: str, q: Tensor, k: Tensor, v: Tensor, grad: Tensor) -> None:
    if mode == "forward":
        with torch.no_grad():
            ATTENTION[impl](q, k, v)
    else:
        ATTENTION[impl](q, k, v).backward(grad)


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM); False where /proc/self/clear_refs is not writable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_peak_bytes(impl: str, mode: str, q: Tensor, k: Tensor, v: Tensor, grad: Tensor) -> tuple[int, str]:
    """Peak resident-set growth of one run, and the method that measured it."""
    if _reset_peak_rss():
        before = status_kib("VmRSS")
        run_once(impl, mode, q, k, v, grad)
        return (status_kib("VmHWM") - before) * 1024, "VmHWM after clear_refs"
    before = status_kib("VmRSS")
    run_once(impl, mode, q, k, v, grad)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return max(0, peak - before) * 1024, "ru_maxrss (not resettable: a lower bound)"


def cuda_peak_bytes(impl: str, mode: str, q: Tensor, k: Tensor, v: Tensor, grad: Tensor) -> tuple[int, str]:
    """Peak allocation growth of one run on the inputs' GPU, named in every call: without a device they
    read the current one's counters, cuda:0's, and a run on cuda:1 showed peaks near 0."""
    device = q.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_once(impl, mode, q, k, v, grad)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before, "torch.cuda.max_memory_allocated"


def measure(impl: str, n: int, mode: str, cfg: MemoryConfig) -> dict:
    """One measurement in this process: build inputs, load code paths at n = 16, then the peak at n."""
    device = torch.device(cfg.device)
    torch.manual_seed(0)

    def inputs(length: int) -> list[Tensor]:
        shape = (cfg.batch, cfg.heads, length, cfg.head_dim)  # (B, H, n, D)
        return [torch.randn(shape, device=device, requires_grad=mode == "train") for _ in range(4)]

    run_once(impl, mode, *inputs(16))  # first-call costs (kernel selection, thread pool) off the books
    q, k, v, grad = inputs(n)
    grad = grad.detach()
    start = time.perf_counter()
    peak, method = (cuda_peak_bytes if device.type == "cuda" else cpu_peak_bytes)(impl, mode, q, k, v, grad)
    return {
        "impl": impl,
        "n": n,
        "mode": mode,
        "peak_bytes": peak,
        "seconds": time.perf_counter() - start,
        "method": method,
    }


def measure_in_subprocess(impl: str, n: int, mode: str, cfg: MemoryConfig) -> dict:
    """`measure` in a fresh interpreter: a clean heap and a clean peak for every figure. A child that
    fails or runs past `CHILD_TIMEOUT_S` gives a failed point, and the run goes on."""
    cmd = [sys.executable, __file__, "--measure", impl, str(n), mode, "--config", json.dumps(asdict(cfg))]
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # killed by run(); uncaught, it lost every point measured before
        return {"impl": impl, "n": n, "mode": mode, "error": f"timed out after {CHILD_TIMEOUT_S:g} s"}
    if done.returncode != 0:  # e.g. killed by the kernel for memory (-9): say so, keep going
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"impl": impl, "n": n, "mode": mode, "error": f"exit {done.returncode}: {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def least_peak(impl: str, n: int, cfg: MemoryConfig) -> float:
    """The least peak a point can show, from the shapes: its output (B, H, n, D) in float32, and for the
    explicit formula its (B, H, n, n) scores (the inputs exist before the baseline: not counted). Bounds
    the first point of a series, which has no measured one to extrapolate from: with --lengths 100000 the
    explicit form was started on ~300 GiB. A lower bound, never reported as a prediction."""
    output = cfg.batch * cfg.heads * n * cfg.head_dim
    scores = cfg.batch * cfg.heads * n * n if impl == "explicit" else 0
    return 4.0 * (output + scores)


def predicted_peak(impl: str, points: list[dict], n: int) -> float | None:
    """Extrapolate the measured peaks of one series of `impl` to n along its last log-log slope; with one
    point measured, along the slope its memory has: 1 for SDPA's fused kernel (O(n)), 2 for the explicit
    formula's n x n matrices. (2 for both predicted SDPA's 61 MiB at n = 30,000 as 15 GiB, not run.)"""
    measured = [p for p in points if "peak_bytes" in p and p.get("measured") and p["peak_bytes"] > 0]
    if not measured:
        return None
    last = measured[-1]
    slope = 2.0 if impl == "explicit" else 1.0
    if len(measured) >= 2:
        prev = measured[-2]
        slope = max(1.0, math.log(last["peak_bytes"] / prev["peak_bytes"]) / math.log(last["n"] / prev["n"]))
    return last["peak_bytes"] * (n / last["n"]) ** slope


def run_all(cfg: MemoryConfig) -> dict[str, dict[str, list[dict]]]:
    """{impl: {mode: [point per n]}}; a point over the budget is predicted, not run."""
    budget = cfg.budget_gib * 2**30
    series: dict[str, dict[str, list[dict]]] = {impl: {mode: [] for mode in MODES} for impl in IMPLS}
    for n in cfg.lengths:
        for mode in MODES:
            for impl in IMPLS:
                points = series[impl][mode]
                guess = predicted_peak(impl, points, n)
                bound = guess is None  # nothing measured to extrapolate from: the shapes' lower bound
                guess = least_peak(impl, n, cfg) if bound else guess
                if guess > budget:
                    points.append({"impl": impl, "n": n, "mode": mode, "peak_bytes": int(guess),
                                   "measured": False, **({"lower_bound": True} if bound else {})})
                    log.info("%s %s n=%d: %s %.0f MiB > budget, not run", impl, mode, n,
                             "at least" if bound else "predicted", guess / MIB)
                    continue
                point = {**measure_in_subprocess(impl, n, mode, cfg), "measured": True}
                points.append(point)
                log.info(
                    "%s %s n=%d: %s",
                    impl,
                    mode,
                    n,
                    f"{point['peak_bytes'] / MIB:.1f} MiB" if "peak_bytes" in point else point["error"],
                )
    return series


def growth_exponent(points: list[dict], min_n: int = 1024) -> float | None:
    """Log-log slope of measured peak on n from the first to the last measured point with n >= min_n
    (every measured point when fewer than two reach min_n)."""
    measured = [p for p in points if p.get("measured") and p.get("peak_bytes", 0) > 0]
    ok = [p for p in measured if p["n"] >= min_n]
    ok = ok if len(ok) >= 2 else measured
    if len(ok) < 2:
        return None
    return math.log(ok[-1]["peak_bytes"] / ok[0]["peak_bytes"]) / math.log(ok[-1]["n"] / ok[0]["n"])


def estimate(point: dict) -> str:
    """How a point's peak_bytes was found: "measured", "predicted" (extrapolated from measured points) or
    "at least" (`least_peak`, from the shapes: a lower bound, not a prediction)."""
    if point["measured"]:
        return "measured"
    return "at least" if point.get("lower_bound") else "predicted"  # no lower_bound key in older files


def _mib(point: dict) -> str:
    if "peak_bytes" not in point:
        return f"failed ({point['error']})"
    text = f"{point['peak_bytes'] / MIB:,.1f}"
    return {"measured": text, "predicted": f"({text}, predicted)",
            "at least": f"(at least {text}, not run)"}[estimate(point)]


def _ratio(s: dict, e: dict) -> str:
    """explicit / SDPA. A lower bound over a measured figure bounds the ratio from below; over a
    predicted one, or under anything, it is neither a bound nor a prediction: "-"."""
    if "peak_bytes" not in s or "peak_bytes" not in e or s["peak_bytes"] <= 0 or estimate(s) == "at least":
        return "-"
    ratio = e["peak_bytes"] / s["peak_bytes"]
    shown = f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"  # 0.9x, not "1x" when SDPA is larger
    if estimate(e) == "at least":
        return f"at least {shown}" if s["measured"] else "-"
    return shown + ("" if s["measured"] and e["measured"] else " (predicted)")


def memory_table(series: dict, cfg: MemoryConfig, mode: str) -> str:
    """n | one input's size | SDPA peak | explicit peak | their ratio | explicit peak in n x n matrices."""
    rows = []
    for s, e in zip(series["sdpa"][mode], series["explicit"][mode]):
        n = s["n"]
        square = cfg.batch * cfg.heads * n * n * 4  # one float32 (B, H, n, n) matrix
        row = [n, f"{cfg.batch * cfg.heads * n * cfg.head_dim * 4 / MIB:.1f}", _mib(s), _mib(e), _ratio(s, e)]
        if "peak_bytes" in e:
            squares = f"{e['peak_bytes'] / square:.2f}"
            row.append({"measured": squares, "predicted": f"{squares} (predicted)",
                        "at least": f"at least {squares}"}[estimate(e)])
        else:
            row.append("-")
        rows.append(row)
    header = [
        "n",
        "one of Q/K/V MiB",
        "SDPA peak MiB",
        "explicit peak MiB",
        "explicit / SDPA",
        "explicit peak / one (B,H,n,n) matrix",
    ]
    return markdown_table(header, rows)


def first_over_budget(points: list[dict], budget: float) -> str:
    over = [p for p in points if p.get("peak_bytes", 0) > budget]
    if not over:
        return "stays within the budget over the whole grid"
    p = over[0]
    size = p["peak_bytes"] / 2**30
    size = f"{size:.2f} GiB" if size >= 1 else f"{size * 1024:.1f} MiB"  # 0.00 GiB said nothing
    how = {"measured": f"{size}, measured",
           "predicted": f"{size}, predicted by the (n / n_last)^slope rule, not run",
           "at least": f"at least {size}: the output and any n x n matrix, from the shapes; a lower bound, "
                       "not run"}[estimate(p)]
    return f"exceeds it first at n = {p['n']:,} ({how})"


def markdown(result: dict, cfg: MemoryConfig) -> str:
    series, env = result["series"], result["environment"]
    budget = cfg.budget_gib * 2**30
    methods = sorted(
        {p["method"] for s in series.values() for pts in s.values() for p in pts if "method" in p}
    )
    parts = [
        "# Peak memory of attention: fused SDPA against the explicit softmax(Q K^T / sqrt(d)) V",
        "",
        f"Command: `{result['command']}`  ",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()) + "  ",
        f"B = {cfg.batch}, H = {cfg.heads}, D = {cfg.head_dim}, float32; {cfg.budget_gib} GiB budget.  ",
        (
            f"Measured with: {', '.join(methods)}; one fresh process per figure (see the script's "
            "docstring). The inputs (and, for forward+backward, the output gradient) exist before the "
            "baseline and are not counted; everything the operation allocates is: its output, saved "
            "tensors, input gradients and any temporaries. SDPA is pinned to the fused backends "
            "(flash on CPU)."
        ),
        "",
        "## Growth with n (log-log slope of the measured peak from n = 1,024 on, or over all n measured)",
        "",
    ]
    for mode in MODES:
        label = "forward" if mode == "forward" else "forward+backward"
        for impl in IMPLS:
            e = growth_exponent(series[impl][mode])
            parts.append(
                f"- {impl} {label}: slope {'-' if e is None else f'{e:.2f}'}; "
                f"{first_over_budget(series[impl][mode], budget)}."
            )
    for mode in MODES:
        parts += [
            "",
            f"## {'Forward (no_grad)' if mode == 'forward' else 'Forward + backward'}",
            "",
            memory_table(series, cfg, mode),
        ]
    return "\n".join(parts) + "\n"


def plot(series: dict, cfg: MemoryConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"sdpa": "tab:blue", "explicit": "tab:red"}
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for impl in IMPLS:
        for mode, style in zip(MODES, ("-", "--")):
            pts = [p for p in series[impl][mode] if "peak_bytes" in p]
            label = (
                f"{'SDPA (flash)' if impl == 'sdpa' else 'explicit softmax(QK^T)V'}, "
                f"{'forward' if mode == 'forward' else 'forward+backward'}"
            )
            ax.loglog(
                [p["n"] for p in pts],
                [max(p["peak_bytes"], 1) / MIB for p in pts],
                style,
                color=colors[impl],
                label=label,
            )
            ax.loglog(
                [p["n"] for p in pts if p["measured"]],
                [p["peak_bytes"] / MIB for p in pts if p["measured"]],
                "o",
                color=colors[impl],
            )
            for kind, marker in (("predicted", "o"), ("at least", "^")):
                shown = [p for p in pts if estimate(p) == kind]
                ax.loglog([p["n"] for p in shown], [p["peak_bytes"] / MIB for p in shown], marker,
                          mfc="white", color=colors[impl])
    ax.axhline(cfg.budget_gib * 1024, color="black", ls=":", label=f"budget {cfg.budget_gib} GiB")
    n0 = cfg.lengths[0]
    for power, name in ((1, "slope 1 (linear)"), (2, "slope 2 (quadratic)")):
        ax.loglog(
            cfg.lengths,
            [(n / n0) ** power * 1.0 for n in cfg.lengths],
            color="gray",
            lw=0.8,
            ls="-." if power == 1 else (0, (1, 3)),
            label=f"guide: {name}",
        )
    ax.set_xticks(cfg.lengths, [str(n) for n in cfg.lengths])
    ax.minorticks_off()
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("peak memory growth, MiB")
    ax.set_title(
        f"Attention peak memory on {cfg.device}, B={cfg.batch} H={cfg.heads} D={cfg.head_dim} float32\n"
        "filled = measured; hollow, over budget and not run: circle = predicted, triangle = at least",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def budget_gib(text: str) -> float:
    """argparse type: GiB, more than 0 (a budget of 0 ran nothing and reported every figure as if
    predicted); one message for 0 and below (-1 was "must be at least 0.0", which 0 is)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:  # `not >`: also refuses nan
        raise argparse.ArgumentTypeError(f"must be more than 0: {text!r}")
    return at_least(0.0, float)(text)  # and finite, as every other number the scripts take


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"--lengths {' '.join(map(str, QUICK.lengths))} (not given with it)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N); default cpu")
    parser.add_argument("--lengths", type=at_least(1), nargs="+",
                        help="override the sequence lengths n (default "
                             f"{' '.join(map(str, MemoryConfig.lengths))})")
    parser.add_argument("--budget-gib", type=budget_gib,
                        help="largest predicted peak to run, more than 0 (default 4)")
    parser.add_argument("--out", type=Path, default=LOCAL_RESULTS,
                        help="directory for the json, md and png (default benchmarks/results/local, "
                             "ignored by git)")
    parser.add_argument("--force", action="store_true",
                        help="write over files git tracks (committed results)")
    parser.add_argument("--measure", nargs=3, metavar=("IMPL", "N", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)  # the parent's MemoryConfig, as json
    args = parser.parse_args(argv)
    if args.measure:  # the child: one figure, as one json line
        cfg = MemoryConfig(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(args.config).items()}
        )
        impl, n, mode = args.measure
        print(json.dumps(measure(impl, int(n), mode, cfg)))
        return {}
    if args.quick and args.lengths:  # they replaced the quick lengths without a word, in files named _quick
        parser.error(f"--quick sets --lengths {' '.join(map(str, QUICK.lengths))}: give --lengths, or "
                     "--quick, not both")
    require_device(args.device)
    cfg = QUICK if args.quick else MemoryConfig()
    overrides = {
        "lengths": args.lengths and tuple(sorted(set(args.lengths))),  # the prediction extrapolates upwards
        "budget_gib": args.budget_gib,
        "device": args.device,
    }
    cfg = MemoryConfig(**{**asdict(cfg), **{k: v for k, v in overrides.items() if v is not None}})
    stem = args.out / f"attention_memory_{torch.device(cfg.device).type}{'_quick' if args.quick else ''}"
    # before the runs
    check_out(stem, [with_suffix_added(stem, s) for s in (".json", ".md", ".png")], args.force, args.out)
    env = environment(cfg.device)  # before the runs: the load average is the machine's, not this run's
    series = run_all(cfg)
    result = {
        "command": command_line(__file__, argv),
        "environment": {**env, "load_average_after": load_average()},
        "config": asdict(cfg),
        "series": series,
    }
    text, data = markdown(result, cfg), json.dumps(result, indent=1)  # both made before any file is written
    plot(result["series"], cfg, with_suffix_added(stem, ".png"))
    with_suffix_added(stem, ".md").write_text(text)
    with_suffix_added(stem, ".json").write_text(data)
    log.info("wrote %s.{json,md,png}", stem)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()

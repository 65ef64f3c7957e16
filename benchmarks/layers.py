"""Per-layer time of self-attention, an LSTM and a 1-D convolution over a grid of n and d (paper Table 1).

The paper (Table 1, section 4) counts per-layer cost: self-attention O(n^2 d) with O(1) sequential
operations, recurrence O(n d^2) with O(n) sequential operations, convolution O(k n d^2), and argues that
self-attention is the cheaper one when the sequence length n is below the width d. This script measures
it: forward and forward+backward wall time of four layers of the same width d, on the same (B, n, d)
input, for every (n, d) of a grid:

- `attention`: the model's own `aiayn.model.MultiHeadAttention` (self-attention, the SDPA path), which
  also pays its four d x d projections, O(n d^2), that Table 1 leaves out;
- `sdpa`: a bare `scaled_dot_product_attention` over H = d / 64 heads: Table 1's O(n^2 d) term alone;
- `lstm`: `nn.LSTM(d, d)`, one direction, batch_first;
- `conv`: `nn.Conv1d(d, d, k=3, padding=1)`, the paper's O(k n d^2) row.

Each cell times every layer in interleaved rounds (the order rotates each round, so a noisy neighbour
on a shared machine hurts all layers alike) and keeps the median of the rounds after warmup. The
crossover n* per d is where attention becomes slower than the LSTM (or the conv) and stays so up to the
longest n measured (the last crossing, where noise makes the times cross more than once), interpolated
in log-log between the two grid points around it.

    python benchmarks/layers.py            # the full CPU grid (about 3 minutes: RESULTS.md's 2-core VM)
    python benchmarks/layers.py --quick    # a small grid, seconds
    python benchmarks/layers.py --device cuda

Writes benchmarks/results/local/layers_{device}[_quick][_TAG].{json,md,png} (ignored by git), or to the
folder --out names (the committed figures: `--out benchmarks/results`; over files git tracks, as those now
are, only with --force).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` beside this file, however it is run
from common import (
    LOCAL_RESULTS,
    at_least,
    check_out,
    command_line,
    environment,
    load_average,
    markdown_table,
    refuse_committed,
    require_device,
    sync,
    threads,
    with_suffix_added,
)

from aiayn.model import MultiHeadAttention

log = logging.getLogger("benchmarks.layers")

LAYERS = ("attention", "sdpa", "lstm", "conv")
ATTENTION = ("attention", "sdpa")
PEERS = ("lstm", "conv")
MODES = ("forward", "train")  # train = forward + backward


@dataclass(frozen=True)
class GridConfig:
    """What one run measures."""

    lengths: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)  # sequence lengths n
    widths: tuple[int, ...] = (16, 128, 256, 512, 1024)  # widths d; 16 isolates the sequential cost
    batch: int = 4  # B: sequences per call
    head_dim: int = 64  # D = d / H, the paper's d_k; widths below it use one head of width d
    kernel: int = 3  # k of the convolution
    warmup: int = 1  # untimed rounds per cell (first-call allocation, oneDNN primitive creation)
    repeats: int = 5  # at most this many timed rounds per cell; the median is kept
    budget_s: float = 4.0  # timed rounds per cell: as many as fit in this, by the warmup round, at least 1
    cell_limit_s: float = 6.0  # a width's sweep stops after the first n whose one round takes longer
    threads: int = 1  # CPU threads; 1 because 2 threads on 2 shared cores measured 3-7x slower
    device: str = "cpu"


QUICK = GridConfig(lengths=(16, 64, 256), widths=(16, 64, 128), batch=2, repeats=3)


def n_heads(d: int, head_dim: int) -> int:
    """H = d / D heads (the paper's base model: 512 / 64 = 8); one head when d < D."""
    return max(1, d // head_dim)


def build_layer(name: str, n: int, d: int, cfg: GridConfig, device: torch.device) -> Callable[[], Tensor]:
    """A closure running one forward pass of layer `name` on a fixed random input of B sequences."""
    b = cfg.batch
    if name == "sdpa":
        h = n_heads(d, cfg.head_dim)
        q, k, v = (torch.randn(b, h, n, d // h, device=device, requires_grad=True) for _ in range(3))
        return lambda: F.scaled_dot_product_attention(q, k, v)  # (B, H, n, D)
    if name == "conv":
        conv = nn.Conv1d(d, d, cfg.kernel, padding=cfg.kernel // 2).to(device)
        x = torch.randn(b, d, n, device=device, requires_grad=True)  # Conv1d wants (B, d, n)
        return lambda: conv(x)  # (B, d, n)
    x = torch.randn(b, n, d, device=device, requires_grad=True)  # (B, n, d)
    if name == "attention":
        mha = MultiHeadAttention(d, n_heads(d, cfg.head_dim), self_attention=True).to(device)
        return lambda: mha(x)  # (B, n, d)
    if name == "lstm":
        lstm = nn.LSTM(d, d, batch_first=True).to(device)
        return lambda: lstm(x)[0]  # (B, n, d)
    raise ValueError(f"unknown layer {name!r}")


def train_step(forward: Callable[[], Tensor]) -> Callable[[], None]:
    """Forward + backward with a fixed random output gradient, as inside a training step."""
    grad: list[Tensor] = []

    def step() -> None:
        out = forward()
        if not grad:
            grad.append(torch.randn_like(out))
        out.backward(grad[0])  # parameter .grad accumulates; the add is O(d^2), noise beside the layer

    return step


def forward_only(forward: Callable[[], Tensor]) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            forward()

    return run


def seconds(fn: Callable[[], None], device: torch.device) -> float:
    """Wall time of one call; on a GPU the synchronizations make it the kernels' time, not the launch's."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def time_cell(n: int, d: int, cfg: GridConfig, device: torch.device) -> dict[str, dict[str, float]]:
    """Median seconds {layer: {mode: s}} of every layer at (n, d), timed in interleaved rounds.

    The result also holds "round_s": the wall time of one whole round, what the sweep's stop rule reads.
    """
    runs = {}
    for name in LAYERS:
        forward = build_layer(name, n, d, cfg, device)
        runs[name] = {"forward": forward_only(forward), "train": train_step(forward)}
    samples: dict[str, dict[str, list[float]]] = {name: {mode: [] for mode in MODES} for name in LAYERS}
    rounds, round_s = cfg.warmup + cfg.repeats, 0.0
    r = 0
    while r < rounds:
        shift, start = r % len(LAYERS), time.perf_counter()
        for name in LAYERS[shift:] + LAYERS[:shift]:  # rotate: no layer always runs first
            for mode in MODES:
                t = seconds(runs[name][mode], device)
                if r >= cfg.warmup:
                    samples[name][mode].append(t)
        round_s = time.perf_counter() - start
        if (
            r == cfg.warmup - 1
        ):  # cheap cells get every repeat; a slow one, whose noise is relatively small, fewer
            rounds = cfg.warmup + max(1, min(cfg.repeats, int(cfg.budget_s / round_s)))
        r += 1
    cell = {
        name: {mode: statistics.median(v) for mode, v in modes.items()} for name, modes in samples.items()
    }
    return {**cell, "round_s": round_s}


def run_grid(cfg: GridConfig) -> dict[int, dict[int, dict]]:
    """{d: {n: {layer: {mode: seconds}}}} over the grid, each width's lengths in increasing order.

    Time grows with n, so once one round of a cell takes longer than `cell_limit_s` the larger n of
    that width are left out (and listed as such): the default run stays within minutes.
    """
    device = torch.device(cfg.device)
    times: dict[int, dict[int, dict]] = {d: {} for d in cfg.widths}
    for d in cfg.widths:
        for n in cfg.lengths:
            times[d][n] = time_cell(n, d, cfg, device)
            log.info("d=%d n=%d round %.1f s: %s", d, n, times[d][n]["round_s"], _brief(times[d][n]))
            if times[d][n]["round_s"] > cfg.cell_limit_s:
                break
    return times


def _brief(cell: dict) -> str:
    return " ".join(f"{name}={cell[name]['train'] * 1e3:.2f}ms" for name in LAYERS)


def crossover(lengths: list[int], attention: list[float], peer: list[float]) -> float | None:
    """n* where attention becomes slower than `peer` and stays so up to the longest n measured.

    Interpolated in log n against log(time ratio) between the two lengths around the crossing;
    0.0 when attention is slower at every n, None when it is never slower (n* beyond the grid).
    """
    log_ratio = [math.log(a / p) for a, p in zip(attention, peer)]
    if log_ratio[-1] <= 0:
        return None
    i = len(log_ratio) - 1
    while i > 0 and log_ratio[i - 1] > 0:  # walk back over the final run where attention is slower
        i -= 1
    if i == 0:
        return 0.0
    x0, x1 = math.log(lengths[i - 1]), math.log(lengths[i])
    y0, y1 = log_ratio[i - 1], log_ratio[i]
    return math.exp(x0 + (x1 - x0) * -y0 / (y1 - y0))


def crossovers(times: dict[int, dict[int, dict]]) -> dict[int, dict[str, dict[str, float | None]]]:
    """{d: {"attention_vs_lstm": {mode: n*}, ...}} for every attention layer against every peer."""
    out: dict[int, dict[str, dict[str, float | None]]] = {}
    for d, cells in times.items():
        lengths = sorted(cells)
        out[d] = {
            f"{a}_vs_{p}": {
                mode: crossover(
                    lengths, [cells[n][a][mode] for n in lengths], [cells[n][p][mode] for n in lengths]
                )
                for mode in MODES
            }
            for a in ATTENTION
            for p in PEERS
        }
    return out


def growth_exponent(lengths: list[int], seconds_: list[float]) -> float | None:
    """Least-squares slope of log time on log n: 2 for O(n^2), 1 for O(n), 0 for per-call overhead."""
    if len(lengths) < 2:
        return None
    xs, ys = [math.log(n) for n in lengths], [math.log(t) for t in seconds_]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def flop_parity(attention: str, peer: str, d: int, kernel: int) -> float:
    """n at which the two layers' forward multiply-adds per token are equal (0.0: attention never cheaper).

    Per token: Q K^T and A V cost n d each, 2 n d together (the `sdpa` layer); `attention` adds 4 d^2 for
    its four projections; the LSTM's four gates 8 d^2 (input and hidden matmuls); the conv 3 d^2 for k = 3.
    """
    fixed = {"attention": 4 * d * d, "sdpa": 0}[attention]
    peer_cost = {"lstm": 8 * d * d, "conv": kernel * d * d}[peer]
    return max(0.0, (peer_cost - fixed) / (2 * d))


def plot(times: dict[int, dict[int, dict]], cross: dict, cfg: GridConfig, path: Path) -> None:
    """One column per width d, forward on top and forward+backward below; time against n in log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"attention": "tab:blue", "sdpa": "tab:cyan", "lstm": "tab:red", "conv": "tab:green"}
    labels = {
        "attention": "MultiHeadAttention (aiayn)",
        "sdpa": "bare SDPA (n^2 d term)",
        "lstm": "nn.LSTM(d, d)",
        "conv": f"nn.Conv1d(d, d, k={cfg.kernel})",
    }
    widths = list(times)
    # at least 12 inches wide: the title and the legend span the figure, whatever the number of widths
    fig, axes = plt.subplots(2, len(widths), figsize=(max(12.0, 4.2 * len(widths)), 8), squeeze=False)
    for col, d in enumerate(widths):
        lengths = sorted(times[d])
        for row, mode in enumerate(MODES):
            ax = axes[row][col]
            for name in LAYERS:
                ms = [times[d][n][name][mode] * 1e3 for n in lengths]
                ax.loglog(lengths, ms, "o-", color=colors[name], label=labels[name], ms=3)
            ax.axvline(d, color="gray", ls=":", label="paper: attention cheaper while n < d")
            for peer in PEERS:
                n_star = cross[d][f"attention_vs_{peer}"][mode]
                if n_star:  # a measured crossover of the model's attention layer: mark it
                    ax.axvline(
                        n_star, color=colors[peer], ls="--", lw=1.2, label=f"measured n*: attention = {peer}"
                    )
                    ax.annotate(
                        f"n*={n_star:.0f}",
                        (n_star, ax.get_ylim()[0]),
                        color=colors[peer],
                        rotation=90,
                        va="bottom",
                        ha="right",
                        fontsize=8,
                    )
            ax.set_title(f"d = {d}, {'forward' if mode == 'forward' else 'forward + backward'}", fontsize=10)
            ax.set_xticks(
                lengths,
                [
                    str(n) if len(lengths) <= 4 or i % 2 == 0 or n == lengths[-1] else ""
                    for i, n in enumerate(lengths)
                ],
            )
            ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
            ax.set_xlabel("sequence length n")
            ax.grid(True, which="major", alpha=0.3)
        axes[0][col].set_ylabel("ms per call" if col == 0 else "")
        axes[1][col].set_ylabel("ms per call" if col == 0 else "")
    handles, names = {}, []
    for ax in axes.flat:  # one legend for the figure, each entry once
        for h, name in zip(*ax.get_legend_handles_labels()):
            if name not in handles:
                handles[name] = h
                names.append(name)
    fig.legend([handles[n] for n in names], names, loc="lower center", ncol=4, fontsize=9)
    fig.suptitle(
        f"Per-layer time, batch {cfg.batch}, {cfg.device}, {cfg.threads} thread(s): "
        "dashed = measured crossover of MultiHeadAttention, dotted = the paper's n = d",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _n_star(value: float | None, lengths: list[int]) -> str:
    if value is None:
        return f"beyond {max(lengths)} (never slower)"
    if value == 0.0:
        return f"below {min(lengths)} (always slower)"
    return f"{value:,.0f}"


def _ratio_to_d(value: float | None, d: int) -> str:
    return "" if not value else f"{value / d:.2g} d"


def crossover_table(times: dict, cross: dict, cfg: GridConfig) -> str:
    rows = []
    for d, cells in times.items():
        lengths = sorted(cells)
        for a in ATTENTION:
            for p in PEERS:
                fwd, train = cross[d][f"{a}_vs_{p}"]["forward"], cross[d][f"{a}_vs_{p}"]["train"]
                parity = flop_parity(a, p, d, cfg.kernel)
                rows.append(
                    [
                        d,
                        f"{a} vs {p}",
                        d,
                        f"{parity:,.0f}" if parity else "never cheaper",
                        _n_star(fwd, lengths),
                        _ratio_to_d(fwd, d),
                        _n_star(train, lengths),
                        _ratio_to_d(train, d),
                    ]
                )
    header = [
        "d",
        "pair",
        "paper n* = d",
        "FLOP parity n",
        "measured n* forward",
        "= x d",
        "measured n* fwd+bwd",
        "= x d",
    ]
    return markdown_table(header, rows)


def exponent_table(times: dict, min_n: int = 256) -> str:
    rows = []
    for d, cells in times.items():
        lengths = [n for n in sorted(cells) if n >= min_n]
        row: list[object] = [d, f"{lengths[0]}..{lengths[-1]}" if lengths else "-"]
        for name in LAYERS:
            for mode in MODES:
                e = growth_exponent(lengths, [cells[n][name][mode] for n in lengths])
                row.append("-" if e is None else f"{e:.2f}")
        rows.append(row)
    header = ["d", "n range"] + [
        f"{name} {'fwd' if m == 'forward' else 'f+b'}" for name in LAYERS for m in MODES
    ]
    return markdown_table(header, rows)


def times_table(cells: dict[int, dict]) -> str:
    """n | each layer's forward / forward+backward ms | attention's time over each peer's."""
    rows = []
    for n in sorted(cells):
        c = cells[n]
        row: list[object] = [n] + [f"{c[x]['forward'] * 1e3:.3g} / {c[x]['train'] * 1e3:.3g}" for x in LAYERS]
        for a in ATTENTION:
            for p in PEERS:
                row.append(f"{c[a]['forward'] / c[p]['forward']:.2f} / {c[a]['train'] / c[p]['train']:.2f}")
        rows.append(row)
    header = ["n"] + [f"{x} ms" for x in LAYERS] + [f"{a}/{p}" for a in ATTENTION for p in PEERS]
    return markdown_table(header, rows)


def sequential_note(times: dict, cfg: GridConfig) -> str:
    """At the smallest width the arithmetic is negligible: what does each extra LSTM step cost?"""
    d = min(times)
    lengths = sorted(times[d])
    lstm = [times[d][n]["lstm"]["forward"] * 1e3 for n in lengths]
    conv = [times[d][n]["conv"]["forward"] * 1e3 for n in lengths]
    if len(lengths) < 2:
        return (
            f"At d = {d} only n = {lengths[0]} was measured (LSTM forward {lstm[0]:.2g} ms, convolution "
            f"{conv[0]:.2g} ms): the cost of one more LSTM step needs at least two lengths."
        )
    step_us = (lstm[-1] - lstm[-2]) / (lengths[-1] - lengths[-2]) * 1e3  # marginal cost of one more step
    return (
        f"At d = {d} (B = {cfg.batch}) each LSTM step does {cfg.batch * 4 * d * d:,} multiply-adds of "
        f"recurrence. The LSTM's forward time goes {lstm[0]:.2g} -> {lstm[-1]:.2g} ms from "
        f"n = {lengths[0]} to {lengths[-1]} (slope {growth_exponent(lengths[-4:], lstm[-4:]):.2f} over "
        f"the last {min(4, len(lengths))} lengths), and one more step costs {step_us:.2g} microseconds "
        f"(from the two longest n); the convolution, with no step-to-step dependence, goes {conv[0]:.2g} -> "
        f"{conv[-1]:.2g} ms. Table 1's O(n) sequential operations show as this per-step cost paid n "
        f"times in a row; with {cfg.threads} CPU thread(s) there is no parallel hardware for attention's "
        "O(1) sequential operations to fill, which is where the paper's argument (GPUs) bites hardest: "
        "there each step is at least one kernel launch."
    )


def summary_lines(times: dict, cross: dict, cfg: GridConfig) -> list[str]:
    """One sentence per width: the model's attention layer against the LSTM, next to the paper's n = d."""
    lines = []
    for d, cells in times.items():
        lengths = sorted(cells)
        f, t = (cross[d]["attention_vs_lstm"][m] for m in MODES)
        fs, ts = (cross[d]["sdpa_vs_lstm"][m] for m in MODES)
        lines.append(
            f"- d = {d}: MultiHeadAttention becomes slower than the LSTM at n* = {_n_star(f, lengths)} "
            f"forward, {_n_star(t, lengths)} forward+backward (paper: n* = d = {d}; equal FLOPs at n = "
            f"{flop_parity('attention', 'lstm', d, cfg.kernel):,.0f}); bare SDPA at {_n_star(fs, lengths)} / "
            f"{_n_star(ts, lengths)}."
        )
    return lines


def markdown(result: dict, cfg: GridConfig) -> str:
    times, cross = result["times"], result["crossovers"]
    env = result["environment"]
    parts = [
        "# Per-layer time: self-attention against recurrence and convolution (paper Table 1)",
        "",
        f"Command: `{result['command']}`  ",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()) + "  ",
        f"Grid: {asdict(cfg)}",
        "",
        (
            "Method: every cell builds the four layers on one random input of B sequences and times, in "
            f"{cfg.warmup} warmup + up to {cfg.repeats} interleaved rounds (the layer order rotates each "
            "round), the forward pass under `no_grad` and a forward+backward with a fixed random output "
            f"gradient; the median round is kept (as many timed rounds as fit in {cfg.budget_s} s by the "
            f"warmup round, at most {cfg.repeats}, at least one). A width's sweep stops after the first n "
            f"whose round takes over {cfg.cell_limit_s} s; the lengths it did not reach are listed below. "
            "The machine was shared with other jobs: read the ratios, measured in the same rounds, rather "
            "than the absolute times."
        ),
        "",
        "## Crossover: where attention stops being cheaper",
        "",
        *summary_lines(times, cross, cfg),
        "",
        crossover_table(times, cross, cfg),
        "",
        "## Sequential operations",
        "",
        sequential_note(times, cfg),
        "",
        "## Growth with n (slope of log time on log n, from n = 256 on)",
        "",
        "O(n^2) layers tend to 2, O(n) layers to 1; lower values mean fixed per-call costs still matter.",
        "",
        exponent_table(times),
        "",
    ]
    not_run = {d: [n for n in cfg.lengths if n not in times[d]] for d in times}
    if any(not_run.values()):
        parts += [
            "Lengths not run (the previous length's round exceeded the limit): "
            + "; ".join(f"d = {d}: {v}" for d, v in not_run.items() if v),
            "",
        ]
    for d in times:
        parts += [
            f"## d = {d}: ms per call, forward / forward+backward, and time ratios",
            "",
            times_table(times[d]),
            "",
        ]
    return "\n".join(parts)


def write_results(result: dict, cfg: GridConfig, stem: Path, json_too: bool = True) -> None:
    """STEM.png, STEM.md and STEM.json: the markdown and the json are made before any file is written
    and the plot is written first, so that a failure leaves no new json beside an old md or png."""
    text = markdown(result, cfg)
    data = json.dumps(result, indent=1) if json_too else None
    stem.parent.mkdir(parents=True, exist_ok=True)
    plot(result["times"], result["crossovers"], cfg, with_suffix_added(stem, ".png"))
    with_suffix_added(stem, ".md").write_text(text)  # with_suffix cut a --tag of b8.v2 to b8
    if data is not None:
        with_suffix_added(stem, ".json").write_text(data)


def parse_args(argv: list[str] | None) -> tuple[GridConfig, Path, str, Path | None, bool]:
    """The grid, the output directory, the file stem (layers_{device}[_quick][_tag]), a json to replot,
    --force."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    quick = (f"--lengths {' '.join(map(str, QUICK.lengths))} --widths {' '.join(map(str, QUICK.widths))} "
             f"--batch {QUICK.batch}")
    parser.add_argument("--quick", action="store_true",
                        help=f"a small grid that runs in seconds: {quick} (none of those given with it), "
                        f"{QUICK.repeats} timed rounds a cell")
    parser.add_argument("--device", help="cpu or cuda (cuda:N); default cpu")
    full = GridConfig()
    parser.add_argument("--lengths", type=at_least(1), nargs="+",
                        help=f"override the sequence lengths n (default {' '.join(map(str, full.lengths))})")
    parser.add_argument("--widths", type=at_least(1), nargs="+",
                        help=f"override the widths d (default {' '.join(map(str, full.widths))})")
    parser.add_argument("--batch", type=at_least(1), help=f"override the batch size B (default {full.batch})")
    parser.add_argument("--threads", type=threads, help="CPU threads (default 1, see GridConfig)")
    parser.add_argument("--cell-limit", type=at_least(0.0, float),
                        help="stop a width after a round this long (default 6 s)")
    parser.add_argument("--tag", help="add _TAG to the file names (a run beside the default one)")
    parser.add_argument("--replot", type=Path, metavar="JSON",
                        help="redraw the md and png of a saved run, under its own name and grid (so with "
                             "--out and --force alone)")
    parser.add_argument("--out", type=Path,
                        help="directory for the json, md and png (default benchmarks/results/local, "
                             "ignored by git; with --replot: beside the json)")
    parser.add_argument("--force", action="store_true",
                        help="write over files git tracks (committed results)")
    args = parser.parse_args(argv)
    grid_set = ["--quick"] * args.quick + [
        f"--{name.replace('_', '-')}" for name in ("device", "lengths", "widths", "batch", "threads",
                                                  "cell_limit", "tag")
        if getattr(args, name) is not None]  # --cell-limit 0 is given, though falsy
    if args.replot is not None and grid_set:  # the saved run's grid and name are redrawn, never these
        parser.error(f"--replot redraws a saved run as it was measured: give {' and '.join(grid_set)}, "
                     "or --replot, not both")
    args.device = args.device or "cpu"
    quick_set = [f"--{name}" for name in ("lengths", "widths", "batch") if getattr(args, name) is not None]
    if args.quick and quick_set:  # they replaced the quick grid without a word, in files named _quick
        parser.error(f"--quick sets {quick}: give {' and '.join(quick_set)}, or --quick, not both")
    require_device(args.device)
    for d in args.widths or ():  # MultiHeadAttention's heads must divide the width
        if d % n_heads(d, 64):
            parser.error(f"--widths {d}: not divisible by its {n_heads(d, 64)} heads of 64 "
                         "(use a multiple of 64, or a width under 128)")
    cfg = QUICK if args.quick else GridConfig()
    overrides = {
        "lengths": args.lengths and tuple(sorted(set(args.lengths))),  # the sweep stops at the first slow n
        "widths": args.widths and tuple(sorted(set(args.widths))),  # a width given twice is timed once
        "batch": args.batch,
        "threads": args.threads,
        "device": args.device,
        "cell_limit_s": args.cell_limit,
    }
    cfg = GridConfig(**{**asdict(cfg), **{k: v for k, v in overrides.items() if v is not None}})
    stem = f"layers_{torch.device(cfg.device).type}"
    stem += ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    if args.replot is not None:
        return cfg, args.out, stem, args.replot, args.force
    out = args.out or LOCAL_RESULTS
    files = [with_suffix_added(out / stem, s) for s in (".json", ".md", ".png")]
    check_out(out / stem, files, args.force, out)  # before the run, not after it
    return cfg, out, stem, None, args.force


def replot(path: Path, out: Path | None = None, force: bool = False) -> None:
    """Redraw the markdown and the plot of a saved run from its json (the figures are not re-measured),
    beside it or into the directory `out`; over files git tracks only with `force` (the committed runs'
    own md and png, beside their json)."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # missing, a directory, not JSON, not UTF-8
        raise SystemExit(f"--replot {path}: cannot read a saved run ({e})") from None
    try:
        config = {k: tuple(v) if isinstance(v, list) else v for k, v in result["config"].items()}
        cfg = GridConfig(**config)
        # json keys are strings: back to the ints the tables and the plot sort by
        times = {int(d): {int(n): cell for n, cell in cells.items()} for d, cells in result["times"].items()}
        cross = {int(d): pairs for d, pairs in result["crossovers"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # valid JSON, not a run of this script
        raise SystemExit(f"--replot {path}: not a saved run of layers.py ({type(e).__name__}: {e})") from None
    result.update(times=times, crossovers=cross)
    stem = path.with_suffix("") if out is None else out / path.stem
    files = [with_suffix_added(stem, s) for s in (".md", ".png")]
    if out is not None:
        check_out(stem, files, force, out)
    else:
        refuse_committed(f"--replot {path}", files, force)
    write_results(result, cfg, stem, json_too=False)


def main(argv: list[str] | None = None) -> dict:
    """Run the grid, write OUT/layers_{device}[_quick][_tag].{json,md,png}; returns what the json holds."""
    cfg, out, name, saved, force = parse_args(argv)
    if saved is not None:
        replot(saved, out, force)
        return {}
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    env = environment(cfg.device)  # before the timing: the load average is the machine's, not this run's
    times = run_grid(cfg)
    for cells in times.values():
        for cell in cells.values():
            cell.pop("round_s")
    result = {
        "command": command_line(__file__, argv),
        "environment": {**env, "load_average_after": load_average()},
        "config": asdict(cfg),
        "times": times,
        "crossovers": crossovers(times),
    }
    stem = out / name
    write_results(result, cfg, stem)
    log.info("wrote %s.{json,md,png}", stem)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()

"""One-row Linear products (greedy search of one sentence) by kernel and thread count, on the CPU.

A cached `base` decoder step of one sentence makes 37 products of a single row: per layer the packed
Q, K, V, the self-attention's W^O, the cross-attention's W^Q and W^O and the FFN's two, then the
vocabulary (`decode.step_linear_shapes`). For each thread count this times them with each kernel aiayn
can pick (`aiayn.decoding.cpu`):

- `MKL on W^T`: plain MKL sgemm on the whole transposed weight (one block);
- `MKL, a block per thread`: W^T cut into one block per thread, run side by side by MKL's batched
  product (`OneRowProduct`);
- `oneDNN packed`: oneDNN with the weight packed for 64 rows, what aiayn uses from two rows up;
- `aiayn's pick on 4 KiB pages`: the MKL layout aiayn picks there, its weights where malloc puts them.
  The two MKL kernels above hold theirs in one mapping on transparent huge pages, as aiayn's packed
  model does (`aiayn.memory.on_huge_pages`); oneDNN allocates its packed weights itself.

Distinct random weights per product, as in a model, so that a step streams all of them (154 MB) through
the caches; the kernels interleaved in every round (A B C C B A); the median over rounds. The last
column names the kernel `one_row_blocks` picks on this CPU at that thread count.

    python benchmarks/one_row.py                       # 1, 2, 4, ... and the core count
    python benchmarks/one_row.py --threads 1,2 --rounds 21

Writes benchmarks/results/local/one_row_cpu.{json,md} (ignored by git), or the prefix --out names (over
a file git tracks, a committed result, only with --force).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import LOCAL_RESULTS, at_least, check_out, environment, load_average, markdown_table  # noqa: E402
from common import command_line, thread_counts, with_suffix_added  # noqa: E402
from decode import step_linear_shapes  # noqa: E402

from aiayn.config import model_config  # noqa: E402
from aiayn.decoding.cpu import PACKED_ROWS, OneRowProduct, huge_page_weights, one_row_blocks  # noqa: E402
from aiayn.decoding.cpu import packing_available  # noqa: E402

WHOLE, BLOCKS, ONEDNN = "MKL on W^T", "MKL, a block per thread", "oneDNN packed"
SMALL_PAGES = "aiayn's pick on 4 KiB pages"


def kernels(threads: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor], Callable]]:
    """Kernel name -> a function that lays out an (out, in) weight and bias once and returns the
    product x (1, in) -> x W^T + b (1, out). Only those this PyTorch build has."""

    def onednn(w, b):
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACKED_ROWS)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")

    out = {WHOLE: lambda w, b: OneRowProduct(w, b, 1)}
    if threads > 1:
        out[BLOCKS] = lambda w, b: OneRowProduct(w, b, threads)
    if packing_available():
        out[ONEDNN] = onednn
    blocks = one_row_blocks()  # aiayn's pick at the thread count set now
    if blocks:
        out[SMALL_PAGES] = lambda w, b: OneRowProduct(w, b, blocks)
    return out


def picked() -> str:
    """The kernel aiayn takes for one row at the thread count set now (the rule of `one_row_blocks`)."""
    blocks = one_row_blocks()  # reads torch.get_num_threads(), set by the caller
    return ONEDNN if blocks == 0 else WHOLE if blocks == 1 else BLOCKS


def measure(threads: int, rounds: int, config=None) -> dict[str, float]:
    """Median ms of one step's one-row products (37 for `base`, the default `config`), per kernel, on
    `threads` threads. Every kernel's products are checked against `F.linear` first."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    shapes = step_linear_shapes(config or model_config("base", vocab_size=32000))
    weights = [(torch.randn(o, i) * i**-0.5, torch.randn(o) * 0.1) for i, o in shapes]  # (out, in), (out,)
    inputs = [torch.randn(1, i) for i, _ in shapes]
    laid_out = {name: [layout(w, b) for w, b in weights] for name, layout in kernels(threads).items()}
    for name in (WHOLE, BLOCKS):  # each kernel's weights in a mapping of its own
        huge_page_weights(laid_out.get(name, []))
    for x, w_b, *products in zip(inputs, weights, *laid_out.values()):  # every kernel computes x W^T + b
        expected = torch.nn.functional.linear(x, *w_b)
        for product in products:
            torch.testing.assert_close(product(x), expected, atol=1e-4, rtol=1e-4)
    seconds: dict[str, list[float]] = {name: [] for name in laid_out}
    order = list(laid_out)
    with torch.inference_mode():
        for r in range(rounds + 1):  # round 0 warms up
            for name in order if r % 2 == 0 else reversed(order):
                start = time.perf_counter()
                for product, x in zip(laid_out[name], inputs):
                    product(x)
                if r:
                    seconds[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(s) for name, s in seconds.items()}


def default_threads() -> list[int]:
    cores = os.cpu_count() or 1
    return sorted({2**i for i in range(cores.bit_length()) if 2**i <= cores} | {cores})


def markdown(result: dict) -> str:
    names = [WHOLE, BLOCKS, ONEDNN, SMALL_PAGES]
    rows = []
    for threads, row in result["ms"].items():
        fastest = min((n for n in row if n != SMALL_PAGES), key=row.get)  # among the kernels aiayn has
        cells = [f"{row[n]:.2f}" if n in row else "-" for n in names]
        choice = result["picked"][threads]
        rows.append([threads, *cells, f"{choice}{'' if choice == fastest else f' (fastest: {fastest})'}"])
    return "\n\n".join([
        "# One-row products of a `base` decoder step, ms per step (37 products, 154 MB of weights)",
        f"`{result['command']}`",
        markdown_table(["threads", *names, "aiayn picks"], rows),
        f"Environment: `{json.dumps(result['environment'])}`",
    ]) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=thread_counts, default=default_threads(),
                   help="comma-separated thread counts (default: 1, 2, 4, ... and the core count)")
    p.add_argument("--rounds", type=at_least(1), default=11,
                   help="timed rounds per thread count, the median reported (default 11)")
    p.add_argument("--out", type=Path, default=LOCAL_RESULTS / "one_row_cpu",
                   help="output prefix: PREFIX.json and PREFIX.md (default benchmarks/results/local/one_row_cpu)")
    p.add_argument("--force", action="store_true",
                   help="write over files git tracks (committed results)")
    args = p.parse_args(argv)
    if not torch.backends.mkl.is_available():
        raise SystemExit("this PyTorch build has no MKL: aiayn makes one-row products with oneDNN only")
    json_path, md_path = with_suffix_added(args.out, ".json"), with_suffix_added(args.out, ".md")
    check_out(args.out, [json_path, md_path], args.force)  # before the runs
    env = environment()
    env["torch_threads"] = args.threads  # each measured at its own count, set by `measure`
    ms, choice = {}, {}
    for threads in args.threads:
        ms[threads] = measure(threads, args.rounds)
        choice[threads] = picked()
        print(f"{threads} threads: " + ", ".join(f"{n} {t:.2f} ms" for n, t in ms[threads].items())
              + f"; aiayn picks {choice[threads]}", file=sys.stderr, flush=True)
    result = {
        "command": command_line(__file__, argv),
        "environment": {**env, "load_average_after": load_average(), "rounds": args.rounds},
        "ms": ms,
        "picked": choice,
    }
    text = markdown(result)
    json_path.write_text(json.dumps(result, indent=1))
    md_path.write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()

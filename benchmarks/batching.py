"""Seconds and memory `token_batches` takes to cut a corpus of WMT14 En-De's size (4.5 M pairs) into
batches of the paper's 25,000 tokens, as every process of a training run does once before its first update.

The lengths are drawn uniformly from 5 to 80 pieces per side (a seeded generator), the corpus itself is not
needed. The figure is this machine's: compare it with a run of an older commit (`git worktree`) here.

    python benchmarks/batching.py                    # 4.5 M pairs, max_tokens 25000
    python benchmarks/batching.py --pairs 1000000 --max-tokens 4096
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from aiayn.data.batching import token_batches
from aiayn.errors import UserError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import at_least, command_line, environment, status_kib

# 20x WMT14 En-De's pairs, 2.5x En-Fr's 36 M: about 7 GiB at the ~88 bytes a pair RESULTS.md measured
MAX_PAIRS = 90_000_000


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # -1 was a numpy ValueError traceback, 99999999999999 its _ArrayMemoryError's
    p.add_argument("--pairs", type=at_least(1, maximum=MAX_PAIRS), default=4_500_000,
                   help=f"pairs of random lengths (default 4,500,000, WMT14 En-De's; at most {MAX_PAIRS:,})")
    p.add_argument("--max-tokens", type=at_least(1), default=25_000,
                   help="padded tokens a side a batch holds at most, train.max_tokens (default 25,000, the "
                        "paper's)")
    args = p.parse_args(argv)
    print(command_line(__file__, argv))
    print(f"environment: {environment()}")
    rng = np.random.default_rng(0)
    # as training passes them (EncodedCorpus.src_lengths: Python lists)
    src, tgt = rng.integers(5, 81, args.pairs).tolist(), rng.integers(5, 81, args.pairs).tolist()
    before = status_kib("VmRSS")
    start = time.perf_counter()
    try:
        batches = token_batches(src, tgt, args.max_tokens)
    except UserError as e:  # a pair longer than --max-tokens: one line, as batch_fill.py says it
        raise SystemExit(f"batching: {e} (the pairs drawn have 5 to 80 tokens a side)") from None
    seconds = time.perf_counter() - start
    print(f"{args.pairs:,} pairs, max_tokens {args.max_tokens}: {len(batches):,} batches in {seconds:.1f} s; "
          f"peak resident memory {status_kib('VmHWM') / 1024:.0f} MiB ({before / 1024:.0f} MiB before)")


if __name__ == "__main__":
    main()

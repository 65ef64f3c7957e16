"""How many real tokens a batch of `train.max_tokens` padded tokens holds, as `aiayn train` batches a corpus.

`max_tokens` caps each side's padded tokens (its longest sentence times the pairs), as fairseq's
`--max-tokens` does; the paper's batches held "approximately 25000 source tokens and 25000 target tokens".
This prepares the corpus as a training run does (a SentencePiece model and the encoded cache in a scratch
run directory, its progress on stderr as training's), cuts it with `token_batches` for each `max_tokens`,
and reports the real tokens per batch as a share of `max_tokens`, for one process (with several, each cuts
its own share the same way).

    python benchmarks/batch_fill.py                                    # Multi30k en-de in ../shared/data
    python benchmarks/batch_fill.py --src a.en --tgt a.de --max-tokens 4096,25000 --vocab-size 32000
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

import torch

from aiayn.config import ConfigError
from aiayn.data.batching import token_batches
from aiayn.errors import UserError
from aiayn.train import loop
from aiayn.train.config import run_config
from aiayn.train.distributed import Dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import command_line, environment

MULTI30K = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"


def fill(src: list[int], tgt: list[int], max_tokens: int) -> tuple[float, float, int]:
    """(real target, real source) tokens per batch as shares of `max_tokens`, and the number of batches."""
    batches = token_batches(src, tgt, max_tokens)
    real_tgt = sum(tgt) / len(batches)
    real_src = sum(src) / len(batches)
    return real_tgt / max_tokens, real_src / max_tokens, len(batches)


def budgets(text: str) -> list[int]:
    """argparse type: a comma list of positive whole numbers."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each max_tokens must be at least 1")
    return values


def settings(args: argparse.Namespace, run_dir: str) -> dict[str, dict]:
    """The run configuration a training run on --src/--tgt with --vocab-size would prepare its data with."""
    return {"data": {"train_src": args.src, "train_tgt": args.tgt, "vocab_size": args.vocab_size},
            "model": {"preset": "micro"}, "train": {"run_dir": run_dir, "device": "cpu"}}


def flags(args: argparse.Namespace) -> dict[str, str]:
    """Where each setting this script's options give was written: a value the configuration refuses is
    named by its flag (through --set strings it was "--set 'data.vocab_size=0': ...", a flag not here)."""
    return {"data.train_src": f"--src {args.src}", "data.train_tgt": f"--tgt {args.tgt}",
            "data.vocab_size": f"--vocab-size {args.vocab_size}"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", default=str(MULTI30K / "train.en"))
    parser.add_argument("--tgt", default=str(MULTI30K / "train.de"))
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--max-tokens", type=budgets, default=[4096, 6250, 25000], help="a comma list")
    args = parser.parse_args(argv)
    try:  # a missing corpus, a vocabulary or max_tokens the data refuses: one line, not a traceback
        with tempfile.TemporaryDirectory() as run_dir:
            config = run_config(settings(args, run_dir), origins=flags(args))
            data = loop.prepare_data(config, Path(run_dir), Dist(0, 1, 0, torch.device("cpu")))
            src, tgt = data.train.src_lengths(), data.train.tgt_lengths()
            pieces = data.tokenizer.tgt_vocab_size  # SentencePiece makes fewer than asked of a small corpus
        rows = [(m, *fill(src, tgt, m)) for m in args.max_tokens]
    except (UserError, ConfigError) as e:
        raise SystemExit(f"batch_fill: {e}") from None
    print(f"command: {command_line(__file__, argv)}")
    print(f"environment: {environment()}")
    print(f"{args.src}, {args.tgt}: {len(src)} pairs, {pieces} pieces")
    print("| max_tokens | real target tokens a batch | real source tokens a batch | batches |")
    print("|---|---|---|---|")
    for max_tokens, share_tgt, share_src, n in rows:
        print(f"| {max_tokens:,} | {share_tgt:.1%} | {share_src:.1%} | {n} |")


if __name__ == "__main__":
    # stderr, as `aiayn train` logs (cli._log_to_stderr): the tokenizer's training and "encoded N of M
    # pairs", minutes on a WMT-size corpus, were dropped, and the run said nothing until its table
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)
    main()

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
from itertools import islice
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


def too_small(data: loop.Data, max_tokens: int, src_path: str, tgt_path: str) -> UserError:
    """The error for a `max_tokens` below the corpus' longest pair, naming that pair's line and size (its
    longer side, as `token_batches` counts it): token_batches' own, "pair 246 has 10 tokens", named no
    file, and a pair by its place among those kept, not its line."""
    sizes = [max(a, b) for a, b in zip(data.train.src_lengths(), data.train.tgt_lengths())]
    index = max(range(len(sizes)), key=sizes.__getitem__)
    line = file_line(data, index, src_path, tgt_path)
    return UserError(f"--max-tokens {max_tokens}: the longest pair, line {line} of {src_path} and "
                     f"{tgt_path}, has {sizes[index]} tokens a side (with EOS); give at least {sizes[index]}")


def file_line(data: loop.Data, index: int, src_path: str, tgt_path: str) -> int:
    """The line (from 1) of pair `index` (from 0) of the prepared corpus: the pairs dropped before it (a side
    empty or of no pieces, longer than data.max_len) put it further down, so the lines from index + 1 on are
    encoded until one gives its ids."""
    want, tokenizer = (data.train.source(index), data.train.target(index)), data.tokenizer
    # as read_lines reads them (the files are checked already): a BOM dropped, lines ended by LF alone
    with (open(src_path, encoding="utf-8-sig", newline="\n") as s,
          open(tgt_path, encoding="utf-8-sig", newline="\n") as t):
        for line, (a, b) in enumerate(islice(zip(s, t), index, None), index + 1):
            if (tokenizer.encode_src(a.rstrip("\r\n")), tokenizer.encode_tgt(b.rstrip("\r\n"))) == want:
                return line
    raise AssertionError(f"pair {index} of the corpus is in no line of {src_path}, {tgt_path}")


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
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", default=str(MULTI30K / "train.en"),
                        help="source side of the corpus, one sentence a line (default Multi30k's train.en "
                             "in ../shared/data/multi30k)")
    parser.add_argument("--tgt", default=str(MULTI30K / "train.de"),
                        help="target side, line for line (default Multi30k's train.de)")
    parser.add_argument("--vocab-size", type=int, default=8000,
                        help="the SentencePiece vocabulary to train, data.vocab_size (default 8000)")
    parser.add_argument("--max-tokens", type=budgets, default=[4096, 6250, 25000],
                        help="a comma list of train.max_tokens to cut at (default 4096,6250,25000)")
    args = parser.parse_args(argv)
    env = environment()  # before the work: the load average is the machine's, not this script's own
    try:  # a missing corpus, a vocabulary or max_tokens the data refuses: one line, not a traceback
        with tempfile.TemporaryDirectory() as run_dir:
            config = run_config(settings(args, run_dir), origins=flags(args))
            data = loop.prepare_data(config, Path(run_dir), Dist(0, 1, 0, torch.device("cpu")))
            src, tgt = data.train.src_lengths(), data.train.tgt_lengths()
            pieces = data.tokenizer.tgt_vocab_size  # SentencePiece makes fewer than asked of a small corpus
            if min(args.max_tokens) < max(max(src), max(tgt)):
                raise too_small(data, min(args.max_tokens), args.src, args.tgt)
        rows = [(m, *fill(src, tgt, m)) for m in args.max_tokens]
    except (UserError, ConfigError) as e:
        raise SystemExit(f"batch_fill: {e}") from None
    print(f"command: {command_line(__file__, argv)}")
    print(f"environment: {env}")
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

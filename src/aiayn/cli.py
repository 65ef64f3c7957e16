"""The `aiayn` command: argparse subcommands, each one library call.

Errors the user can fix (a bad file, a bad config, a bad checkpoint) are `UserError`s or
`ConfigError`s: they print one line, `aiayn: error: ...`, and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

from aiayn.config import PRESETS, ConfigError, model_config
from aiayn.errors import UserError


def cmd_info(args: argparse.Namespace) -> None:
    """Print a preset's resolved configuration and its parameter count."""
    from aiayn.model import Transformer

    config = model_config(args.preset, vocab_size=args.vocab_size)
    print(config)
    print(f"parameters: {Transformer(config).num_parameters():,}")


def _log_to_stderr() -> None:
    import logging
    import os

    rank = os.environ.get("RANK")
    fmt = f"%(asctime)s {'[rank ' + rank + '] ' if rank else ''}%(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt="%H:%M:%S", stream=sys.stderr)


def cmd_train(args: argparse.Namespace) -> None:
    """Train with a TOML config and overrides; the same command runs under torchrun."""
    from aiayn.train.config import load_config
    from aiayn.train.loop import train

    _log_to_stderr()
    result = train(load_config(args.config, args.set), resume=args.resume)
    if result.get("valid_loss") is not None:
        print(f"step {result['step']}: valid loss {result['valid_loss']:.4f}, valid NLL {result['valid_nll']:.4f}, "
              f"valid ppl {result['valid_ppl']:.2f} ({result['stop']})")


def cmd_average(args: argparse.Namespace) -> None:
    """Average a run's last K checkpoints (the paper: 5 for base, 20 for big)."""
    from aiayn.train.average import average_last

    _log_to_stderr()
    print(average_last(args.run_dir, args.last, args.output))


def cmd_plot(args: argparse.Namespace) -> None:
    """Draw RUN_DIR/metrics.jsonl as RUN_DIR/curves.png (or --output)."""
    from pathlib import Path

    from aiayn.train.metrics import plot_metrics

    run = Path(args.run_dir)
    print(plot_metrics(run / "metrics.jsonl", args.output or run / "curves.png"))


def cmd_attention(args: argparse.Namespace) -> None:
    """Draw every layer's and head's attention for one sentence pair as PNGs and one HTML page."""
    from aiayn.attention import draw_attention, extract_attention
    from aiayn.checkpoint import load_checkpoint

    ck = load_checkpoint(args.checkpoint)
    maps = extract_attention(ck.model, ck.tokenizer, args.src, args.tgt)
    files = draw_attention(maps, args.out, title=f"attention of {args.checkpoint}: {args.src}")
    for path in files.values():
        print(path)


def cmd_convert(args: argparse.Namespace) -> None:
    """Import another toolkit's model as an aiayn checkpoint (MarianMT / OPUS-MT)."""
    from aiayn.interop.marian import convert_marian

    _log_to_stderr()
    print(convert_marian(args.source, args.out))


def cmd_export(args: argparse.Namespace) -> None:
    """Write an aiayn checkpoint as a CTranslate2 model directory."""
    try:
        from aiayn.interop.ct2 import export_ctranslate2
    except ImportError as e:
        raise UserError(f"export --to ctranslate2 needs the ctranslate2 package: pip install 'aiayn[interop]' ({e})")
    print(export_ctranslate2(args.checkpoint, args.out, args.quantization, args.force))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiayn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="show a model preset and its parameter count")
    p.add_argument("--preset", default="base", choices=sorted(PRESETS))
    p.add_argument("--vocab-size", type=int, default=37000)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("train", help="train on parallel text (also under torchrun --nproc_per_node N)")
    p.add_argument("--config", help="TOML file with [model], [data], [train] (see configs/)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set train.max_tokens=2048 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("average", help="average the last K checkpoints of a run")
    p.add_argument("run_dir")
    p.add_argument("--last", type=int, default=5, help="how many (the paper: 5 for base, 20 for big)")
    p.add_argument("-o", "--output", help="output checkpoint directory (default RUN_DIR/average_last_K)")
    p.set_defaults(func=cmd_average)

    p = sub.add_parser("plot", help="draw a run's training curves as a PNG")
    p.add_argument("run_dir")
    p.add_argument("-o", "--output", help="PNG path (default RUN_DIR/curves.png)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("attention", help="draw a checkpoint's attention maps for one sentence (PNG + HTML)")
    p.add_argument("--checkpoint", required=True, help="an aiayn checkpoint directory (trained or imported)")
    p.add_argument("--src", required=True, help="source sentence")
    p.add_argument("--tgt", help="target sentence to force (default: the model's greedy translation)")
    p.add_argument("--out", default="attention", help="output folder (default ./attention)")
    p.set_defaults(func=cmd_attention)

    p = sub.add_parser("convert", help="import a MarianMT (OPUS-MT) directory as an aiayn checkpoint")
    p.add_argument("--from", dest="source_format", required=True, choices=["marian"],
                   help="the format of SOURCE: marian = a HuggingFace MarianMT directory")
    p.add_argument("source", metavar="SOURCE", help="local directory: config.json, model.safetensors or "
                   "pytorch_model.bin, source.spm, target.spm, vocab.json")
    p.add_argument("out", metavar="OUT", help="aiayn checkpoint directory to write")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("export", help="write an aiayn checkpoint for another runtime (CTranslate2)")
    p.add_argument("--to", dest="target_format", required=True, choices=["ctranslate2"])
    p.add_argument("checkpoint", metavar="CKPT", help="an aiayn checkpoint directory (trained or imported)")
    p.add_argument("out", metavar="OUT", help="output model directory")
    p.add_argument("--quantization", help="CTranslate2 weight type: int8, int8_float16, float16, bfloat16...")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=cmd_export)

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (UserError, ConfigError) as e:
        print(f"aiayn: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aiayn: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

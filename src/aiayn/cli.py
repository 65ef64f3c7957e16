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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiayn", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="show a model preset and its parameter count")
    p.add_argument("--preset", default="base", choices=sorted(PRESETS))
    p.add_argument("--vocab-size", type=int, default=37000)
    p.set_defaults(func=cmd_info)

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

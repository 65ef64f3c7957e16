"""The `aiayn` command: argparse subcommands, each one library call.

Errors the user can fix (a bad file, a bad config, a bad checkpoint) are `UserError`s or
`ConfigError`s: they print one line, `aiayn: error: ...`, and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

from aiayn import __version__
from aiayn.config import (
    DEFAULT_MAX_TOKENS,
    MAX_IDS,
    MAX_THREADS,
    PRESETS,
    ConfigError,
    ModelConfig,
    model_config,
)
from aiayn.errors import Stopped, Terminated, UserError, non_utf8_name, on_an_errors_way_out

if TYPE_CHECKING:  # annotations only: each command imports what it uses, so the CLI starts fast
    from pathlib import Path


# CTranslate2's weight types (ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES, 4.x), listed here so
# that `aiayn --help` and a wrong name need no ctranslate2 import and no loading
CT2_QUANTIZATIONS = ["int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16",
                     "float32"]


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (argparse turns the ValueError into a usage error)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


positive_int.__name__ = "positive integer"  # argparse's message: "invalid positive integer value: '0'"


def resamples(text: str) -> int:
    """argparse type of `evaluate --confidence [N]`, whose optional N takes the next word: `--confidence
    HYP REF` read HYP as N, "invalid int value: 'HYP'"."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of resamples (N); put --confidence after "
                                         "HYP and REF, or give N") from None


def path_arg(text: str) -> str:
    """argparse type: a file or directory name, not empty (`-o ""` said ": cannot write")."""
    if not text:
        raise ValueError(text)
    return text


path_arg.__name__ = "path"  # argparse's message: "invalid path value: ''"


def number_list(text: str) -> tuple[int, ...]:
    """argparse type: "1,6" -> (1, 6), each a whole number >= 1."""
    return tuple(positive_int(part) for part in text.split(","))


number_list.__name__ = "comma-separated list of positive integers"


def cmd_info(args: argparse.Namespace) -> None:
    """Print a preset's resolved configuration and its parameter count, or describe a checkpoint."""
    import torch

    from aiayn.model import Transformer

    preset = _info_preset(args)
    if preset is None:
        from aiayn.checkpoint import describe_checkpoint

        print("\n".join(describe_checkpoint(args.what)))
        return
    vocab_size = args.vocab_size or 37000
    # a preset has ModelConfig's special ids, aiayn's tokenizers' (pad 0, BOS 1, EOS 2): --vocab-size 2 was
    # "ModelConfig: eos_id=2 is outside the vocabulary of 2", which named no flag
    fewest = max(ModelConfig.pad_id, ModelConfig.decoder_start_id, ModelConfig.eos_id) + 1
    if not fewest <= vocab_size <= MAX_IDS:
        raise UserError(f"info: --vocab-size {vocab_size} is not in {fewest} to {MAX_IDS:,} (ids 0 to "
                        f"{fewest - 1} are pad, BOS and EOS)")
    config = model_config(preset, vocab_size=vocab_size)
    print(config)
    with torch.device("meta"):  # shapes only: a billion-word vocabulary would allocate 128 GB, or OOM-kill
        model = Transformer(config)
    print(f"parameters: {model.num_parameters():,}")


def _info_preset(args: argparse.Namespace) -> str | None:
    """The preset `aiayn info` shows, or None for the checkpoint directory `args.what` names. A checkpoint
    directory named like a preset ("base") is a checkpoint; a name that is neither is one line."""
    from pathlib import Path

    from aiayn.checkpoint import is_checkpoint
    from aiayn.files import moved_aside

    if args.what is not None and args.preset is not None:
        both = f"{args.what!r} and --preset {args.preset}"
        raise UserError(f"info: give a preset or a checkpoint, not both ({both})")
    if args.what is None:
        return args.preset or "base"
    if args.what in PRESETS and not Path(args.what).exists():
        return args.what
    if args.what in PRESETS and not is_checkpoint(Path(args.what)):  # a damaged one was shown as the preset
        raise UserError(f"info: {args.what} exists here but is no checkpoint directory; for the preset, "
                        f"give --preset {args.what}")
    if args.vocab_size is not None:
        raise UserError(f"info: --vocab-size sizes a preset; {args.what} is described as saved")
    # a bare name that names nothing here is as likely a preset mistyped ("transformer-big", "base "): only
    # an identifier ("BIG") was said so. A path (a folder in it) is a checkpoint's, and one a killed save
    # left moved aside is named where checkpoints are looked for (`checkpoint.not_found`).
    path = Path(args.what)
    if not path.exists() and path.name == args.what and moved_aside(path) is None:
        raise UserError(f"info: {args.what!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                        "nor a checkpoint directory")
    return None


def _job_rank(command: str | None) -> int | None:
    """This process's rank in a torchrun job, None outside one. Only `train` runs in one (`demo` refuses
    to, in one line): a RANK left in the environment silenced every command's errors, and without
    torchrun's WORLD_SIZE and MASTER_ADDR it is no job's (train refuses it, in a line this process must
    say)."""
    if command not in ("train", "demo") or not os.environ.get("MASTER_ADDR"):
        return None
    try:
        world_size, rank = int(os.environ.get("WORLD_SIZE") or 1), int(os.environ.get("RANK") or 0)
        local_rank = int(os.environ.get("LOCAL_RANK") or 0)
    except ValueError:  # train refuses it, in one line
        return None
    if world_size < 2 or not (0 <= rank < world_size and 0 <= local_rank < world_size):
        return None  # setup refuses a rank outside the job: said by this process
    return rank


def _log_to_stderr(rank: int | None = None) -> None:
    """Log lines to stderr; under torchrun (`rank` in the job) tagged with the process, and rank 0's alone
    below WARNING."""
    import logging

    from aiayn.train.progress import LineFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter("" if rank is None else f"[rank {rank}] "))
    level = logging.INFO if not rank else logging.WARNING
    logging.basicConfig(level=level, handlers=[handler])


def cmd_train(args: argparse.Namespace) -> None:
    """Train with a TOML config and overrides; the same command runs under torchrun."""
    from aiayn.train.config import load_config
    from aiayn.train.distributed import SameOnEveryProcess
    from aiayn.train.loop import train

    rank = _job_rank("train")
    _log_to_stderr(rank)
    try:
        config = load_config(args.config, args.set)
    except UserError as e:  # read alike by every process of a machine: said once there (it was said by each)
        raise SameOnEveryProcess(str(e)) from None
    if args.config is None and (unnamed := config.unnamed_training_files()):
        # train's own refusal names the settings alone: `aiayn train` with no arguments never said --config
        raise ConfigError(f"{unnamed} (give --config FILE, a TOML file such as configs/tiny.toml, or --set "
                          "data.train_src=FILE --set data.train_tgt=FILE)")
    result = train(config, resume=args.resume)
    # torchrun: rank 0 speaks; a closed stdout (pythonw, `>&-`) loses the summary, not days of training
    if not rank and not getattr(sys.stdout, "closed_at_start", False):
        print(_train_summary(result))


def _train_summary(result: dict) -> str:
    """`aiayn train`'s one line on stdout, also for a run without a validation set or a resumed one that
    trained nothing (which printed none): the step, the last validation, why it stopped, and the best
    checkpoint (the one pruning keeps), e.g. "step 250: valid loss 5.3537, valid NLL 5.0450, valid ppl
    155.24 (max_updates=250); best checkpoint runs/tiny/checkpoints/step_000250"."""
    from aiayn.train.metrics import shown_ppl  # a bound past the cap (exp(50) was printed as the value)

    line = f"step {result['step']}"
    if all(k in result for k in ("valid_loss", "valid_nll", "valid_ppl")):
        line += (f": valid loss {result['valid_loss']:.4f}, valid NLL {result['valid_nll']:.4f}, "
                 f"valid ppl {shown_ppl(result['valid_nll'], 2)}")
    line += f" ({result['stop']})"
    if "best_checkpoint" in result:
        line += f"; best checkpoint {result['best_checkpoint']}"
    return line


def cmd_average(args: argparse.Namespace) -> None:
    """Average a run's last K checkpoints (the paper: 5 for base, 20 for big)."""
    from aiayn.train.average import average_last

    _log_to_stderr()
    print(average_last(args.run_dir, args.last, args.output, args.force))  # outside checkpoints: it checks


def cmd_plot(args: argparse.Namespace) -> None:
    """Draw RUN_DIR/metrics.jsonl as RUN_DIR/curves.png (or --output); several runs' overlaid, as -o."""
    from pathlib import Path

    from aiayn.train.metrics import plot_metrics

    runs = [Path(run) for run in args.run_dirs]
    if len(runs) > 1 and not args.output:  # no run's curves.png, which is its own (training redraws it)
        raise UserError(f"{len(runs)} runs drawn together: name their picture with -o FILE.png")
    for run in runs:
        _check_plottable(run)
    # "names a directory; give the picture's file name": none was given
    if not args.output and (runs[0] / "curves.png").is_dir():
        raise UserError(f"{runs[0] / 'curves.png'}: is a directory, not a picture; draw elsewhere with "
                        "-o FILE.png")
    with _warnings_to_stderr("aiayn.train.metrics"):  # a value not drawn, a cut last line: said as warnings
        print(plot_metrics([run / "metrics.jsonl" for run in runs], args.output or runs[0] / "curves.png",
                           log_scale=args.log))


def _check_plottable(run: Path) -> None:
    """What RUN_DIR is when it holds no metrics.jsonl: "no metrics log" sent a user who had typed the right
    run directory (one that had trained, but not yet logged) looking for the wrong one."""
    from aiayn.checkpoint import is_checkpoint
    from aiayn.train.state import runs_meant

    if run.is_file():  # `plot runs/x/metrics.jsonl` was told runs/x/metrics.jsonl/metrics.jsonl is missing
        raise UserError(f"{run}: a file; give the run directory, the folder that holds metrics.jsonl")
    if (run / "metrics.jsonl").exists():
        return
    if not run.is_dir():
        raise UserError(f"{run}: no such run directory")
    if is_checkpoint(run):
        raise UserError(f"{run}: a checkpoint; give its run directory, the folder that holds metrics.jsonl")
    # `plot demo` (the demo prints demo/run/curves.png) and `plot run1/checkpoints` said "no metrics log"
    for inner in runs_meant(run):
        if (inner / "metrics.jsonl").is_file():
            raise UserError(f"{run}: no metrics.jsonl here; the run directory is {inner}")
    if any((run / name).exists() for name in (".lock", "cache", "checkpoints")):  # a run's, however young
        raise UserError(f"{run}: no metrics logged yet (the first come after train.log_every updates)")
    # no run: `plot .` said "metrics.jsonl: no metrics log", naming no folder
    where = f"{run} ({run.resolve()})" if run.name in ("", "..") else str(run)
    raise UserError(f"{where}: no metrics.jsonl here; give a training run's directory (its train.run_dir)")


def cmd_attention(args: argparse.Namespace) -> None:
    """Draw every layer's and head's attention for one sentence pair as PNGs and one HTML page."""
    from aiayn.attention import check_out_dir, check_selection, draw_attention, extract_attention
    from aiayn.checkpoint import load_checkpoint
    from aiayn.files import directory_for

    _log_to_stderr()  # e.g. label characters that no installed font has
    out = check_out_dir(args.out)  # before loading and running the model, not after
    # made before the work too, and removed again if it fails: root may write anywhere, so /sys/maps passed
    # the check and failed making the folder after the drawing
    with directory_for(out, out):
        ck = load_checkpoint(args.checkpoint)
        config = ck.model.config  # a layer or head the model lacks, said before its greedy translation runs
        check_selection(args.layers, args.heads, max(config.n_layers, config.decoder_layers), config.n_heads)
        maps = extract_attention(ck.model, ck.tokenizer, args.src, args.tgt).select(args.layers, args.heads)
        files = draw_attention(maps, args.out, title=f"attention of {args.checkpoint}: {args.src}")
    for path in files.values():
        print(path)


def cmd_demo(args: argparse.Namespace) -> None:
    """Train a small Transformer on built-in English -> German numbers and dates, then test it."""
    from aiayn.demo import DemoConfig, run_demo

    if _job_rank("demo") is not None:  # each process made the corpus, translated and drew into one --out
        from aiayn.train.distributed import SameOnEveryProcess

        job = os.environ["WORLD_SIZE"]
        said = SameOnEveryProcess if os.environ.get("LOCAL_RANK", "0") != "0" else UserError  # once a machine
        raise said(f"demo runs in one process, not in a torchrun job of {job}: run `aiayn demo` alone "
                   "(`torchrun ... -m aiayn train` trains in several)")
    _log_to_stderr()
    given = dict(out=args.out, seed=args.seed, size=args.size, steps=args.steps, minutes=args.minutes,
                 n_train=args.train_pairs, n_test=args.test_pairs, beam=args.beam, device=args.device)
    config = DemoConfig(**{k: v for k, v in given.items() if v is not None})  # None: the demo's default
    r = run_demo(config)
    print(f"held-out exact match: {r.correct}/{r.total} = {100 * r.accuracy:.1f}% "
          f"(beam {config.beam}, {r.steps} update{'s'[: r.steps != 1]}, {r.train_seconds:.0f} s of training)")
    for source, reference, hypothesis in r.examples:
        print(f"  {'ok ' if hypothesis == reference else 'BAD'} {source}  ->  {hypothesis}"
              + ("" if hypothesis == reference else f"  (reference: {reference})"))
    for name, path in r.files.items():
        print(f"{name}: {path}")
    print(f"checkpoint: {r.checkpoint}")


def cmd_convert(args: argparse.Namespace) -> None:
    """Import another toolkit's model as an aiayn checkpoint (MarianMT / OPUS-MT)."""
    from aiayn.interop.marian import convert_marian

    _log_to_stderr()
    print(convert_marian(args.source, args.out, force=args.force))  # --force: an earlier checkpoint only


def cmd_export(args: argparse.Namespace) -> None:
    """Write an aiayn checkpoint as a CTranslate2 model or a HuggingFace MarianMT directory."""
    if args.target_format == "marian":
        if args.quantization is not None:  # before the checkpoint loads; said, not ignored
            raise UserError("--quantization applies to --to ctranslate2 only (a MarianMT export is always "
                            "float32)")
        from aiayn.interop.marian_export import export_marian

        _log_to_stderr()
        print(export_marian(args.checkpoint, args.out, args.force))
        return
    try:
        from aiayn.interop.ct2 import export_ctranslate2
    except ImportError as e:
        raise UserError(f"export --to ctranslate2 needs the ctranslate2 package: pip install 'aiayn[interop]' ({e})")
    _log_to_stderr()  # the notes convert gives: an earlier export put back, a killed one's temporary removed
    print(export_ctranslate2(args.checkpoint, args.out, args.quantization, args.force))  # outside checkpoints


def cmd_translate(args: argparse.Namespace) -> None:
    """Translate INPUT (or stdin) to OUTPUT (or stdout), one line per line, in input order."""
    import torch

    from aiayn.files import atomic_output, check_not_read_back
    from aiayn.memory import keep_freed_memory
    from aiayn.translate import Translator, decode_config, translate_stream

    _check_threads(args.threads)
    if args.lenpen is not None and args.lenpen_kind == "none":  # lp(|Y|) = 1 whatever alpha is
        raise UserError(f"--lenpen {args.lenpen} has no effect with --lenpen-kind none; drop one of them")
    options = dict(lenpen_kind=args.lenpen_kind, max_len_a=args.max_len_a, max_len_b=args.max_len_b,
                   min_len=args.min_len, n_best=args.n_best, sample=args.sample,
                   early_stopping=args.early_stopping)
    # None unless given: DecodeConfig's defaults then (a beam left out is 1 with --sample, see decode_config),
    # and a sampling option given without --sample is refused rather than ignored
    given = {"beam": args.beam, "lenpen": args.lenpen, "temperature": args.temperature, "top_k": args.top_k,
             "top_p": args.top_p, "seed": args.seed}
    for name in ("temperature", "top_k", "top_p", "seed"):  # DecodeConfig sees values, not which were given
        if given[name] is not None and not args.sample:
            raise UserError(f"--{name.replace('_', '-')} {given[name]} needs --sample (a search ignores it)")
    options.update({k: v for k, v in given.items() if v is not None})
    with _settings_as_flags():
        chosen = decode_config(**options)  # a contradiction (n_best > beam...) fails before any loading
    if args.lenpen is not None and chosen.beam == 1 and chosen.n_best == 1:  # as --lenpen-kind none's
        raise UserError(f"--lenpen {args.lenpen} has no effect with one output a line and no beam (greedy "
                        "search and sampling rank nothing; --n-best's SCORE uses it): drop it")
    if args.compile and chosen.beam > 1:  # else 10-40 s of compiling for a step beam search never takes
        beam = f"--beam {chosen.beam}" if args.beam is not None else f"beam {chosen.beam}, the default"
        raise UserError(f"--compile compiles the step of greedy search and sampling; beam search ({beam}) "
                        "decodes as without it: add --beam 1 or --sample, or drop --compile")
    _check_streams(args.input, args.output)  # before the model loads and translates for nothing
    check_not_read_back([args.input], args.output)
    if args.output not in (None, "-"):  # never over the input or a checkpoint's file
        from pathlib import Path

        from aiayn.files import check_file_output

        check_file_output(args.output, [Path(p) for p in [*args.checkpoint, args.input or "-"] if p != "-"])
        _check_not_stdin(args.input, Path(args.output))
        _check_outside_checkpoints(Path(args.output))
    keep_freed_memory()  # each batch re-allocates the same logits, caches and encoder states
    if args.threads:
        torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as stack:
        # a missing input or folder for -o fails now, not after the loading (and --compile's 10-40 s)
        src, name = _open_input(stack, args.input)
        dst = sys.stdout
        if args.output not in (None, "-"):  # complete or untouched: a failed run leaves no half file
            dst = stack.enter_context(atomic_output(args.output))
        if args.compile:  # a file's bad line (UTF-8, a NUL) is found before 10-40 s of compiling, not after
            with _warnings_to_stderr("aiayn.data.lines"):  # (its CRs inside lines said now, once)
                _checked_line_count(src, name)
        with _warnings_to_stderr("aiayn.decoding.compiled", notes=True):  # --compile says why 10-40 s pass
            translator = Translator.load(args.checkpoint, args.device, int8=args.int8, dtype=args.dtype,
                                         compile=args.compile)
        stack.enter_context(_settings_as_flags())
        stack.enter_context(_warnings_to_stderr("aiayn.data.lines"))  # the input's CRs inside lines
        translator.decode_config(**options)  # what only the model can tell (--min-len), before any reading
        # a regular file: a bad line fails now, not chunks later; a too long one too
        total = _checked_line_count(src, name, translator.source_ids)
        progress = None
        # A named input shows progress on stderr; stdin is a filter's input (`cat in | aiayn translate`, or
        # typed lines), whose stderr carries errors only, -o or not; `-i /dev/stdin` reads it with progress
        if name != "<stdin>" and not args.quiet:
            progress = _progress(stack, total, "line", "translated")
        chunk = 1 if name == "<stdin>" and src.isatty() else args.chunk  # interactive: answer each line
        translate_stream(translator, src, dst, name, chunk, args.max_tokens, progress, **options)


def cmd_score(args: argparse.Namespace) -> None:
    """Write log P(target | source) of each line pair of --src and --tgt, one per line."""
    from pathlib import Path

    import torch

    from aiayn.data.lines import require_same_count
    from aiayn.files import atomic_output, check_file_output, check_not_read_back, reads_stdin_once
    from aiayn.memory import keep_freed_memory
    from aiayn.translate import Translator, score_stream

    _check_threads(args.threads)
    if reads_stdin_once(args.src) and reads_stdin_once(args.tgt):  # /dev/stdin's second read: 0 lines
        raise UserError(f"--src {args.src} and --tgt {args.tgt} cannot both be standard input")
    reads = "-" if "-" in (args.src, args.tgt) else args.src  # standard input, or a file
    check_not_read_back([args.src, args.tgt], args.output)
    if args.output not in (None, "-"):
        check_file_output(args.output, [Path(p) for p in [*args.checkpoint, args.src, args.tgt] if p != "-"])
        _check_not_stdin(reads, Path(args.output))
        _check_outside_checkpoints(Path(args.output))
    _check_streams(reads, args.output, f"{'--src' if args.src == '-' else '--tgt'} FILE")
    keep_freed_memory()  # each batch re-allocates the same logits and caches, as translate's
    if args.threads:
        torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_warnings_to_stderr("aiayn.translate"))
        stack.enter_context(_warnings_to_stderr("aiayn.data.lines"))  # the inputs' CRs inside lines
        streams = [_open_input(stack, path) for path in (args.src, args.tgt)]
        counts = [_checked_line_count(s, name, done="scored") for s, name in streams]  # None for a pipe
        if None not in counts:  # before the model loads and scores for nothing
            (_, src_name), (_, tgt_name) = streams
            require_same_count(src_name, counts[0], tgt_name, counts[1])
            if counts[0] == 0:  # score_stream refuses it too (a pipe): before the model loads
                raise UserError(f"{src_name}: empty, nothing to score")
        dst = sys.stdout  # a missing folder for -o fails now, not after the scoring
        if args.output not in (None, "-"):
            dst = stack.enter_context(atomic_output(args.output))
        translator = Translator.load(args.checkpoint, args.device, dtype=args.dtype)
        for (stream, name), side in zip(streams, ("source", "target")):  # a too long line fails now, too
            _checked_line_count(stream, name, lambda lines, side=side: translator.side_ids(lines, side),
                                "scored")
        progress = None
        if not args.quiet:
            progress = _progress(stack, next((c for c in counts if c is not None), None), "pair", "scored")
        (src, src_name), (tgt, tgt_name) = streams
        done = score_stream(translator, src, tgt, dst, (src_name, tgt_name), max_tokens=args.max_tokens,
                            normalize=args.normalize, progress=progress)
    pairs = f"{done.pairs:,} pair{'' if done.pairs == 1 else 's'}"  # at least 1: score_stream refuses none
    tokens = f"{done.tokens:,} target token{'' if done.tokens == 1 else 's'}"  # 1: an empty one's EOS
    print(f"{pairs}, {tokens} (EOS included): log P per token "
          f"{done.log_prob / done.tokens:.4f}, perplexity {done.perplexity:.3f}", file=sys.stderr)


def _progress(
    stack: contextlib.ExitStack, total: int | None, unit: str, done: str
) -> Callable[[int], None] | None:
    """A bar where stderr is a terminal; where it is not (`2>log`) a line every PROGRESS_SECONDS, as
    training's data preparation and the demo give: the bar's carriage-return frames filled the log, its
    last one twice. Without a `total` (a pipe's count unknown) no lines."""
    from tqdm import tqdm

    from aiayn.data.dataset import PROGRESS_SECONDS
    from aiayn.train.progress import throttled_progress

    bar = stack.enter_context(tqdm(total=total, unit=unit, file=sys.stderr, disable=None))  # None: a tty's
    if not bar.disable:
        return bar.update
    if total is None:
        return None

    def say(n: int, percent: float, per_second: float) -> None:
        print(f"aiayn: {done} {n:,} of {total:,} {unit}s ({percent:.0f}%, {per_second:,.0f} {unit}s/s)",
              file=sys.stderr, flush=True)

    return throttled_progress(total, PROGRESS_SECONDS, say)


def _open_input(stack: contextlib.ExitStack, path: str | None) -> tuple[BinaryIO, str]:
    """(binary stream, name for messages) of an input file, or of standard input for None or "-"; the
    file is closed with `stack`."""
    if path in (None, "-"):
        return sys.stdin.buffer, "<stdin>"
    try:
        return stack.enter_context(open(path, "rb")), path
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None


def _check_outside_checkpoints(output: Path) -> None:
    """`train.state.check_outside_checkpoints`, imported when a command needs it (the CLI starts fast)."""
    from aiayn.train.state import check_outside_checkpoints

    check_outside_checkpoints(output)


def _check_not_stdin(input: str | None, output: Path) -> None:
    """`translate CKPT -o f < f`: the shell gave the input file as stdin, which -o would replace."""
    if input not in (None, "-") or sys.stdin is None or not output.exists():
        return
    try:
        same = os.path.samestat(os.fstat(sys.stdin.fileno()), os.stat(output))
    except (OSError, ValueError):  # no file descriptor behind stdin (a notebook, a test's StringIO)
        return
    if same:
        raise UserError(f"{output}: is the input (standard input); writing it would destroy the input")


# A DecodeConfig field and its value in a message, `lenpen=nan`: the flag that set it is `--lenpen nan`
_DECODE_SETTING = re.compile(r"\b(beam|lenpen_kind|lenpen|max_len_a|max_len_b|min_len|n_best|early_stopping|"
                             r"sample|temperature|top_k|top_p|seed)=(\S+?)(?=[,;)]?(?:\s|$))")


def _as_flags(message: str) -> str:
    """A decoding setting's problem in the words of the command line (`DecodeConfig: lenpen=nan must be...`
    as `--lenpen nan must be...`): the README says a setting is named as the flag with its value."""

    def flag(m: re.Match) -> str:
        name = "--" + m[1].replace("_", "-")
        return name if m[2] == "True" else f"{name} {m[2]}"  # sample=True: --sample

    flagged = _DECODE_SETTING.sub(flag, message.removeprefix("DecodeConfig: "))
    return flagged.replace("--sample (--sample)", "--sample")


@contextlib.contextmanager
def _settings_as_flags():
    """Decoding settings named as flags, in an error raised inside and in aiayn.translate's warnings."""
    with _warnings_to_stderr("aiayn.translate", reword=_as_flags):
        try:
            yield
        except ConfigError as e:
            raise ConfigError(_as_flags(str(e))) from None


@contextlib.contextmanager
def _warnings_to_stderr(logger_name: str, reword: Callable[[str], str] = str, notes: bool = False):
    """The warnings of a library module, each a line that starts `aiayn: warning:`, as the command's
    other messages start `aiayn:` (else Python printed the bare message), its format passed through
    `reword` (translate: a decoding setting as its flag); with `notes` its INFO lines too, each
    `aiayn: note:`."""
    import logging

    class Prefixed(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            kind = "warning" if record.levelno >= logging.WARNING else "note"
            # the format alone: its arguments are the user's text (a line, a file name), as written
            return f"aiayn: {kind}: " + (reword(str(record.msg)) % record.args if record.args else
                                         reword(record.getMessage()))

    handler = logging.StreamHandler(sys.stderr)  # the stderr of now: a test's captured one too
    handler.setFormatter(Prefixed())
    logger = logging.getLogger(logger_name)
    level = logger.level
    if notes and not logger.isEnabledFor(logging.INFO):  # else INFO stops at the logger, before any handler
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _check_threads(threads: int | None) -> None:
    if threads and threads > MAX_THREADS:  # libgomp failed, or crashed (a segfault), creating them
        raise UserError(f"--threads {threads} is more than {MAX_THREADS:,}")


def _check_streams(input: str | None, output: str | None, input_option: str = "-i") -> None:
    """A closed stdin or stdout that the command would use, or an output that is a directory."""
    if input in (None, "-") and sys.stdin is None:
        raise UserError(f"<stdin>: closed; give an input file with {input_option}")
    if output in (None, "-") and getattr(sys.stdout, "closed_at_start", sys.stdout is None):
        raise UserError("<stdout>: closed; give an output file with -o")
    if output not in (None, "-") and os.path.isdir(output):
        raise UserError(f"{output}: is a directory; -o names the output file")
    if output not in (None, "-") and output.endswith("/"):  # open("x/", "w") refuses; a rename did not
        raise UserError(f"{output}: ends with '/', a folder's name; -o names the output file")


def _checked_line_count(src, name: str, check: Callable[[list[str]], object] | None = None,
                        done: str = "translated") -> int | None:
    """The lines of a regular file, counted and checked as translating reads them (UTF-8, no NUL, and
    `check`, which raises a `TextError` indexed in the lines it gets), then back to where it was: invalid
    UTF-8 or a too long sentence at line 3,001 is found before any line is translated, not after 3,000
    were and then thrown away. None for a pipe, a FIFO or `<(...)`, which can be read only once (a
    progress bar without a total then). CRs inside lines are warned about here (`done`: what the command
    does with the lines), before any line is translated, and not again as they are. Too long sentences are
    named in one error, the first and the others of the whole file (`TextError.others`): one each, fixed
    one a run, took k runs for k of them."""
    from aiayn.errors import SentenceTooLong, TextError
    from aiayn.translate import is_regular_file, read_utf8_lines

    if not (is_regular_file(src) and src.seekable()):
        return None
    start, total = src.tell(), 0
    too_long: SentenceTooLong | None = None  # the first, to which later chunks' are added
    try:
        for lines in read_utf8_lines(src, name, 10_000, whole_chunks=True, done=done):
            try:
                if check is not None:
                    check(lines)
            except SentenceTooLong as e:
                e.located(name, total)
                too_long = too_long.with_others([e.index, *e.others]) if too_long else e
            except TextError as e:
                raise e.located(name, total) from None
            total += len(lines)
    except UserError:
        if too_long is None:
            raise
        too_long.read = total  # a line that cannot be read after a too long one: the earlier is named, its
        # others those of the lines read
        raise too_long.with_others([]) from None
    if too_long is not None:
        raise too_long from None
    src.seek(start)
    return total


def cmd_evaluate(args: argparse.Namespace) -> None:
    """Print sacreBLEU BLEU, chrF and the lowercased BLEU of a translation file, with signatures."""
    import json

    from aiayn.errors import SettingError
    from aiayn.evaluate import read_hypotheses, score_lines, unspaced_hint

    # the files' CRs inside lines; a --tokenize other than -l's
    with _warnings_to_stderr("aiayn.data.lines"), _warnings_to_stderr("aiayn.evaluate"):
        hyps = read_hypotheses(args.hypotheses)  # once: standard input cannot be read twice
        try:
            scores = score_lines(hyps, args.hypotheses, args.references, args.lang, args.tokenize,
                                 chrf_word_order=args.chrf_word_order, ter=args.ter,
                                 confidence=args.confidence)
        except SettingError as e:  # `confidence=1` names the library's parameter; the user typed a flag
            raise UserError(e.as_flag()) from None
    note = unspaced_hint(hyps, args.lang, args.tokenize, ter=args.ter, chrf_word_order=args.chrf_word_order)
    if note:  # Chinese scored with 13a: BLEU near 0 however good the translation; or TER of one word a line
        print(f"aiayn: note: {note}", file=sys.stderr)
    for i, ref in enumerate(args.references):  # `evaluate test.de test.de`, a slip of the shell's history:
        if _same_file(args.hypotheses, ref):  # 100, silently
            print(f"aiayn: note: {ref} is the hypotheses' file itself: it is scored against itself",
                  file=sys.stderr)
        elif earlier := next((r for r in args.references[:i] if _same_file(r, ref)), None):  # (or a link)
            print(f"aiayn: note: {ref} is {earlier} again: one reference counted twice (the signatures say "
                  f"nrefs:{len(args.references)})", file=sys.stderr)
    if args.json:
        # "ci" only with --confidence: scripts that read the default JSON see what they saw before
        print(json.dumps([{k: v for k, v in s.__dict__.items() if k != "ci" or v is not None} for s in scores],
                         indent=2))
        return
    for s in scores:
        ci = "" if s.ci is None else f" (95% CI +/- {s.ci:.2f})"
        print(f"{s.name}: {s.score:.2f}{ci}\n  {s.detail}\n  signature: {s.signature}")


def _same_file(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name one file (a link or another spelling included); "-" names standard
    input's (`evaluate - ref < ref`, `evaluate - /dev/stdin < ref`)."""
    try:
        return os.path.samestat(*(os.fstat(sys.stdin.fileno()) if p == "-" else os.stat(p) for p in (a, b)))
    except (OSError, ValueError, AttributeError):  # one is missing (said by the scoring), or holds a NUL;
        return False  # stdin closed at start (None), or with no descriptor (a test's StringIO)


class _Parser(argparse.ArgumentParser):
    """argparse with the project's one-line errors: `aiayn translate: error: argument --chunk: ...`, exit 2,
    without the usage block (a dozen lines for translate) that argparse prints first; --help has it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """argparse's, but an unknown option is named by the command that does not know it: `aiayn score
        --int8` said "aiayn: error: unrecognized arguments: --int8 (see aiayn --help)"."""
        words = list(sys.argv[1:] if args is None else args)
        parsed, extra = self.parse_known_args(words, namespace)
        if extra:
            command = getattr(parsed, "command", None)
            after = command in words and words.index(extra[0]) > words.index(command)  # not `aiayn --x info`
            prog = f"{self.prog} {command}" if after else self.prog
            self.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extra)} (see {prog} --help)\n")
        return parsed


class _Once(argparse.Action):
    """An option given at most once: a second `--config` silently replaced the first, where a user may
    have meant both files to count (and `attention --checkpoint a --checkpoint b` drew b alone, where
    translate would have taken both as an ensemble). `hint` says what to do instead."""

    def __init__(self, *args, hint: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given", {})  # not the value: an option may have a default
        if self.dest in given:
            parser.error(f"{option_string} given twice ({given[self.dest]}, {values}): {self.hint}")
        given[self.dest] = values
        setattr(namespace, self.dest, values)


class _Refused(argparse.Action):
    """An option of a peer tool that argparse would misread, refused with `reason`: sacreBLEU's -lc
    (lowercase) was read as `-l c`, "-l 'c' is not a language code". Not in --help."""

    def __init__(self, *args, reason: str = "", **kwargs):
        super().__init__(*args, nargs=0, help=argparse.SUPPRESS, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.reason}")


# `aiayn --help`'s first line, for users (pyproject.toml's description); the module docstring is developers'
DESCRIPTION = ("The Transformer of 'Attention Is All You Need': train, translate, score and inspect, from a "
               "laptop CPU to many GPUs")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="aiayn", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="show a model preset and its parameter count, or describe a checkpoint")
    p.add_argument("what", type=path_arg, nargs="?", metavar="PRESET_OR_CHECKPOINT",
                   help=f"a preset ({', '.join(sorted(PRESETS))}; default base) or a checkpoint directory: "
                        "its model, parameters, tokenizer and where it came from (training, average, "
                        "conversion)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="the same as naming the preset")
    p.add_argument("--vocab-size", type=positive_int,
                   help="a preset's shared vocabulary (default 37000; at least 3: pad, BOS and EOS)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("train", help="train on parallel text (also under torchrun --nproc_per_node N)")
    p.add_argument("--config", type=path_arg, action=_Once, hint="one file; change its values with --set",
                   help="TOML file with [model], [data], [train] (see configs/)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set train.max_tokens=2048 (repeatable); "
                        "--set train.init_from=CKPT fine-tunes a checkpoint (aiayn or converted Marian)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the run directory's latest checkpoint (from the beginning if it "
                        "has none yet)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("average", help="average the last K checkpoints of a run")
    p.add_argument("run_dir", type=path_arg, metavar="RUN_DIR",
                   help="a training run's directory (its train.run_dir), whose checkpoints/ holds the "
                   "checkpoints")
    p.add_argument("--last", type=positive_int, default=5, metavar="K",
                   help="how many (default 5; the paper: 5 for base, 20 for big)")
    p.add_argument("-o", "--output", type=path_arg,
                   help="output checkpoint directory (default RUN_DIR/average_last_N, N the "
                   "number averaged; it replaces an earlier average there, nothing else)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing OUTPUT (never the run, its checkpoints or a directory holding them)")
    p.set_defaults(func=cmd_average)

    p = sub.add_parser("plot", help="draw a run's training curves as a PNG, or several runs' overlaid")
    p.add_argument("run_dirs", nargs="+", type=path_arg, metavar="RUN_DIR",
                   help="a training run's directory (its train.run_dir), which holds metrics.jsonl; several: "
                   "their curves in one picture, a colour a run, named by its directory (with the folders "
                   "above it that tell the runs apart)")
    p.add_argument("-o", "--output", type=path_arg,
                   help="PNG path (default RUN_DIR/curves.png for one run; several runs need it; not another "
                   "run's curves.png)")
    p.add_argument("--log", action="store_true",
                   help="a log scale for the losses (a long run's fall from 10 to 2 nats is flat on a linear "
                   "one)")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("attention", help="draw a checkpoint's attention maps for one sentence (PNG + HTML)")
    p.add_argument("--checkpoint", type=path_arg, required=True, action=_Once,
                   hint="one model's attention a drawing; an ensemble has none of its own",
                   help="an aiayn checkpoint directory (trained or imported)")
    one_pair = "one sentence pair a drawing"
    p.add_argument("--src", required=True, action=_Once, hint=one_pair, help="source sentence")
    p.add_argument("--tgt", action=_Once, hint=one_pair,
                   help="target sentence to force (default: the model's greedy translation)")
    p.add_argument("--out", type=path_arg, default="attention", help="output folder (default ./attention)")
    p.add_argument("--layers", type=number_list, default=(), metavar="N,N,...", action=_Once,
                   hint="list them in one, e.g. --layers 1,6",
                   help="draw these layers only, e.g. 1,6 (default: all; maps of a big model's every layer and "
                   "head have tiny labels)")
    p.add_argument("--heads", type=number_list, default=(), metavar="N,N,...", action=_Once,
                   hint="list them in one, e.g. --heads 1,3",
                   help="draw these heads only, e.g. 3 (default: all)")
    p.set_defaults(func=cmd_attention)

    p = sub.add_parser("demo", help="learn English -> German numbers and dates on the CPU in minutes, then look inside")
    p.add_argument("--out", type=path_arg, help="output folder (default ./demo)")
    p.add_argument("--size", help="model size: tiny, small (default) or medium")
    p.add_argument("--steps", type=positive_int,
                   help="training updates (default 1200: enough for >= 99%% exact match with --size small)")
    p.add_argument("--minutes", type=float, help="stop training after this long (default 0: no limit)")
    p.add_argument("--seed", type=int,
                   help="corpus, initialization and batch order, 0 to 2**32 - 1 (default 1)")
    p.add_argument("--beam", type=int, help="beam size for the held-out translations (default 4, the paper's)")
    # one stream of pairs makes both sets (demo_corpus.make_corpus): either size changes the test set
    p.add_argument("--train-pairs", type=positive_int,
                   help="training pairs generated (default 40000); the held-out pairs are drawn from the same "
                   "stream, so another --train-pairs also tests on other sentences")
    p.add_argument("--test-pairs", type=positive_int,
                   help="held-out pairs translated and scored (default 500); they depend on --train-pairs "
                   "too, so exact match at other corpus sizes is measured on other sentences")
    p.add_argument("--device", help="cpu (default) or cuda: where it trains and translates")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("convert", help="import a MarianMT (OPUS-MT) directory as an aiayn checkpoint")
    p.add_argument("--from", dest="source_format", required=True, choices=["marian"],
                   help="the format of SOURCE: marian = a HuggingFace MarianMT directory")
    p.add_argument("source", type=path_arg, metavar="SOURCE",
                   help="local directory: config.json, model.safetensors or "
                   "pytorch_model.bin, source.spm, target.spm, vocab.json")
    p.add_argument("out", type=path_arg, metavar="OUT", help="aiayn checkpoint directory to write")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists (never SOURCE or what holds it)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("export", help="write an aiayn checkpoint for another runtime (CTranslate2, "
                       "HuggingFace MarianMT)")
    p.add_argument("--to", dest="target_format", required=True, choices=["ctranslate2", "marian"],
                   help="the format of OUT: ctranslate2 = a CTranslate2 model directory; marian = a "
                   "HuggingFace MarianMT directory (MarianMTModel, MarianTokenizer)")
    p.add_argument("checkpoint", type=path_arg, metavar="CKPT",
                   help="an aiayn checkpoint directory (trained or imported)")
    p.add_argument("out", type=path_arg, metavar="OUT", help="output model directory")
    p.add_argument("--quantization", choices=CT2_QUANTIZATIONS,  # checked here: before the checkpoint loads
                   help="CTranslate2 weight type (default: float32, whatever dtype the checkpoint stores); "
                   "--to ctranslate2 only")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists (never CKPT or what holds it)")
    p.set_defaults(func=cmd_export)

    add_translate_parser(sub)
    add_score_parser(sub)
    p = sub.add_parser("evaluate", help="sacreBLEU BLEU and chrF (with signatures) against references")
    p.add_argument("hypotheses", type=path_arg, metavar="HYP",
                   help="detokenized, cased translations, one per line; - reads standard input")
    p.add_argument("references", type=path_arg, metavar="REF", nargs="+",
                   help="reference file(s), line-aligned with HYP")
    p.add_argument("-l", "--lang", default="", metavar="LANG",
                   help="the target language's code (zh; zh-CN and ZH are zh; not a pair such as en-zh): zh, ja and "
                        "ko get the BLEU tokenizer sacreBLEU picks for them (13a splits no Chinese or Japanese "
                        "words; ja and ko need pip install 'sacrebleu[ja]' or 'sacrebleu[ko]'), th, lo, km and my "
                        "(Thai, Lao, Khmer, Burmese: no sacreBLEU tokenizer) its char one (tok:char)")
    p.add_argument("-lc", "--lowercase", action=_Refused,  # its own option, else argparse reads -l c
                   reason="aiayn evaluate has no lowercase option; its BLEU-lc line is always printed")
    p.add_argument("--tokenize", default=None, help="BLEU's tokenizer by name (default: 13a, or LANG's): "
                   "13a, intl, zh, char, none, flores200 (downloads its model on first use), ...; with "
                   "-l zh, ja, ko, th, lo, km or my, one other than LANG's (not a SentencePiece one) gets a "
                   "warning")
    p.add_argument("--chrf-word-order", type=int, default=0, choices=[0, 1, 2],
                   help="word n-grams in chrF: 2 is chrF++ (default 0, chrF); refused with -l zh, ja, th, "
                        "lo, km, my (or --tokenize zh, ja-mecab), whose words no space separates (without "
                        "either, such text gets a note)")
    p.add_argument("--ter", action="store_true",
                   help="also TER (translation edit rate; lower is better); with -l zh or ja (or --tokenize "
                        "zh, ja-mecab) each character is a word (sacreBLEU's asian support), and th, lo, km, "
                        "my are refused (without either, such text gets a note)")
    p.add_argument("--confidence", type=resamples, nargs="?", const=1000, default=0, metavar="N",
                   help="bootstrap resampling (sacreBLEU's, N resamples, default 1000): each score with its 95%% "
                   "confidence interval")
    p.add_argument("--json", action="store_true", help="print the scores as JSON")
    p.set_defaults(func=cmd_evaluate)

    return parser


def add_translate_parser(sub) -> None:
    p = sub.add_parser("translate", help="translate a file or stdin with a checkpoint (beam search, n-best)",
                       description="Translate one sentence per line, in input order; empty lines stay empty. "
                       "Works as a Unix filter: `aiayn translate CKPT < in.txt > out.txt`.")
    p.add_argument("checkpoint", type=path_arg, metavar="CKPT", nargs="+",
                   help="checkpoint directory (trained, averaged or imported); several with one vocabulary "
                   "are decoded as an ensemble (their probabilities averaged at every step)")
    p.add_argument("-i", "--input", type=path_arg, help="input file (default: stdin)")
    p.add_argument("-o", "--output", type=path_arg,
                   help="output file, written only once the whole input is translated (default: stdout)")
    p.add_argument("--beam", type=int, help="beam size; 1 is greedy search (default 4, the paper; 1 with --sample)")
    p.add_argument("--lenpen", type=float,  # None unless given: refused with --lenpen-kind none
                   help="length penalty alpha (default 0.6, the paper; refused with --lenpen-kind "
                   "none, and at beam 1, greedy search or --sample, without --n-best, where it changes "
                   "nothing)")
    p.add_argument("--lenpen-kind", choices=["gnmt", "power", "none"], default="gnmt",
                   help="gnmt: score = log P / ((5+|Y|)/6)^alpha (GNMT, the paper); power: log P / |Y|^alpha "
                   "(fairseq, HuggingFace, CTranslate2). |Y| counts the output tokens INCLUDING the final "
                   "EOS "
                   "(as tensor2tensor and fairseq do); a hypothesis cut at the maximum length has no EOS")
    p.add_argument("--max-len-a", type=float, default=1.0,
                   help="at most a*src_len+b output tokens, rounded down, and at least 1 (default 1); "
                   "src_len counts the source's EOS")
    p.add_argument("--max-len-b", type=int, default=50, help="(default 50: the paper's src_len + 50)")
    p.add_argument("--min-len", type=int, default=0, help="forbid EOS before this many output tokens")
    p.add_argument("--early-stopping", action="store_true",
                   help="stop a sentence once BEAM hypotheses ended (fairseq, CTranslate2; HuggingFace's "
                   "early_stopping=True); default: once no live hypothesis can beat them (tensor2tensor, the "
                   "paper's code; HuggingFace's early_stopping=\"never\"). Beam > 1 only")
    p.add_argument("--n-best", type=int, default=1,
                   help="hypotheses per line; above 1, each input line gets N-BEST output lines (fewer "
                   "only where fewer outputs fit its length limit: a vocabulary of a few pieces under a "
                   "limit of a token or two) in "
                   "Marian's n-best format, `LINE ||| TEXT ||| F0= LOGP ||| SCORE`: LINE counts from 0, LOGP "
                   "is log P(TEXT | line) (the sum of its tokens' log-probabilities, EOS included when "
                   "produced, for the pieces the search chose: `aiayn score` of TEXT gives another number "
                   "where SentencePiece splits TEXT otherwise, and the same TEXT may come twice; with "
                   "--min-len, as the search saw them, EOS forbidden), SCORE is "
                   "LOGP / lp(|Y|), the length-normalized score beam search ranks by (see --lenpen-kind; "
                   "with --sample the rows are independent samples in the order drawn). An input line of no "
                   "pieces (empty, blank or only characters the tokenizer drops) is not searched: it gets "
                   "N-BEST empty rows scored 0")
    p.add_argument("--sample", action="store_true", help="sample instead of searching (beam 1)")
    # None unless given: DecodeConfig refuses a sampling option without --sample rather than ignore it
    p.add_argument("--temperature", type=float,
                   help="with --sample: divides the logits, at least 0.001 (default 1)")
    p.add_argument("--top-k", type=int, help="with --sample: sample among the k likeliest tokens (default 0: all)")
    p.add_argument("--top-p", type=float, help="with --sample: nucleus sampling mass (default 1: all)")
    p.add_argument("--seed", type=int,
                   help="with --sample: seeds one generator for the whole input, so that the same input, options "
                   "(--chunk and --max-tokens included; standard input from a terminal is read as with "
                   "--chunk 1, see --chunk) and device give the same output; repeated lines still "
                   "get independent samples (default: a random seed). From 0 to 2**32 - 1, the seeds "
                   "PyTorch's CPU generator tells apart. Which line gets which draw depends on "
                   "the batches, so a pipe is then read in whole --chunk blocks, as a file is, rather than "
                   "answered whenever its input stalls: use --chunk 1 for an interactive filter")
    p.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                   help="batch budget: padded source tokens x beam, or x --n-best with --sample "
                        f"(sentences are sorted by length; default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--chunk", type=positive_int, default=10_000,
                   help="lines read (and sorted) at a time (default 10000); standard input (no -i, or -i -) "
                   "that is a terminal is read one line at a time whatever --chunk says, so that each typed "
                   "line is answered")
    p.add_argument("--int8", action="store_true",
                   help="dynamic int8 quantization of the linear layers (CPU); one activation scale per "
                   "batch, so a line's translation can depend on the lines batched "
                   "with it")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' and activations' type: bfloat16 is faster on GPUs and on CPUs with AMX "
                   "(a few translations in a hundred differ from float32's, and, as with --int8, a line's "
                   "translation can depend on the lines batched with it: PyTorch's attention rounds it "
                   "otherwise beside a longer line's padding); float16 on GPUs only")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=positive_int, help="CPU threads (default: PyTorch's choice)")
    p.add_argument("--compile", action="store_true",
                   help="compile the decoder step of one sentence with torch.compile before translating "
                   "(10-40 s, said on stderr first, -q or not; float32 on a CPU, needs a C++ compiler): "
                   "greedy search (--beam 1) or sampling of one line at a time, as an interactive filter "
                   "with --chunk 1 decodes, from 4%% slower to 22%% faster on a 2-core CPU (see the "
                   "README); batches of several lines decode as "
                   "without it, and beam search, which it would not speed up, refuses it")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress (a bar on a terminal, else a line every 10 s for a file)")
    p.set_defaults(func=cmd_translate)


def add_score_parser(sub) -> None:
    p = sub.add_parser("score", help="log P(target | source) of given translations (forced decoding)",
                       description="Score each line pair of SRC and TGT under the model: log P(target | "
                       "source), the sum of the target tokens' log-probabilities, its EOS included (as "
                       "`translate --n-best` scores what it finds, where SentencePiece splits it as the "
                       "search did, and when the search ended it with EOS: one cut at the limit of "
                       "--max-len-a and --max-len-b has none, and score adds its log P, but one cut at the "
                       "model's positions, which it fills, cannot be scored, its EOS having no position "
                       "left; without --min-len, which renormalizes the early steps; in float32: --dtype "
                       "bfloat16 and float16 round a line by the padding of the lines batched with it, which "
                       "score batches otherwise than the search; and when the source line has pieces: "
                       "--n-best reports an empty one's rows scored 0), one number per line; the perplexity "
                       "of the whole on stderr. For reranking n-best lists, filtering a corpus, or a test "
                       "set's perplexity.")
    p.add_argument("checkpoint", type=path_arg, metavar="CKPT", nargs="+",
                   help="checkpoint directory; several with one vocabulary score as an ensemble (their "
                   "probabilities averaged at every step)")
    p.add_argument("--src", type=path_arg, required=True,
                   help="source sentences, one per line (a file, a pipe, or - for standard input)")
    p.add_argument("--tgt", type=path_arg, required=True,
                   help="their translations, line by line (a file, a pipe, or - for standard input)")
    p.add_argument("-o", "--output", type=path_arg,
                   help="output file, written only once every pair is scored (default: stdout)")
    p.add_argument("--normalize", action="store_true",
                   help="divide each log P by its target's tokens (EOS included): the mean per token")
    p.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                   help=f"batch budget: padded tokens of the longer side (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' and activations' type, as for translate (scores sum in float32)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=positive_int, help="CPU threads (default: PyTorch's choice)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress (a bar on a terminal, else a line every 10 s for a file)")
    p.set_defaults(func=cmd_score)


class ResultStream:
    """The commands' stdout: UTF-8 whatever the locale (as `-o` files are), and a write that fails, or
    finds stdout closed (`>&-`), is a UserError (one line, exit 2) instead of a traceback or, for a
    closed stdout, results silently lost with exit 0. A reader that went away stays a BrokenPipeError."""

    encoding = "utf-8"

    def __init__(self, stdout) -> None:
        self.stdout = stdout  # None when the process was started with stdout closed
        self.closed_at_start = stdout is None
        self._bytes = getattr(stdout, "buffer", None)  # None for a text-only stream (a notebook's)
        self._line_buffered = bool(getattr(stdout, "line_buffering", False))  # True on a terminal
        if stdout is not None:
            with contextlib.suppress(OSError, ValueError):  # a broken pipe shows on the first write
                stdout.flush()  # what was written as text before comes first

    def write(self, text: str) -> int:
        _raise_dropped_stop()  # a Ctrl-C or SIGTERM that Python dropped: no result printed after it
        if self._bytes is not None:
            # surrogateescape: a path given on the command line in bytes that are no UTF-8 is printed as
            # those bytes (strict encoding raised a traceback after the work was done)
            self._guard(lambda: self._bytes.write(text.encode("utf-8", "surrogateescape")))
            if self._line_buffered and "\n" in text:  # a terminal sees each line as it is printed
                self.flush()
        else:
            self._guard(lambda: self.stdout.write(text))
        return len(text)

    def flush(self) -> None:
        self._guard(lambda: (self._bytes or self.stdout).flush())

    def fileno(self) -> int:
        return self.stdout.fileno()

    def isatty(self) -> bool:
        return self.stdout is not None and self.stdout.isatty()

    def _guard(self, write) -> None:
        if self.stdout is None:
            raise UserError("<stdout>: closed, so the results cannot be written")
        try:
            write()
        except BrokenPipeError:
            raise
        except OSError as e:  # a full disk (> /dev/full), an I/O error: the output is incomplete
            _to_devnull(self.stdout)
            raise UserError(f"<stdout>: cannot write ({e.strerror or e})") from None


def _to_devnull(stream) -> None:
    """Point `stream`'s file descriptor at /dev/null once a write to it failed (a full disk, a reader that
    went away), so that the exit's flush of what it still buffers cannot fail again; nothing for a stream
    without a descriptor (a notebook's, a test's)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)


class DiagnosticStream:
    """The commands' stderr: progress bars, notes and error lines. They are for a person; a write that
    fails (stderr closed with `2>&-`, a full disk, a reader that went away) is dropped, and the stream is
    then quiet, instead of failing the command and losing its results (a finished translation, the
    scores). Closed at start, Python's sys.stderr is None, and print(file=None) writes to stdout: into
    the results."""

    def __init__(self, stderr) -> None:
        self.stderr = stderr

    @property
    def encoding(self) -> str:
        return getattr(self.stderr, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        # what the terminal cannot encode (a file name's undecodable bytes, surrogates here) as escapes, as
        # Python's own stderr writes them: the encoding error silenced the stream, error line and all
        safe = text.encode(self.encoding, "backslashreplace").decode(self.encoding, "replace")
        self._guard(lambda: self.stderr.write(safe))
        return len(text)

    def flush(self) -> None:
        self._guard(lambda: self.stderr.flush())

    def isatty(self) -> bool:
        return self.stderr is not None and self.stderr.isatty()

    def _guard(self, write) -> None:
        if self.stderr is None:
            return
        try:
            write()
        except (OSError, ValueError):
            _to_devnull(self.stderr)
            self.stderr = None


def _terminate(signum: int, frame) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def _signals_raise():
    """SIGTERM and SIGHUP raise `Terminated` while a command runs, where they still have their default
    action (not in a thread, nor under a caller's own handler, nor ignored: `nohup`'s SIGHUP). A caller's
    own work too (recipes/multi30k/run.py's averaging and decoding). Training's own handlers take over for
    its updates (a save, then `Stopped`) and give these back after; without them `aiayn train` was killed
    silently during its data's preparation (exit -15, where a Ctrl-C said "aiayn: interrupted"), the demo
    while making its corpus or translating."""
    installed = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        with contextlib.suppress(TypeError, ValueError):  # no such signal here, or not the main thread
            if signal.getsignal(sig) == signal.SIG_DFL:
                installed[sig] = signal.signal(sig, _terminate)
    try:
        yield
    finally:
        for sig, previous in installed.items():
            signal.signal(sig, previous)


@contextlib.contextmanager
def _dropped_stops_kept():
    """A Ctrl-C or SIGTERM whose exception Python drops is recorded, not printed: a signal's handler raises
    (Python's for SIGINT, `_terminate`), and one that lands while the garbage collector runs a weakref
    callback or a __del__ (matplotlib's, freeing `aiayn attention`'s previous Figure) raised there, where
    Python printed "Exception ignored in ..." and a traceback and went on: the maps replaced the previous
    set, exit 0. The renames that put results in place, and stdout, raise the recorded stop instead
    (`aiayn.files.raise_dropped_stop`), as does the command's end."""
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated)):
            from aiayn.files import record_dropped_stop

            record_dropped_stop(unraisable.exc_value)
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
        if files := sys.modules.get("aiayn.files"):  # one dropped as the command ended: not the next's
            files.forget_dropped_stops()


def _raise_dropped_stop() -> None:
    if files := sys.modules.get("aiayn.files"):  # not imported: nothing recorded (the hook imports it)
        files.raise_dropped_stop()


def main(argv: list[str] | None = None) -> int:
    stderr, sys.stderr = sys.stderr, DiagnosticStream(sys.stderr)
    try:
        args = build_parser().parse_args(argv)
        stdout, sys.stdout = sys.stdout, ResultStream(sys.stdout)
        # not in a torchrun job's processes other than 0 (which say nothing of a stop anyway): they wait
        # in gloo's C++ broadcast while process 0 prepares the data, where a Python handler runs only once
        # that call returns, hours later on a big corpus; the default action ends them at once
        raising = contextlib.nullcontext() if _job_rank(args.command) else _signals_raise()
        try:
            with raising, _dropped_stops_kept():
                return _run(args)
        finally:
            sys.stdout = stdout
    finally:
        sys.stderr = stderr


def entry_point() -> int:
    """The `aiayn` command (pyproject's [project.scripts], `python -m aiayn`): `main`, then Ctrl-C's default
    action back for the process' exit, as SIGTERM's and SIGHUP's are by then: a Ctrl-C ends the process at
    once, quietly, as a shell reports one (130). Once a command that loaded PyTorch has said its last line,
    Python takes seconds to exit (its garbage collection over torch's modules), and a Ctrl-C there was a
    KeyboardInterrupt traceback ("Exception ignored in: <module 'threading' ...>"), after a
    training's "stopped by SIGINT ..., saved" too, whose warning offers a second Ctrl-C. A Ctrl-C the
    process ignores stays ignored. A SIGTERM or SIGHUP as the last line is written (`Terminated`) ends it
    by that signal likewise, not with a traceback and exit 1. Not in `main`: a caller's own Ctrl-C after it
    still raises."""
    stopped_by = None
    try:
        return main()
    except (KeyboardInterrupt, Terminated) as e:  # one as the last line was written, out of the handler
        # that wrote it (SIGTERM's and SIGHUP's: `_signals_raise`'s)
        stopped_by = e.signum if isinstance(e, Terminated) else signal.SIGINT
        return 128 + stopped_by
    finally:  # argparse's exit (--help, a usage error) too
        for stream in (sys.stdout, sys.stderr):  # what they hold, which Python's exit would have written:
            # none (pythonw), closed, or a full disk, which that exit then says
            with contextlib.suppress(AttributeError, OSError, ValueError):
                stream.flush()
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if stopped_by == signal.SIGINT:
                os.kill(os.getpid(), signal.SIGINT)  # at once, as one that comes after this
        if stopped_by not in (None, signal.SIGINT):  # (its default action is back: `_signals_raise`)
            signal.signal(stopped_by, signal.SIG_DFL)
            os.kill(os.getpid(), stopped_by)


def _one_line(message: str) -> str:
    """An error as one line, a file name in it as typed: its control characters escaped (-i $'a\\nb.en' split
    the line in two) and its undecodable bytes as \\xff (shown as the surrogate \\udcff)."""
    message = non_utf8_name(message) or message
    return "".join(c if c == "\t" or " " <= c != "\x7f" else repr(c)[1:-1] for c in message)


def _said_error(e: UserError | ConfigError, later_on_machine: bool) -> int:
    """Print the command's error, once a machine in a torchrun job; its exit status."""
    if later_on_machine:  # (torch is loaded: the import is free)
        from aiayn.train.distributed import FailedOnMain, SameOnEveryProcess

        # each machine's first process prints these: one line a machine, not one a process (a
        # configuration is read alike by the processes of a machine)
        if isinstance(e, (FailedOnMain, SameOnEveryProcess, ConfigError)):
            return 2
    print(f"aiayn: error: {_one_line(str(e))}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    """Run one command; the exit status."""
    # Each command warns of CRs inside lines once a file, as in a process of its own; a lines module not
    # loaded has warned of nothing
    later = bool(_job_rank(args.command))  # a torchrun job's process other than 0
    # other than its machine's first (LOCAL_RANK 0; _job_rank read it): each machine's torchrun shows its own
    # processes' output alone, so another machine's missing config file went unsaid when process 0 alone spoke
    later_on_machine = later and int(os.environ.get("LOCAL_RANK") or 0) != 0
    if lines := sys.modules.get("aiayn.data.lines"):
        lines.forget_cr_warnings()
    try:
        closed = getattr(sys.stdout, "closed_at_start", False)  # translate and score: -o, or refused
        if closed and args.command not in ("translate", "score", "train"):
            # before the work, not after: an export done (its old one replaced), then exit 2 for its path
            raise UserError("<stdout>: closed, so the results cannot be written")
        args.func(args)
        _raise_dropped_stop()  # one the command's outputs did not meet: a stop all the same
        if not closed:  # (train's summary, the one line that may be lost)
            sys.stdout.flush()  # a full disk shows here, while the error can still be one line
    except (UserError, ConfigError) as e:
        return _said_error(e, later_on_machine)
    except Stopped as e:  # a training run that saved on SIGTERM, SIGHUP or Ctrl-C
        if not later:
            print(f"aiayn: {e}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        if not later:  # torchrun's launcher passes a terminal's Ctrl-C on to every process of its job
            print("aiayn: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:
        if on_an_errors_way_out(e):  # it came as the error was on its way out:
            # the error is what stopped the command (torchrun SIGTERMs the others once a process stops, so
            # its signal followed the lost process' error, and "stopped by SIGTERM" hid it)
            return _said_error(e.__context__, later_on_machine)
        if not later:  # torchrun's launcher sends it to every process it stops
            print(f"aiayn: stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum  # what a shell reports for a process killed by the signal
    except BrokenPipeError:  # the reader went away (`aiayn translate ... | head`): stop quietly, as cat does
        _to_devnull(sys.stdout)
        return 141  # 128 + SIGPIPE, what a shell reports for a filter killed by it
    except OSError as e:  # a path's check (exists(), is_dir()) lets ENAMETOOLONG through: a traceback
        if e.errno != errno.ENAMETOOLONG or not e.filename:
            raise
        print(f"aiayn: error: {_one_line(os.fsdecode(e.filename))}: file name too long", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(entry_point())

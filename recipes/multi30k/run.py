"""Multi30k end to end: train with the recipe, average the last checkpoints, beam search, sacreBLEU.

    python recipes/multi30k/run.py --data ../shared/data/multi30k --pair en-de
    python recipes/multi30k/run.py --data ../shared/data/multi30k --pair de-en --test
    python recipes/multi30k/run.py --data ../shared/data/multi30k --pair en-de --no-train --test
    python recipes/multi30k/run.py --data ../shared/data/multi30k --pair en-de --ensemble --test

Validation scores are always printed (tune on them); `--test` also scores test_2016_flickr: do that
once per recipe change. Prints cased detokenized sacreBLEU and the lowercased BLEU that the published
Multi30k numbers use, both with signatures, and the time of every stage, and writes them to
RUN_DIR/results.json (when it trained nothing, --no-train or a --resume of a finished run:
results_scored_test.json with --test, else results_scored.json), each split's translations beside it
(results.val.hyp.de). A benchmark, not a test: it takes the recipe's 80 minutes plus decoding.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import torch
from tqdm import tqdm

from aiayn.checkpoint import checkpoint_tokenizer, meta_model_config, read_meta
from aiayn.cli import Terminated, _settings_as_flags, _signals_raise, positive_int
from aiayn.config import ConfigError, resolved_settings
from aiayn.data.dataset import PROGRESS_SECONDS, read_lines, scan_parallel
from aiayn.decoding import DecodeConfig
from aiayn.errors import Stopped, TextError, UserError
from aiayn.evaluate import corpus_scores
from aiayn.files import atomic_output
from aiayn.train.average import average_last
from aiayn.train.config import TOKENIZER_SETTINGS, RunConfig, finetune_model_config, load_config
from aiayn.train.loop import train
from aiayn.train.resume import checkpoint_to_resume
from aiayn.train.state import checkpoint_dirs
from aiayn.translate import Translator, progress_lines

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent.parent / "benchmarks"
if (BENCHMARKS / "common.py").is_file():
    sys.path.insert(0, str(BENCHMARKS))
    from common import environment  # hardware, versions, commit, date: as every benchmark records
else:  # a copy of the recipe outside the repository failed on the import, with a traceback

    def environment() -> dict:
        return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "note": f"{BENCHMARKS / 'common.py'} not found: hardware, versions and commit not recorded"}


# --ensemble's second model per pair, each chosen on val. en-de: the recipe's model again with another
# seed (another initialization, dropout and batch order): on val it beat the narrow, deeper partner below
# by 0.85 BLEU-lc (41.87 against 41.02 for the ensemble). de-en: narrower and deeper (4+4 layers, d_model 128,
# d_ff 256, 2.3M parameters) with the larger peak learning rate a smaller d_model allows; measured so.
PARTNER = {
    "en-de": ["train.seed=2"],
    "de-en": ["model.d_model=128", "model.d_ff=256", "model.n_layers=4", "train.lr_scale=1.8"],
}
# Beam size and GNMT length penalty per pair, chosen on val for the --ensemble recipe (grid: beam 4, 6,
# 8, 12 x alpha 0.6, 1.0, 1.2, 1.4, 2.0; alpha 2.0 loses 4.7-7.5 BLEU-lc, the rest lie within 0.69 for
# en-de and 1.02 for de-en). See README.md.
SEARCH = {"en-de": (8, 1.2), "de-en": (4, 1.4)}
SPLITS = ("val", "test_2016_flickr")  # scored: val always, test with --test


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="folder with train.*, val.*, test_2016_flickr.*")
    p.add_argument("--pair", default="en-de", choices=["en-de", "de-en"],
                   help="the direction: its recipe (PAIR.toml), partner and search (default: en-de)")
    p.add_argument("--test", action="store_true", help="also score test_2016_flickr (once per recipe change)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override the recipe")
    p.add_argument("--beam", type=positive_int, help="beam size (default: the pair's, chosen on val)")
    p.add_argument("--lenpen", type=float, help="GNMT length penalty alpha (default: the pair's, chosen on val)")
    p.add_argument("--average", type=positive_int, default=5,
                   help="average the last K checkpoints (default: 5)")
    p.add_argument("--no-train", action="store_true",
                   help="score the run's existing checkpoints (e.g. on test, once, after tuning on val)")
    p.add_argument("--resume", action="store_true",
                   help="continue a training that a signal or Ctrl-C stopped (each --ensemble member too)")
    p.add_argument("--ensemble", action="store_true",
                   help="train the recipe's model and the pair's partner (PARTNER) at the same time "
                   "(half the threads each) in RUN_DIR/a and RUN_DIR/b, then decode them as an ensemble")
    p.add_argument("--partner", action="append", metavar="SECTION.KEY=VALUE",
                   help="the second --ensemble member's overrides, replacing the pair's PARTNER "
                   "(e.g. --partner train.seed=3 --partner model.dropout=0.2; not train.run_dir or "
                   "train.threads, which the recipe sets for each member)")
    p.add_argument("--train-only", action="store_true", help=argparse.SUPPRESS)  # one --ensemble member
    # member b of an --ensemble given no --partner: its --set items hold the pair's PARTNER (`as_partner`)
    p.add_argument("--recipe-partner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # Each was silently ignored: a model trained without the partner asked for, scores of no resumed run.
    # (A member's --partner only names, in its errors, the --set items that came from --partner.)
    if args.partner and not (args.ensemble or args.train_only):
        p.error("--partner sets the second --ensemble member's overrides; add --ensemble, or use --set")
    if args.no_train and args.resume:
        p.error("--no-train scores the checkpoints as they are and --resume trains on: give one of them")
    return args


def scored_pairs(data: Path, splits: list[str], src: str, tgt: str) -> dict[str, tuple[list[str], list[str]]]:
    """Each split's (sources, references), read and checked before training: invalid UTF-8 (read_lines names
    the file and line), sides of unequal length, or no lines failed only after the training and decoding,
    naming no file ("reference 1 has 38 lines but the hypotheses have 40", "no hypotheses")."""
    pairs = {}
    for split in splits:
        paths = [data / f"{split}.{lang}" for lang in (src, tgt)]
        sources, refs = (read_lines(p, done="scored") for p in paths)
        if len(sources) != len(refs):
            raise UserError(f"{paths[0]} has {len(sources)} lines but {paths[1]} has {len(refs)}: "
                            "a split's two sides pair line by line")
        if not sources:
            raise UserError(f"{paths[0]} and {paths[1]} are empty: nothing to score")
        pairs[split] = sources, refs
    return pairs


@contextmanager
def lines_of(path: Path) -> Iterator[None]:
    """A problem with one line of `path` named FILE:LINE, as `aiayn translate` names it: it was "text 61:
    11201 tokens (with EOS), more than the 1024 positions of this model", naming no file."""
    try:
        yield
    except TextError as e:  # a line too long for the model, or out of memory at a batch's first line
        raise e.located(str(path), 0) from None


def check_lengths(translator: Translator, data: Path, src: str, pairs: dict[str, tuple[list[str], list[str]]]
                  ) -> None:
    """Every split's sources against the model's positions before any is decoded: test's too long line failed
    after val's decoding. Not before training: the pieces are the tokenizer's, which training makes."""
    for split, (sources, _) in pairs.items():
        with lines_of(data / f"{split}.{src}"):
            translator.source_ids(sources)


def score(translator: Translator, path: Path, split: str, sources: list[str], refs: list[str], beam: int,
          lenpen: float | None) -> tuple[dict, list[str]]:
    """Translate the sources read from `path` and score them against the references (`lenpen` None: the
    search's own, at beam 1): the split's record and its translations."""
    start = time.monotonic()
    # a bar on stderr, as `aiayn demo` has for the same step: each split was minutes of silence
    # disable=None: no bar where stderr is not a terminal, as training's (a log kept its carriage returns);
    # there a line every PROGRESS_SECONDS, as the demo's (`2>log` had a minute of silence a split)
    with lines_of(path), tqdm(total=len(sources), desc=f"translating {split}", unit="sent", leave=False,
                              disable=None) as bar:
        progress = progress_lines(len(sources), PROGRESS_SECONDS, split) if bar.disable else bar.update
        alpha = {} if lenpen is None else {"lenpen": lenpen}
        hyps = translator.translate(sources, beam=beam, progress=progress, **alpha)
    seconds = time.monotonic() - start
    scores = corpus_scores(hyps, [refs])
    scored = [{"name": s.name, "score": round(s.score, 2), "signature": s.signature} for s in scores]
    record = {"split": split, "decode_s": round(seconds, 1), "scores": scored}
    return record, hyps


# The keys member_overrides sets for each member itself, after --partner's: a --partner of one was dropped
# unsaid, and its line over a --set of the same key said b trained with it
MEMBER_KEYS = {"train.run_dir": "the members train in RUN_DIR/a and RUN_DIR/b, RUN_DIR given with --set",
               "train.threads": "each member trains with half of the run's train.threads (the recipe's 2, or "
                                "--set's), at least 1"}


def check_partner_keys(partner: list[str]) -> None:
    """A --partner item of a key the recipe sets for each member (MEMBER_KEYS) is refused, in one line."""
    for item in partner:
        section, _, key = item.partition("=")[0].strip().partition(".")
        if (why := MEMBER_KEYS.get(f"{section}.{key.strip()}")) is not None:
            raise UserError(f"--partner {item!r}: the recipe sets it for both members ({why}); drop it")


def member_overrides(args: argparse.Namespace, run_dir: Path, threads: int) -> list[list[str]]:
    """Each --ensemble member's overrides: --set, then the partner's (for b), its run_dir and threads."""
    partner = args.partner or PARTNER[args.pair]
    members = [[f"train.run_dir={run_dir / 'a'}"], [*partner, f"train.run_dir={run_dir / 'b'}"]]
    return [[*args.set, *m, f"train.threads={max(1, threads // 2)}"] for m in members]


# Train keys that leave every update's weights as they are (measured: a micro model with dropout, its last
# checkpoint equal bit for bit): where they go, the threads, metrics.jsonl's lines, the checkpoints kept,
# BLEU's tokenizer. Two members apart in these alone train one model twice, however each is averaged.
BOOKKEEPING = ("run_dir", "threads", "log_every", "keep_last", "bleu_lang")
# Which updates validate and save: bookkeeping too, unless train.patience counts the validations or
# train.max_minutes their time (the recipe's 80: fewer updates, and cooldown's lr falls on other ones)
VALIDATION = ("valid_every", "bleu_every")
# What changes only how fast the updates run (each layer's activations recomputed, the same weights, bit for
# bit on a CPU): bookkeeping too, unless train.max_minutes bounds the training's time (fewer updates fit)
SPEED = ("checkpoint_activations",)


def check_members_differ(configs: list[RunConfig], resume: bool) -> None:
    """Two members of one configuration train one model twice, bit for bit: `--set train.seed=2` met
    en-de's partner `train.seed=2`, `--partner model.n_heads=4` restated the `small` preset's, and the
    ensemble of two copies cost twice the training. Compared as trained, not as written."""
    checkpoints = [start_checkpoint(c, resume) for c in configs]
    check_members_share_vocabulary(configs, checkpoints)
    if trained_as(configs[0], checkpoints[0]) == trained_as(configs[1], checkpoints[1]):
        raise UserError("the two --ensemble members would train the same model (the partner's overrides "
                        "restate --set, the recipe or the defaults, or set only what leaves the weights "
                        "alone, as train.keep_last); make them differ, e.g. --partner "
                        f"train.seed={configs[0].train.seed + 1}")


def start_checkpoint(config: RunConfig, resume: bool) -> Path | None:
    """The checkpoint a fine-tuning member's model and tokenizer come from: train.init_from's, or on --resume
    the member's newest, as the training loop reads them (`initial_checkpoint`): init_from was needed for the
    first invocation alone, and a --resume after it was deleted was refused ("not an aiayn checkpoint")."""
    if not config.train.init_from:
        return None
    newest = checkpoint_dirs(config.train.run_dir)[-1:] if resume else []
    return newest[0] if newest else Path(config.train.init_from)


def trained_as(config: RunConfig, start: Path | None) -> dict[str, Any]:
    """What decides a member's weights: its model as training builds it (from `start`, a fine-tune's
    checkpoint), [data], [train] less bookkeeping."""
    settings = config.to_dict()  # every [data] and [train] field; [model] only as written
    settings["model"] = built_model(config, start)
    counted = config.train.patience or config.train.max_minutes
    left_out = BOOKKEEPING + (() if counted else VALIDATION) + (() if config.train.max_minutes else SPEED)
    settings["train"] = {k: v for k, v in settings["train"].items() if k not in left_out}
    if settings["train"].get("device") == "auto":  # the device it takes: `--partner train.device=cpu` on a
        # CPU machine trained the same model twice
        settings["train"]["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    return settings


def built_model(config: RunConfig, start: Path | None) -> dict[str, Any]:
    """The model `build_model` makes of `config`, or of a fine-tune's `start` checkpoint, but for the
    tokenizer's sizes and ids, which the members share (`check_members_share_vocabulary`)."""
    if start:  # the checkpoint's model, with [model]'s dropout
        return asdict(finetune_model_config(config, meta_model_config(start, read_meta(start)), start))
    # as build_model: separate vocabularies share no embedding matrix unless [model] says so
    unshared = not config.data.shared_vocab and "share_embeddings" not in config.model
    model = config.model_config(vocab_size=64, **({"share_embeddings": False} if unshared else {}))
    return resolved_settings(asdict(model))  # n_decoder_layers=3 restates 3 layers' None


# [data] settings a tokenizer is trained from: the validation files and max_len do not change it
VOCABULARY = ("train_src", "train_tgt", *TOKENIZER_SETTINGS)


def check_members_share_vocabulary(configs: list[RunConfig], checkpoints: list[Path | None]) -> None:
    """An ensemble decodes with one vocabulary: a partner with another tokenizer setting or training files
    (`--partner data.vocab_size=300`), or fine-tuning a checkpoint (which keeps its own tokenizer) that the
    other does not share, was refused by Translator only after both trainings. `checkpoints`: where each
    member's tokenizer is read (`start_checkpoint`)."""
    for key in VOCABULARY:
        a, b = (getattr(c.data, key) for c in configs)
        if a != b:
            raise UserError(f"the two --ensemble members would train different vocabularies: data.{key} is "
                            f"{a!r} for member a and {b!r} for member b; an ensemble decodes with one")
    starts = [c.train.init_from for c in configs]
    if starts[0] != starts[1] and not (all(starts) and same_tokenizer(*checkpoints)):
        raise UserError(f"the two --ensemble members would have different vocabularies: train.init_from is "
                        f"{starts[0]!r} for member a and {starts[1]!r} for member b (a fine-tune keeps its "
                        "checkpoint's tokenizer); an ensemble decodes with one")


def same_tokenizer(a: Path, b: Path) -> bool:
    """Whether two checkpoints hold one tokenizer (two checkpoints of one run do)."""
    first, second = (checkpoint_tokenizer(c, read_meta(c)) for c in (a, b))
    return first.same_as(second)


def train_members(args: argparse.Namespace, members: list[list[str]], run_dirs: list[str]) -> None:
    """Train the two --ensemble members, given their overrides and run directories, in parallel processes,
    each line of theirs on stderr after its member's name ("a: ", "b: "): the two trainings' logs, alike
    but for their numbers, interleaved on one stream without saying whose a line was (their configurations,
    updates, stops and errors). Their stderr is then no terminal: training's bar gives way to its lines."""
    procs, relays = [], []
    # b's --partner items, or word that it has the pair's PARTNER, so that its errors name them so (its
    # refusals of train.device=cuda on a CPU machine, or of a fine-tune's model, were --set's): they come
    # as --set items too
    partner = [a for item in args.partner or [] for a in ("--partner", item)] or ["--recipe-partner"]
    for name, overrides, named in zip("ab", members, [[], partner]):
        cmd = [sys.executable, __file__, "--data", args.data, "--pair", args.pair, "--train-only",
               *(["--resume"] if args.resume else [])]
        procs.append(subprocess.Popen(cmd + [a for o in overrides for a in ("--set", o)] + named,
                                      stderr=subprocess.PIPE, text=True, errors="replace"))
        relays.append(relayed(procs[-1].stderr, f"{name}: "))
    try:
        codes = wait_all(procs)
    finally:  # the members' last lines (a stop, an error) before this script's
        for thread in relays:
            thread.join(timeout=RELAY_END_S)
    if any(codes):
        print(f"run.py: {member_failure(codes, run_dirs)}", file=sys.stderr)
        # a refusal of the member's settings (exit 2) is the recipe's usage error, as a single run's is
        raise SystemExit(2 if all(codes[i] == 2 for i in failed_members(codes)) else 1)


RELAY_LOCK = threading.Lock()  # one member's line written whole before the other's
RELAY_END_S = 10.0  # for a member's pipe to end once it has exited (a process it started may hold it open)


def relayed(stream: IO[str], prefix: str) -> threading.Thread:
    """A thread copying `stream`'s lines to stderr, each after `prefix`. It reads to the end even once
    stderr cannot be written (a closed terminal): a member writing to a full pipe would stop training."""
    def copy() -> None:
        writable = True
        for line in stream:
            if writable:
                try:
                    with RELAY_LOCK:
                        sys.stderr.write(prefix + (line if line.endswith("\n") else line + "\n"))
                        sys.stderr.flush()
                except (OSError, ValueError):  # EIO on a closed terminal, a closed stream
                    writable = False
        stream.close()

    thread = threading.Thread(target=copy, name=f"member {prefix}", daemon=True)
    thread.start()
    return thread


def failed_members(codes: list[int]) -> list[int]:
    """The members that failed, by index. A member that wait_all stopped (SIGTERM) did not fail, unless
    every nonzero one was stopped."""
    stopped = (-signal.SIGTERM, 128 + signal.SIGTERM)  # killed while preparing data, or saved and stopped
    if hangup := getattr(signal, "SIGHUP", None):  # a closed terminal's, which every member got
        stopped += (-hangup, 128 + hangup)
    failed = [i for i, c in enumerate(codes) if c not in (0, *stopped)]
    return failed or [i for i, c in enumerate(codes) if c]


def member_failure(codes: list[int], run_dirs: list[str]) -> str:
    """Which member failed, and where: "exit codes [0, 2]" left the reader to find it among the lines of two
    trainings."""
    failed = failed_members(codes)
    names = " and ".join(f"{'ab'[i]} ({run_dirs[i]})" for i in failed)
    exits = ", ".join(str(codes[i]) for i in failed)
    whose = "its error is" if len(failed) == 1 else "their errors are"
    return f"ensemble member{'s' * (len(failed) > 1)} {names} failed (exit {exits}; {whose} above)"


def wait_all(procs: list[subprocess.Popen], poll_s: float = 1.0) -> list[int]:
    """Every process' exit code. Once one fails, or this script gets SIGTERM, SIGHUP or Ctrl-C, the others
    get that signal (a Ctrl-C as SIGTERM; a failure's SIGTERM: a training saves its update and stops) and
    are waited for, instead of training on as orphans after this script has exited; a signal then stops
    this script as `Stopped`. Signals after the first are taken as the first's."""

    def stop_all(signum: int = signal.SIGTERM) -> list[int]:
        for p in procs:
            if p.poll() is None:
                # the signal stopping them (on SIGHUP they said "stopped by SIGTERM", this one's), but a
                # Ctrl-C as SIGTERM: a second Ctrl-C interrupts a training at once, without its save
                p.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)
        return [p.wait() for p in procs]

    def stopped(signum: int) -> Stopped:
        """What the members did with the signal: a training saves its update and exits 130, 143 or 129
        (SIGHUP); one still preparing its data had nothing to save (it was said to have saved)."""
        codes = stop_all(signum)
        saved = all(c in (0, *(128 + s for s in handled)) for c in codes)  # 0: had finished
        what = ("each member saved its update; --resume continues" if saved else
                f"exit codes {codes}: a member stopped before its first update had nothing to save; "
                "--resume continues from each member's last checkpoint, or starts it again")
        return Stopped(f"stopped by {signal.Signals(signum).name}: {what}", signum)

    class Signalled(BaseException):
        """A signal, raised out of the loop: the members are waited for outside the handler."""

    stopping = []  # the stop under way, once one is: a signal after it is taken as its own

    def on_sigterm(signum, frame):
        # never waits: a second signal (a closed terminal sends SIGHUP twice: the kernel's and the shell's)
        # during the first stop's p.wait() ran stop_all inside it, on the lock that p.wait() held: a hang
        if not stopping:
            stopping.append(signum)
            raise Signalled(signum)

    # a closed terminal sends SIGHUP to the members, which save, and to this script, which died without a
    # word: it now waits for them and says so, as for SIGTERM
    handled = [signal.SIGINT, signal.SIGTERM, *filter(None, [getattr(signal, "SIGHUP", None)])]
    previous = {s: signal.signal(s, on_sigterm) for s in handled[1:]
                if signal.getsignal(s) != signal.SIG_IGN}  # nohup's SIGHUP stays ignored, as the members'
    try:
        while True:
            # each polled every round: any() stopped at the first still running, so the second member's
            # failure went unseen until the first had trained its whole 80 minutes
            codes = [p.poll() for p in procs]
            if any(c not in (None, 0) for c in codes):
                stopping.append(None)
                stop_all()
                break
            if None not in codes:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:  # the members, in the same process group, got the Ctrl-C too
        stopping.append(signal.SIGINT)
        raise stopped(signal.SIGINT) from None
    except Signalled as e:
        raise stopped(e.args[0]) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return [p.returncode for p in procs]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # quoted as a shell needs it: " ".join made `--set "train.run_dir=/x/with space"` two arguments
    args.command = shlex.join(["recipes/multi30k/run.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        # SIGTERM and SIGHUP stop in one line, as in aiayn's commands: the data's preparation was killed
        # without a word (143). Training's loop takes them over for its updates (a save, then Stopped).
        with _signals_raise():
            return run(args)
    except (UserError, ConfigError) as e:  # a wrong --data, a run directory that is not there: one line
        message = as_partner(str(e), args) if args.train_only else str(e)  # member b: train_members
        print(f"run.py: error: {without_python(message)}", file=sys.stderr)
        return 2
    except Stopped as e:  # SIGTERM or Ctrl-C: the training saved its update (as `aiayn train` says it)
        print(f"run.py: {without_python(str(e))}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:  # outside training (data preparation, averaging, decoding): was a traceback
        return stopped_outside_training(signal.SIGINT, member=args.train_only)
    except Terminated as e:  # outside training's updates: it exited 143 without a word
        return stopped_outside_training(e.signum, member=args.train_only)


def without_python(message: str) -> str:
    """Training's `message` as this script's: it names the option and train()'s argument, "--resume
    (resume=True in Python)", and this script has the option alone."""
    return message.replace("--resume (resume=True in Python)", "--resume")


def stopped_outside_training(signum: int, member: bool) -> int:
    """A Ctrl-C, SIGTERM or SIGHUP outside training's updates (data preparation, averaging, decoding), in
    one line as `aiayn` says it ("interrupted", "stopped by SIGTERM"; a Ctrl-C was a traceback, a SIGTERM
    exited 143 without a word), and 128 + the signal, as a shell reports a process the signal killed. An
    --ensemble member then dies by it: wait_all tells that (nothing saved) from the 130 or 143 of a
    training that saved its update and stopped."""
    said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    print(f"run.py: {said}", file=sys.stderr)
    if member:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    return 128 + signum


def search_settings(args: argparse.Namespace) -> tuple[int, float | None]:
    """The beam and length penalty: the pair's (SEARCH) unless given. None at beam 1, where greedy search
    ranks nothing: a --lenpen there was recorded in the results and changed nothing (aiayn translate
    refuses it), and the pair's alpha was recorded as if used."""
    beam, lenpen = SEARCH[args.pair]
    beam = beam if args.beam is None else args.beam
    if beam == 1 and args.lenpen is not None:
        raise UserError(f"--lenpen {args.lenpen} has no effect at --beam 1 (greedy search ranks nothing): "
                        "drop it")
    lenpen = None if beam == 1 else lenpen if args.lenpen is None else args.lenpen
    with _settings_as_flags():  # said as the option, as aiayn translate says it, not as DecodeConfig's field
        # a bad --lenpen failed after the whole training
        DecodeConfig(beam=beam, **({} if lenpen is None else {"lenpen": lenpen}))
    return beam, lenpen


def run(args: argparse.Namespace) -> int:
    """Train (unless --no-train), average, translate val (and test), score; the results file."""
    env = environment()  # before the work: the load average at the start
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    # `--data=~/m30` comes unexpanded: its files were looked for in ./~/m30 (not found), though the
    # config expands the [data] paths made from it (train/config.py:_settle_paths)
    data = Path(args.data).expanduser()
    src, tgt = args.pair.split("-")
    if data.exists() and not data.is_dir():  # was "m30/train.en/train.en: file not found"
        here = data.parent.resolve()  # "(here .?)" of a bare name
        hint = f" (here {here}?)" if (here / f"train.{src}").is_file() else ""
        raise UserError(f"{data}: --data names a file; give the folder that holds the train, val and "
                        f"test_2016_flickr files{hint}")
    data_keys = [f"data.train_src={data / f'train.{src}'}", f"data.train_tgt={data / f'train.{tgt}'}",
                 f"data.valid_src={data / f'val.{src}'}", f"data.valid_tgt={data / f'val.{tgt}'}"]
    config = load_config(HERE / f"{args.pair}.toml", [*data_keys, *args.set])
    run_dir = Path(config.train.run_dir)

    beam, lenpen = search_settings(args)
    splits = list(SPLITS) if args.test else ["val"]
    for split in (splits if args.no_train else ["train", *splits]):  # before training, not after it
        for lang in (src, tgt):
            if not (data / f"{split}.{lang}").is_file():
                raise UserError(f"{data / f'{split}.{lang}'}: file not found")
    pairs = scored_pairs(data, splits, src, tgt)  # test_2016_flickr's files only with --test
    check_run_dir(run_dir, args.ensemble)
    start = time.monotonic()
    members, overrides = member_configs(args, config, data_keys)
    if args.resume or args.no_train:  # the runs' checkpoints are used (a rerun without --resume is refused)
        check_directions(members, src, tgt)
    before = [so_far(m.train.run_dir) for m in members]
    if args.ensemble and not args.no_train:
        check_member_dirs(members, args.resume)
        # the training pair as training checks it (line counts, UTF-8, no pairs), in one pass over each file:
        # both members said its error, then this script named them as failed, and RUN_DIR was left empty
        scan_parallel(members[0].data.train_src, members[0].data.train_tgt, report=False)
        train_members(args, overrides, [m.train.run_dir for m in members])
    # a signal at the budget's last update ends the training as usual, saved: the averaging and the decoding
    # after it are what must not run (they did, minutes of beam search, then exit 0)
    elif not args.no_train and (name := train(config, resume=args.resume).get("signal")):
        raise Stopped(f"stopped by {name} after the training, saved; --resume averages and decodes",
                      signal.Signals[name])
    if args.train_only:
        return 0
    after = [so_far(m.train.run_dir) for m in members]
    averaged = [average_last(m.train.run_dir, args.average) for m in members]
    seconds = [s for _, s in after]
    records, hyps = decoded(averaged, data, src, pairs, beam, lenpen)
    results = {"pair": args.pair, "train_s": None if None in seconds else round(max(seconds), 1),
               "updates": [u for u, _ in after], "checkpoints": [str(a) for a in averaged],
               "beam": beam, "lenpen": lenpen, "command": args.command,
               "cwd": current_directory(),  # where the command's relative paths (and the ones above) start
               "environment": env,
               # what the checkpoints were trained with, whatever options a --no-train was given
               "configs": [read_meta(a).get("config") for a in averaged],
               "results": records}
    # The whole run: this invocation's wall time and the training earlier invocations did (--resume).
    results["total_s"] = round(time.monotonic() - start + max(s or 0.0 for _, s in before), 1)
    write_results(args, run_dir, results, hyps, trained=[u for u, _ in after] != [u for u, _ in before])
    return 0


def check_directions(members: list[RunConfig], src: str, tgt: str) -> None:
    """Each run's newest checkpoint checked for the direction before anything is trained or averaged: a
    `--resume` with the other --pair (en-de is the default) trained a de-en run on en-de's files, then
    replaced its results.json, and averaging first rewrote a refused run's average_last_N."""
    for m in members:
        for newest in checkpoint_dirs(m.train.run_dir)[-1:]:  # none: training starts, or average_last says so
            check_direction(newest, src, tgt)


def decoded(averaged: list[Path], data: Path, src: str, pairs: dict[str, tuple[list[str], list[str]]],
            beam: int, lenpen: float | None) -> tuple[list[dict], dict[str, list[str]]]:
    """Each split of `pairs` translated by the averaged checkpoints (an ensemble of several) and scored:
    the splits' records, and their translations by split."""
    translator = Translator.load(averaged)
    check_lengths(translator, data, src, pairs)
    done = {s: score(translator, data / f"{s}.{src}", s, *pairs[s], beam, lenpen) for s in pairs}
    return [record for record, _ in done.values()], {s: hyps for s, (_, hyps) in done.items()}


def check_run_dir(run_dir: Path, ensemble: bool) -> None:
    """A single run and an --ensemble share the default RUN_DIR (runs/multi30k-PAIR): the ensemble's a/ and
    b/ went inside a single run's directory, and each replaced the other's results.json."""
    hint = "; give this one another directory (--set train.run_dir=...)"
    members = [run_dir / m for m in "ab" if checkpoint_dirs(run_dir / m)]
    single = bool(checkpoint_dirs(run_dir))
    if members and single:  # both, as the shared default left them: neither can be named
        raise UserError(f"{run_dir} holds a single run's checkpoints and --ensemble members "
                        f"({', '.join(map(str, members))}); move the members into a directory of their own "
                        "and give the --ensemble commands --set train.run_dir=THAT_DIRECTORY")
    if ensemble and single:
        raise UserError(f"{run_dir} holds a single run's checkpoints, not --ensemble members{hint}")
    if not ensemble and members:
        raise UserError(f"{run_dir} holds --ensemble members ({members[0]}), not a single run{hint}, "
                        "or add --ensemble")


def check_member_dirs(members: list[RunConfig], resume: bool) -> None:
    """What both --ensemble members' trainings would refuse, said once before they start: each member said
    it, then this script named one of them as the failure (three lines, exit 1). A rerun without --resume
    is refused as training refuses it; a run directory that is a file, as training would, but without
    making the directories (training removes a run directory it made and was refused in)."""
    for m in members:
        run_dir = Path(m.train.run_dir)
        for path in (run_dir.parent, run_dir):  # RUN_DIR, then RUN_DIR/a or /b
            try:
                os.lstat(path)
            except FileNotFoundError:
                break
            except OSError as e:  # a file above it: "Not a directory"
                raise UserError(f"{path}: train.run_dir cannot be used ({e.strerror or e})") from None
            if not path.is_dir():
                raise UserError(f"{path}: train.run_dir exists and is not a directory")
        if not resume:
            checkpoint_to_resume(run_dir, False, m.train.init_from)


def check_direction(checkpoint: Path, src: str, tgt: str) -> None:
    """`--no-train --pair en-de` on a de-en run scored it silently (BLEU 0.1), perhaps spending the
    once-only test score: a checkpoint whose training files go from .{tgt} to .{src} is refused."""
    data = (read_meta(checkpoint).get("config") or {}).get("data") or {}
    train_src, train_tgt = data.get("train_src"), data.get("train_tgt")
    if not (isinstance(train_src, str) and isinstance(train_tgt, str)):
        return  # not recorded (a converted checkpoint has no config): nothing to compare
    if Path(train_src).suffix == f".{tgt}" and Path(train_tgt).suffix == f".{src}":
        raise UserError(f"{checkpoint}: trained from {train_src} to {train_tgt}, the reverse of --pair "
                        f"{src}-{tgt}; give --pair {tgt}-{src}")


def member_configs(args: argparse.Namespace, config: RunConfig,
                   data_keys: list[str]) -> tuple[list[RunConfig], list[list[str]]]:
    """The runs to train and score: the recipe's, or the two --ensemble members' with their overrides."""
    if not args.ensemble:
        return [config], []
    check_partner_keys(args.partner or [])
    overrides = member_overrides(args, Path(config.train.run_dir), config.train.threads)
    try:
        members = [load_config(HERE / f"{args.pair}.toml", [*data_keys, *m]) for m in overrides]
        if not args.no_train:  # --no-train scores runs trained already, however they were configured
            # a fine-tune's [model] is refused there, by its --set item
            check_members_differ(members, args.resume)
    except (ConfigError, UserError) as e:
        raise UserError(as_partner(str(e), args)) from None
    if not args.no_train:
        say_partner_over_set(args, members)
    return members, overrides


def say_partner_over_set(args: argparse.Namespace, members: list[RunConfig]) -> None:
    """The partner's items come after --set in member b (by design: they are what makes b differ), so a
    --set of the same key holds for member a alone: `--pair de-en --set model.d_model=32` trained b at
    de-en's 128, unsaid. Said in one line, each key with what b trains with and what --set gave."""
    def key(item: str) -> str:
        return item.split("=", 1)[0].strip()

    given = {key(item): item for item in args.set}  # the last --set of a key, as load_config takes it
    overridden = []
    for item in dict.fromkeys(args.partner or PARTNER[args.pair]):
        if key(item) in given and "." in key(item):
            section, name = key(item).split(".", 1)
            if len({repr(m.to_dict()[section].get(name)) for m in members}) > 1:  # as a and b train
                overridden.append(f"{item!r} over {given[key(item)]!r}")
    if overridden:
        whose = ("--partner overrides", "") if args.partner else (
            f"the {args.pair} recipe's partner items override", "; --partner replaces them")
        log.info("--ensemble member b: %s --set: %s (member a trains with --set's%s)", whose[0],
                 ", ".join(overridden), whose[1])


def as_partner(message: str, args: argparse.Namespace) -> str:
    """`message` with member b's partner items named as such: they go in as --set items, and a bad one was
    named --set's, the pair's PARTNER too, which no option wrote (de-en's `model.d_model=128` refused by a
    fine-tune's checkpoint)."""
    if args.partner:
        names = {item: f"--partner {item!r}" for item in args.partner}
    elif args.ensemble or args.recipe_partner:
        # an item the user wrote with --set too is --set's (member a refuses it as well); member b holds the
        # pair's items among its --set items once more
        given = args.set or []
        names = {item: f"the {args.pair} recipe's partner item {item!r} (replace it with --partner)"
                 for item in PARTNER[args.pair] if given.count(item) <= int(args.recipe_partner)}
    else:  # member a
        names = {}
    for item, name in names.items():
        message = message.replace(f"--set {item!r}", name)
    return message


def so_far(run_dir: str | Path) -> tuple[int, float | None]:
    """(updates, seconds of training) in the run's newest checkpoint, (0, 0.0) before any: the training
    time over every invocation, where a --resume's own clock saw only its part (17.5 s recorded as 2.5 s).
    Seconds are None where trainer.json cannot be read: scoring needs only the weights."""
    newest = checkpoint_dirs(run_dir)[-1:]
    if not newest:
        return 0, 0.0
    step = int(newest[0].name.removeprefix("step_"))
    try:
        state = json.loads((newest[0] / "trainer.json").read_text(encoding="utf-8"))["state"]
        return step, float(state["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return step, None


def current_directory() -> str | None:
    """The working directory, None where it is gone (deleted under the running command)."""
    try:
        return os.getcwd()
    except OSError:
        return None


def recorded_updates(path: Path) -> list[int] | None:
    """The `updates` a results file records, None where there is none to read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))["updates"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_results(args: argparse.Namespace, run_dir: Path, results: dict, hyps: dict[str, list[str]],
                  trained: bool) -> None:
    """results.json holds the figures of the invocation that trained the run; one that trained nothing
    (--no-train, a --resume of a finished run) writes results_scored.json, instead of replacing them, or
    results_scored_test.json when it scored test: a later val-only --no-train replaced the once-only test
    figures. A --resume that completes an extension stopped after its training (while averaging or
    decoding) trains nothing too, but results.json holds the shorter run's updates: it is rewritten.
    Each split's translations go beside it, a line a sentence, named in its record (`hypotheses`) after
    the results file: they were never written, and a look at them or another metric decoded again. Those of
    a split it does not list are removed (an older model's, named by no results file)."""
    recorded = recorded_updates(run_dir / "results.json")
    kept = args.no_train or (not trained and recorded == results["updates"])
    scored = "results_scored_test.json" if args.test else "results_scored.json"
    path = run_dir / (scored if kept else "results.json")
    run_dir.mkdir(parents=True, exist_ok=True)
    translations = {s: run_dir / f"{path.stem}.{s}.hyp.{args.pair.split('-')[1]}" for s in SPLITS}
    for record in results["results"]:  # before the file that names them
        written = translations[record["split"]]
        with atomic_output(written) as f:
            f.writelines(f"{h}\n" for h in hyps[record["split"]])
        record["hypotheses"] = written.name
    with atomic_output(path) as f:  # a failure half way through left the old figures cut short
        f.write(json.dumps(results, indent=2) + "\n")
    # after it: a --resume without --test rewrote results.json and left the older model's test translations
    for split in set(SPLITS) - {r["split"] for r in results["results"]}:
        translations[split].unlink(missing_ok=True)
    minutes = "?" if results["train_s"] is None else f"{results['train_s'] / 60:.1f}"
    print(f"{args.pair}: trained {minutes} min, total {results['total_s'] / 60:.1f} min; {path}")
    for r in results["results"]:
        for s in r["scores"]:
            print(f"  {r['split']:<17} {s['score']:6.2f}  {s['name']}  [{s['signature']}]")


if __name__ == "__main__":
    sys.exit(main())

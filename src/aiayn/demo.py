"""`aiayn demo`: watch a Transformer learn to translate, on a built-in task, on a CPU, in minutes.

Linear on purpose: generate the corpus (`demo_corpus`), write it to files, call the real training
path (`aiayn.train.loop.train`: SentencePiece, token batching, the paper's schedule, label smoothing,
checkpoints, curves), translate the held-out sentences of the last checkpoint with beam search,
measure exact match, draw the attention of one held-out sentence.

Everything follows from the seed: the corpus, the initialization, the batch order. The number of
threads is fixed too, since a matrix product summed in another order rounds differently.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from aiayn.attention import draw_attention, extract_attention, map_paths
from aiayn.checkpoint import load_checkpoint
from aiayn.config import ConfigError, check_types
from aiayn.decoding.options import cpu_seed_problem
from aiayn.demo_corpus import MAX_TRAIN_PAIRS, CorpusConfig, make_corpus, write_pairs
from aiayn.errors import (
    CorruptFile,
    Stopped,
    Terminated,
    UserError,
    control_character,
    non_utf8_name,
    on_an_errors_way_out,
)
from aiayn.files import atomic_output, check_directory_path
from aiayn.train.state import LOCK, RunBusy, RunLock, check_outside_checkpoints, checkpoint_dirs

log = logging.getLogger(__name__)

# Model and batch sizes by name. "small" is the default: 100% exact match after 1,200 updates, about
# 2 minutes of one CPU core. "tiny" exists for tests: seconds at their few updates, about half a minute at
# the default 1,200 (seed 1: 494/500 = 98.8% exact match, 35 s of training on a busy 2-core machine).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(model=dict(preset="micro", d_model=32, n_heads=2, d_ff=64, n_layers=1),
                 vocab_size=300, max_tokens=1024, warmup=50, lr_scale=0.3),
    "small": dict(model=dict(preset="tiny", d_model=64, n_heads=4, d_ff=256, n_layers=2, dropout=0.0),
                  vocab_size=500, max_tokens=2048, warmup=150, lr_scale=0.3),
    "medium": dict(model=dict(preset="tiny", d_model=128, n_heads=4, d_ff=512, n_layers=2, dropout=0.0),
                   vocab_size=500, max_tokens=2048, warmup=200, lr_scale=0.25),
}
# In OUT/data, says that the demo wrote the files there, so that a rerun may replace them: anything else
# there may be the user's own corpus, which the demo's train.en would silently overwrite.
MARKER = ".aiayn-demo"


@dataclass(frozen=True)
class DemoConfig:
    """What `run_demo` does."""

    out: str = "demo"  # folder for the corpus, the run (checkpoints, curves), translations and maps
    seed: int = 1  # corpus, initialization and batch order; 0 to 2**32 - 1 (cpu_seed_problem)
    size: str = "small"  # a key of SIZES
    steps: int = 1200  # training updates (the demo stops earlier if `minutes` run out); seed 1 gives 100%
    # exact match from 900 on
    minutes: float = 0.0  # wall-clock limit on training (0 = none): for slow machines
    n_train: int = 40_000  # training pairs
    n_test: int = 500  # held-out pairs, translated and scored at the end
    n_valid: int = 300  # held-out pairs for the validation loss during training
    beam: int = 4  # the paper's beam
    threads: int = 1  # torch threads: fixed, since sums in another order round differently; one,
    # since a model this small showed no clear gain from two on a shared 2-core machine
    examples: int = 8  # translations shown
    device: str = "cpu"  # where it trains and translates: cpu, or cuda (a GPU rounds differently, so its
    # model and figures differ from the CPU's)

    def __post_init__(self) -> None:
        check_types(self, ("out",))
        # `--out=~/x` and a quoted '~/x' come unexpanded: the corpus went to ./~/x/data while training,
        # which expands its paths (train/config.py:_settle_paths), read ~/x/data. One path throughout.
        object.__setattr__(self, "out", os.path.expanduser(self.out))  # frozen: settled once, as it is made
        if self.steps < 1 or self.n_test < 1 or self.n_valid < 1 or self.threads < 1:
            raise ConfigError("demo steps, n_test, n_valid and threads must be at least 1")
        problems = self._option_problems()
        if problems:
            raise ConfigError("demo " + "; ".join(problems))

    def _option_problems(self) -> list[str]:
        """Each value a command-line option sets, checked now: training takes minutes, and a bad beam
        or seed failed only after it (or after the corpus was written), naming no option."""
        problems = []
        if self.size not in SIZES:  # as --help lists them
            problems.append(f"--size {self.size!r} is not tiny, small or medium")
        if not (math.isfinite(self.minutes) and self.minutes >= 0):
            problems.append(f"--minutes {self.minutes} must be a finite number >= 0 (0 = no limit)")
        if problem := cpu_seed_problem(f"--seed {self.seed}", self.seed):  # as translate's
            problems.append(problem)
        if not 1 <= self.n_train <= MAX_TRAIN_PAIRS:
            problems.append(f"--train-pairs {self.n_train} must be between 1 and {MAX_TRAIN_PAIRS:,}")
        if self.device not in ("cpu", "cuda"):
            problems.append(f"--device {self.device!r} is not cpu or cuda")
        elif self.device == "cuda" and not torch.cuda.is_available():
            problems.append("--device cuda, but PyTorch sees no CUDA GPU")
        held_out = CorpusConfig().max_held_out - self.n_valid  # the validation pairs are held out too
        if self.n_test > held_out:
            problems.append(f"--test-pairs {self.n_test} is more than this task can hold out ({held_out:,})")
        if not self.out:  # Path("") is the current directory, not ./demo
            problems.append("--out is empty: give a folder name (default ./demo)")
        # the checkpoints record the corpus' paths: refused after the corpus, as data.train_src's
        if (shown := non_utf8_name(self.out)) is not None:
            problems.append(f"--out '{shown}': the name is not UTF-8, which the checkpoints record it in; "
                            "rename it")
        elif (found := control_character(self.out)) is not None:  # else refused as data.train_src, later
            problems.append(f"--out {self.out!r} holds {found}, which no path should have")
        # In translate's words: DecodeConfig's ("DecodeConfig: beam=0 ...") named no option. It takes any
        # beam from 1 to the vocabulary's size with `translate`'s early_stopping=False.
        vocabulary = SIZES[self.size]["vocab_size"] if self.size in SIZES else math.inf
        if self.beam < 1:
            problems.append(f"--beam {self.beam} must be at least 1")
        elif self.beam > vocabulary:  # ran out of memory after the training, and the run then blocked a rerun
            problems.append(f"--beam {self.beam} is more than the {vocabulary} pieces of the demo's "
                            "vocabulary")
        return problems


@dataclass
class DemoResult:
    accuracy: float  # exact match on the held-out pairs
    correct: int
    total: int
    examples: list[tuple[str, str, str]]  # (source, reference, hypothesis)
    checkpoint: Path
    files: dict[str, Path]  # translations, curves, attention maps
    train_seconds: float  # the updates' own clock, as train.max_minutes counts it (`training_seconds`)
    steps: int


def write_corpus(config: DemoConfig, data_dir: Path) -> tuple[list[tuple[str, str]], dict[str, Path]]:
    """The corpus as files train/valid/test .en/.de; returns the test pairs and the paths."""
    corpus = CorpusConfig(n_train=config.n_train, n_test=config.n_test + config.n_valid, seed=config.seed)
    train_pairs, held_out = make_corpus(corpus)
    valid_pairs, test_pairs = held_out[: config.n_valid], held_out[config.n_valid :]
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / MARKER).touch()  # first: a run killed while writing leaves files a rerun may replace
    except OSError as e:
        raise UserError(f"{data_dir}: cannot write the corpus ({e.strerror or e})") from None
    paths = {}
    for name, pairs in (("train", train_pairs), ("valid", valid_pairs), ("test", test_pairs)):
        paths[f"{name}_src"], paths[f"{name}_tgt"] = write_pairs(pairs, data_dir / name)
    log.info("corpus: %d training, %d validation, %d test pairs in %s (e.g. %r -> %r)", len(train_pairs),
             len(valid_pairs), len(test_pairs), data_dir, *train_pairs[0])
    return test_pairs, paths


def demo_run_config(config: DemoConfig, paths: dict[str, Path], run_dir: Path):
    """The training configuration of the demo: the real recipe at a small size."""
    from aiayn.train.config import run_config

    size = SIZES[config.size]
    return run_config({
        "model": dict(size["model"]),
        "data": dict(train_src=str(paths["train_src"]), train_tgt=str(paths["train_tgt"]),
                     valid_src=str(paths["valid_src"]), valid_tgt=str(paths["valid_tgt"]),
                     vocab_size=size["vocab_size"], shared_vocab=True, max_len=64),
        "train": dict(run_dir=str(run_dir), seed=config.seed, max_tokens=size["max_tokens"],
                      warmup=size["warmup"], lr_scale=size["lr_scale"], label_smoothing=0.1,
                      max_updates=config.steps, max_minutes=config.minutes, device=config.device,
                      threads=config.threads, valid_every=max(1, config.steps // 4), keep_last=2,
                      # the lr falls linearly toward 0 over the last quarter of the updates or minutes,
                      # whichever end first (README): validation NLL at update 1,200
                      # 0.112 for seeds 1, 2 and 3 (0.119, 0.116, 0.111 without), where a rounding change
                      # of the loss had moved seed 1's held-out exact match from 100% to 98.6% (with
                      # fairseq's attention initialization since c28395b: 0.113, 0.112, 0.111)
                      cooldown=0.25,
                      log_every=max(1, min(50, config.steps // 10))),
    }, where="demo")


def translate(checkpoint: Path, sources: list[str], beam: int, device: str = "cpu") -> list[str]:
    """Beam-search translations of `sources`, in order, through the library's `Translator`."""
    from aiayn.data.dataset import PROGRESS_SECONDS
    from aiayn.translate import Translator, progress_lines

    translator = Translator.load(checkpoint, device)
    # disable=None: no bar where stderr is not a terminal, as training's (`2>log` kept its carriage returns);
    # there a line every PROGRESS_SECONDS, as training's data preparation gives: `2>log` had no word for
    # the minutes of a large --test-pairs
    with tqdm(total=len(sources), desc="translating held-out sentences", unit="sent", leave=False,
              disable=None) as bar:
        progress = progress_lines(len(sources), PROGRESS_SECONDS, "held-out") if bar.disable else bar.update
        # early_stopping=False: this model is so sure of itself that three of the four beams are junk,
        # and fairseq's rule (stop once K hypotheses ended) ended searches on four junk hypotheses
        # before the right one, 7 tokens long, finished: 98.8% exact match instead of 100%.
        hyps = translator.hypotheses(sources, progress=progress, beam=beam, early_stopping=False)
    return [h[0].text if h else "" for h in hyps]


def run_demo(config: DemoConfig) -> DemoResult:
    """Corpus, training, evaluation, attention maps; see the module docstring."""
    check_out(Path(config.out))
    lock = lock_out(Path(config.out))
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _run_demo(config)
    finally:
        torch.set_num_threads(threads)  # the caller's setting, e.g. a test session's
        lock.release()


def _run_demo(config: DemoConfig) -> DemoResult:
    from aiayn.train.loop import train

    out = Path(config.out)
    run_dir = out / "run"
    check_earlier_run(run_dir)  # under the lock: a live demo's run is no earlier one
    remove_earlier_outputs(out)
    test_pairs, paths = write_corpus(config, out / "data")
    try:
        result = train(demo_run_config(config, paths, run_dir))
    except Stopped as e:  # the trainer's message says --resume, which the demo does not have
        raise stopped(signal.Signals(e.exit_status - 128), "during", run_dir) from None
    if "signal" in result:  # training ended as usual, at its budget: the translating is what may not run
        raise stopped(signal.Signals[result["signal"]], "after", run_dir)
    try:
        return _evaluate(config, result["step"], test_pairs)
    except BaseException as e:  # a stop after the training: said as one during it, the checkpoint named
        if (sig := stop_signal(e)) is None or on_an_errors_way_out(e):  # the CLI says that error
            raise
        raise stopped(sig, "after", run_dir) from None


def _evaluate(config: DemoConfig, steps: int, test_pairs: list[tuple[str, str]]) -> DemoResult:
    """Translate and score the held-out pairs with the run's last checkpoint, and draw its attention."""
    out = Path(config.out)
    run_dir = out / "run"
    ck = load_checkpoint(checkpoint_dirs(run_dir)[-1])
    seconds = training_seconds(ck.path)
    log.info("trained %d update%s in %.0f s; translating %d held-out sentences (beam %d)", steps,
             "s"[: steps != 1], seconds, len(test_pairs), config.beam)
    hyps = translate(ck.path, [s for s, _ in test_pairs], config.beam, config.device)
    correct = sum(h == t for h, (_, t) in zip(hyps, test_pairs))
    files = {"translations": out / "test.hyp.de", "curves": run_dir / "curves.png"}
    with atomic_output(files["translations"]) as f:  # a full disk: one line, no half-written file
        f.write("".join(f"{h}\n" for h in hyps))
    source, reference = pick_example(test_pairs)
    maps = extract_attention(ck.model, ck.tokenizer, source, reference)
    files.update(draw_attention(maps, out / "attention", title=f"{source} -> {reference}"))
    examples = [(s, t, h) for (s, t), h in zip(test_pairs, hyps)][: config.examples]
    return DemoResult(correct / len(test_pairs), correct, len(test_pairs), examples, ck.path, files, seconds,
                      steps)


def stopped(sig: signal.Signals, when: str, run_dir: Path) -> Stopped:
    """The demo stopped by `sig` `when` ("during", "after") its training, what it left said. After it, the
    training is whole: the commands that do what the demo had left to do are named."""
    saved = checkpoint_dirs(run_dir)  # `aiayn translate RUN_DIR` is refused: name the checkpoint
    if when == "after" and saved:
        out, ck = run_dir.parent, saved[-1]
        where = (f"trained, its checkpoint {ck} translates the held-out sentences (`aiayn translate {ck} "
                 f"-i {out / 'data' / 'test.en'} -o {out / 'test.hyp.de'}`) and draws attention (`aiayn "
                 f"attention --checkpoint {ck} --src SENTENCE --out {out / 'attention'}`); ")
    else:
        where = f"its checkpoint {saved[-1]} can translate (`aiayn translate`); " if saved else ""
    return Stopped(f"demo stopped by {sig.name} {when} training; {where}to run the demo again, delete "
                   f"{run_dir} or choose another --out", sig)


def stop_signal(e: BaseException) -> signal.Signals | None:
    """The signal that `e` stands for: Ctrl-C's KeyboardInterrupt, or the CLI's `Terminated` (SIGTERM,
    SIGHUP); None for others."""
    if isinstance(e, KeyboardInterrupt):
        return signal.SIGINT
    return signal.Signals(e.signum) if isinstance(e, Terminated) else None


def training_seconds(checkpoint: Path) -> float:
    """The training time `checkpoint` records, on the clock train.max_minutes counts: from the first update
    to the last, the validations and saves between them and its own validation included. The demo's own
    clock counted the tokenizer's training, the corpus' encoding and the model's building too: `--steps 1`
    reported "3 s of training"."""
    path = checkpoint / "trainer.json"
    try:
        return float(json.loads(path.read_text(encoding="utf-8"))["state"]["seconds"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptFile(f"{path}: corrupt training state ({e})") from None


def check_out(out: Path) -> None:
    """Refuse, before any work, an `--out` the demo cannot write or whose writing would lose data."""
    check_directory_path(out)  # `--out FILE` or `--out FILE/x`: a NotADirectoryError traceback later
    check_outside_checkpoints(out)  # the corpus was written into a checkpoint before training refused
    for name, want_dir in (("data", True), ("run", True), ("attention", True), ("test.hyp.de", False)):
        path = out / name
        if want_dir and path.is_symlink():  # written through: another demo's corpus or run overwritten
            raise UserError(f"{path}: is a symbolic link (to {os.readlink(path)}); the demo writes its own "
                            "folder there: remove the link or choose another --out")
        if (path.exists() or path.is_symlink()) and path.is_dir() != want_dir:
            kind = "directory" if want_dir else "file"
            raise UserError(f"{path}: is {'not ' if want_dir else ''}a directory; the demo writes a {kind} there")
    data = out / "data"
    if data.is_dir() and any(p.name != LOCK for p in data.iterdir()) and not (data / MARKER).exists():
        raise UserError(f"{data}: holds files that no demo wrote (it has no {MARKER}); choose another --out")
    if not (data / MARKER).exists():  # no demo wrote here: the translations, maps and run are the user's
        for path in (out / "test.hyp.de", out / "attention", out / "run"):
            if path.is_file() or (path.is_dir() and any(path.iterdir())):
                raise UserError(f"{path}: exists and no demo wrote it ({data} has no {MARKER}); "
                                "choose another --out")


def lock_out(out: Path) -> RunLock:
    """`out` for this demo alone, until it ends (OUT/data/.lock): two demos into one --out both passed
    `check_out`, both wrote data/, and one failed in training ("set another train.run_dir", no option of
    the demo's), the other's test.hyp.de no longer in line with data/test.en; or the second was told to
    delete the first one's live run/ as an earlier run."""
    data = out / "data"
    try:
        data.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{data}: cannot write the corpus ({e.strerror or e})") from None
    lock = RunLock(data)
    try:
        lock.acquire()
    except RunBusy as e:
        holder = f" (process {e.holder})" if e.holder else ""
        raise UserError(f"{out}: another demo is writing there{holder}; wait for it to end, or choose "
                        "another --out") from None
    return lock


def check_earlier_run(run_dir: Path) -> None:
    """Refuse a `run_dir` whose checkpoints training would refuse to train over. A demo stopped before its
    first checkpoint left nothing trained, but maybe a tokenizer, which training would reuse, or refuse as
    "trained for other data" (another --seed, --size or --train-pairs) naming train.run_dir: it goes."""
    if checkpoint_dirs(run_dir):
        raise UserError(f"{run_dir}: holds an earlier demo run; delete {run_dir} or choose another --out")
    left = [run_dir / name for name in ("spm.model", "source.spm", "target.spm", "tokenizer_inputs.json")
            if (run_dir / name).exists()]
    for path in left:
        try:
            path.unlink()
        except OSError as e:
            raise UserError(f"{path}: cannot delete the tokenizer a stopped demo left "
                            f"({e.strerror or e})") from None
    if left:
        log.info("%s: no checkpoint there; the tokenizer a stopped demo left is trained again", run_dir)


def remove_earlier_outputs(out: Path) -> None:
    """Remove an earlier demo's translations and maps before its corpus is replaced: a rerun stopped before
    its own were written left them beside a data/ they do not match (3 lines of test.hyp.de beside 40 of
    data/test.en). Only where a demo wrote (check_out: the marker), and only the files the demo writes
    (draw_attention keeps any other file in attention/)."""
    if not (out / "data" / MARKER).exists():  # check_out found none of them there
        return
    maps = out / "attention"
    earlier = [out / "test.hyp.de", *map_paths(maps).values()]
    removed = [path for path in earlier if path.is_file()]
    for path in removed:
        try:
            path.unlink()
        except OSError as e:
            raise UserError(f"{path}: cannot delete an earlier demo's output ({e.strerror or e})") from None
    with contextlib.suppress(OSError):  # left if the user keeps files of their own there
        maps.rmdir()
    if removed:
        log.info("%s: removed the earlier demo's translations and attention maps, which the new corpus "
                 "would not match", out)


def pick_example(pairs: list[tuple[str, str]]) -> tuple[str, str]:
    """A held-out date with reordering to see: "May 3rd, ..." puts the day after the month."""
    for source, target in pairs:
        if source[0].isupper() and not source.startswith("on"):
            return source, target
    return pairs[0]

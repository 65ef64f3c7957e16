"""Training checkpoints: the model checkpoint of `aiayn.checkpoint` plus everything `--resume` needs.

    runs/X/checkpoints/step_000100/   model.safetensors, meta.json, tokenizer (aiayn.checkpoint)
                                      trainer.safetensors: Adam moments and steps, RNG states (tensors)
                                      trainer.json: step, epoch, position in the epoch, Adam's
                                      hyper-parameters, Python RNG, loss-scaler state

Each checkpoint directory appears by an atomic rename, so the newest complete one is simply the
highest `step_*` directory (temporary ones start with a dot). No pickle anywhere.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import random
import re
import shutil
import socket
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file

from aiayn.checkpoint import (
    META,
    WEIGHTS,
    cut_short,
    enclosing_checkpoint,
    load_into,
    load_weights,
    meta_model_config,
    read_meta,
    save_checkpoint,
)
from aiayn.config import ModelConfig, resolved_settings, to_dict
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import CorruptFile, UserError
from aiayn.train.config import toml_value
from aiayn.train.distributed import Dist

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d+)$")
LOCK = ".lock"  # in the run directory: held by the one training run that writes there


class RunBusy(UserError):
    """Another process holds a `RunLock`; `holder` is what its lock says of it ("12 on host": its pid and
    machine; "" if nothing), for a caller's own words."""

    def __init__(self, message: str, holder: str):
        super().__init__(message)
        self.holder = holder


class RunLock:
    """The run directory for one training run at a time (process 0's; `flock`, which also holds on NFS):
    two runs in one directory deleted each other's checkpoints as they were written and interleaved their
    logs. Released when the process ends, however it ends."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.file = None

    def acquire(self) -> None:
        for _ in range(3):  # a refused run removing its run_dir as this one opened the lock: once or twice
            f = self._open()
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                f.seek(0)
                holder = f.read().strip()
                f.close()
                if e.errno not in (errno.EAGAIN, errno.EACCES):  # a filesystem without locks: no refusal
                    return
                raise RunBusy(f"{self.path.parent}: another training run is writing there"
                              f"{f' (process {holder})' if holder else ''}; wait for it to end, or set "
                              "another train.run_dir", holder) from None
            if self._still_named(f):
                break
            f.close()  # locked a file `release_made` unlinked: another run could lock the path's new one
        else:
            raise UserError(f"{self.path}: the run's lock keeps being removed; is another program deleting "
                            f"{self.path.parent}?")
        try:
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()} on {socket.gethostname()}\n")
            f.flush()
        except OSError as e:  # a full disk: released at once, not when the traceback is collected
            self.path.unlink(missing_ok=True)  # still ours: an empty lock left behind names no holder
            with contextlib.suppress(OSError):  # close flushes the unwritten line again, and fails again
                f.close()
            raise UserError(f"{self.path}: cannot write the run's lock ({e.strerror or e})") from None
        self.file = f

    def _open(self) -> IO[str]:
        try:
            return open(self.path, "a+", encoding="utf-8")
        except FileNotFoundError:  # the directory too was removed by a run refused meanwhile: made again
            with contextlib.suppress(OSError):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                return open(self.path, "a+", encoding="utf-8")
            raise UserError(f"{self.path}: cannot open the run's lock (its directory is gone)") from None
        except OSError as e:
            raise UserError(f"{self.path}: cannot open the run's lock ({e.strerror or e})") from None

    def _still_named(self, f: IO[str]) -> bool:
        """Whether the file `f` locked is still the one at the lock's path."""
        try:
            here, there = os.fstat(f.fileno()), os.stat(self.path)
        except OSError:
            return False
        return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)

    def release(self) -> None:
        if self.file is not None:
            self.file.close()  # closing releases the lock
            self.file = None

    def release_made(self) -> None:
        """Release the lock of a run that made its run directory and was refused or stopped before it
        wrote anything there: the directory, holding the lock alone, goes too (refusals left an empty run
        directory behind, which the next try's listing then had to explain). Unlinked while held: a run
        that had opened it finds, once it holds it, that it is no longer at the path, and opens the path
        again (`acquire`), making the directory anew if it is gone."""
        if self.file is not None:
            with contextlib.suppress(OSError):
                if [p.name for p in self.path.parent.iterdir()] == [LOCK]:
                    self.path.unlink()
                    self.path.parent.rmdir()
        self.release()


@dataclass
class TrainState:
    """Where training is: enough, with the weights, optimizer and RNGs, to continue bit for bit."""

    step: int = 0  # updates done
    epoch: int = 0  # current epoch, from 0
    cursor: int = 0  # update-sized groups of batches used in the current epoch (skipped fp16 updates too)
    best_valid: float = float("inf")  # best validation loss so far
    bad_validations: int = 0  # validations since the best one (for `patience`)
    best_step: int = 0  # the update whose validation loss is best_valid: `prune` keeps its checkpoint
    seconds: float = 0.0  # training wall time so far, over all invocations (for max_minutes, cooldown)
    validation_due: bool = False  # a signal's save skipped this step's validation: --resume makes it first
    epoch_updates: int = 0  # updates an epoch had (the corpus' batches): --resume on another corpus sees it
    train_digest: str = ""  # sha256 of the training pairs' ids the epoch's position counts in ("" unrecorded)
    valid_digest: str = ""  # sha256 of the validation pairs' ids best_valid was measured on ("" before any)
    # The best_step of each earlier label_smoothing or validation set (a resume changed it, and the best
    # started again): `prune` keeps them too, since no loss measured since compares with theirs
    earlier_bests: list[int] = field(default_factory=list)


def step_dir_name(step: int) -> str:
    """The name of update `step`'s checkpoint directory (STEP_DIR reads it back)."""
    return f"step_{step:06d}"


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def run_of_checkpoints_folder(directory: str | Path) -> Path | None:
    """The run directory whose checkpoints/ `directory` is, by its name (`run1/checkpoints`, or "." inside
    it, whose name is ""), else None; whether it holds checkpoints is `checkpoint_dirs`' to say."""
    if Path(os.path.abspath(directory)).name != "checkpoints":
        return None
    here = Path(directory)
    return here.parent if here.name not in ("", "..") else here / ".."


def runs_meant(directory: str | Path) -> list[Path]:
    """The run directories that a user who gave `directory`, no run directory itself, may have meant: its
    `run/` (a demo's --out folder, `demo`, whose run is demo/run) and the run whose checkpoints/ it is
    (`run_of_checkpoints_folder`); whether one is a run is the caller's to say (`plot` and `average`
    look for different files)."""
    here = Path(directory)
    return [run for run in (here / "run", run_of_checkpoints_folder(here)) if run is not None]


def training_owned(path: str | Path) -> tuple[str, Path] | None:
    """("is" or "lies inside", the folder) where `path` is or lies inside a training run's checkpoints/
    (one holding its step_N checkpoints, or beside its metrics.jsonl), else None. Training resumes from
    and prunes what is there: anything else written there is deleted, or read as a checkpoint."""
    # As written, then with links followed (`--out cpl/x`, cpl a link to a run's checkpoints/, wrote there).
    for target in (Path(os.path.abspath(path)), Path(os.path.realpath(path))):
        for place in (target, *target.parents):
            run = place.parent
            if place.name == "checkpoints" and ((run / "metrics.jsonl").is_file() or checkpoint_dirs(run)):
                return ("is" if place == target else "lies inside"), place
    return None


def check_outside_checkpoints(output: Path, may_be_one: bool = False) -> None:
    """An output (a file, or a folder of pictures) may not be or lie inside any checkpoint directory (one
    with weights and meta.json), read or not, nor inside a training run's checkpoints/: training's
    keep_last deletes such directories whole, a step_N there is read as a checkpoint, and `average` or
    `export` read them. `may_be_one`: an output that is itself a checkpoint (average and convert with
    --force replace theirs) may be one, but not lie inside another."""
    if (inside := enclosing_checkpoint(output, itself=not may_be_one)) is not None:
        relation, place = inside  # "is the checkpoint /abs/B" read as if B were the input
        where = "is an aiayn checkpoint" if relation == "is" else f"{relation} the checkpoint {place}"
        raise UserError(f"{output}: {where}; write it elsewhere")
    if (owned := training_owned(output)) is not None:  # a step_N name there is pruned or read by training
        relation, place = owned
        raise UserError(f"{output}: {relation} {place}, which training owns (it resumes from and prunes what "
                        "is there); write it elsewhere")


def prune(run_dir: str | Path, keep_last: int, best_step: int = 0, earlier_bests: Iterable[int] = ()) -> None:
    """Keep the newest `keep_last` checkpoints and that of update `best_step` (the best validation loss:
    a run stopped by `patience` ends `patience` validations after it, and keep_last <= patience deleted
    it), and those of `earlier_bests` (the best of an earlier label smoothing or validation set, whose
    loss no later one compares with: deleted once the best started again, a better model could go
    silently); clear what killed runs left half-written.

    A checkpoint saved on a signal (meta.json's "interrupted") is there to resume from: it never counts
    toward keep_last and goes once a newer one is saved, so that a run stopped and resumed keeps (and
    `aiayn average --last` reads) the checkpoints of a run never stopped, not one at the signal's update.

    An old checkpoint is first renamed out of view (hidden), then deleted: a kill mid-delete never
    leaves a half-deleted directory that looks like a checkpoint. Called by the only writer, right
    after a save, so no hidden directory is still being written.
    """
    root = Path(run_dir) / "checkpoints"
    found = checkpoint_dirs(run_dir)
    interrupted = [c for c in found if is_interrupted(c)]
    regular = [c for c in found if c not in interrupted]
    kept = {step_dir_name(step) for step in (best_step, *earlier_bests)}
    old = [c for c in regular[:-keep_last] if c.name not in kept]
    for stale in old + [c for c in interrupted if c != found[-1]]:
        try:
            os.rename(stale, stale.with_name(f".{stale.name}.deleting"))
        except OSError as e:  # right after a save that holds everything: a traceback stopped a healthy run
            log.warning("%s: could not delete this old checkpoint (%s); training goes on", stale,
                        e.strerror or e)
    for hidden in root.glob(".step_*"):  # those just hidden, and what killed runs left
        shutil.rmtree(hidden, ignore_errors=True)


def is_interrupted(checkpoint: Path) -> bool:
    """Whether `checkpoint` was saved on a signal; one whose meta.json cannot be read counts as not."""
    try:
        return json.loads((checkpoint / META).read_text(encoding="utf-8")).get("interrupted") is True
    except (OSError, ValueError, AttributeError):
        return False


def rng_states(d: Dist) -> dict[str, torch.Tensor]:
    """Every process' torch RNG state (dropout), gathered so that process 0 can save them all."""
    states = {"cpu": torch.get_rng_state()}
    if d.device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(d.device)
    out = {}
    for name, state in states.items():
        if d.enabled:  # every process calls this: all_gather is collective
            gathered = [torch.empty_like(state, device=d.device) for _ in range(d.world_size)]
            dist.all_gather(gathered, state.to(d.device))
            out.update({f"rng.{name}.{r}": g.cpu() for r, g in enumerate(gathered)})
        else:
            out[f"rng.{name}.0"] = state
    return out


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Adam's state as flat tensors (`optimizer.<param>.<name>`) and its parameter groups (JSON)."""
    sd = optimizer.state_dict()
    tensors = {f"optimizer.{p}.{k}": v for p, s in sd["state"].items() for k, v in s.items()}
    return tensors, sd["param_groups"]


def save_training_checkpoint(
    run_dir: Path,
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    state: TrainState,
    config: dict[str, Any],
    metrics: dict[str, Any],
    rngs: dict[str, torch.Tensor],
    interrupted: bool = False,
) -> Path:
    tensors, groups = optimizer_tensors(optimizer)
    trainer = {
        "state": asdict(state),
        "param_groups": groups,
        "python_rng": random.getstate(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
    }
    # The epoch counted from 1, as the progress line and metrics.jsonl count it (TrainState's is 0-based).
    meta = {"step": state.step, "epoch": state.epoch + 1, "config": config, "metrics": metrics}
    with contextlib.suppress(OSError):  # where relative data paths are: `aiayn info` run elsewhere says them
        meta["workdir"] = os.getcwd()
    # process 0's CPU threads, as counted (train.threads=0 is the machine's count): another sums in another
    # order, which --resume says (`resume._say_other_threads`); None on a GPU, whose sums they do not make
    on_cpu = next(model.parameters()).device.type == "cpu"
    meta["threads"] = torch.get_num_threads() if on_cpu else None
    if interrupted:  # saved on a signal, to resume from: `prune` lets it go once a newer one is saved
        meta["interrupted"] = True
    path = Path(run_dir) / "checkpoints" / step_dir_name(state.step)
    # The weights were checked for NaN on the device before every save (loop._check_finite_weights, which
    # stops a diverged run with its own message): not scanned a second time on their CPU copies
    # owned: a re-save of a step (a signal's save, validated on resume) replaces it with a .DS_Store in it
    return save_checkpoint(path, model, tokenizer, meta, {**tensors, **rngs}, trainer, check_weights=False,
                           owned=True)


def own_random_stream(seed: int, rank: int) -> None:
    """Give process `rank` a random stream of its own for dropout: every process was seeded with `seed`, so
    each drew the same masks over its batch's first rows. Process 0 keeps `seed`'s stream as it is (a run
    of one process is as it was)."""
    if rank:
        torch.manual_seed(seed + 1_000_003 * rank)


def restore(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    d: Dist,
) -> TrainState:
    """Load weights, optimizer, scaler and this process' RNG state from a training checkpoint."""
    check_compatible(path, model.config)
    weights = {k: v.to(d.device) for k, v in load_weights(path).items()}
    # The weights file named, not the directory, and as damaged (a CorruptFile, which resume.resume_hint
    # answers with the checkpoint before): the model is its meta.json's (check_compatible), so a tensor
    # missing or of another shape is the file's fault, as a NaN is
    try:
        load_into(model, weights, path / WEIGHTS)
    except CorruptFile:
        raise
    except UserError as e:
        raise CorruptFile(str(e)) from None
    tensors, trainer = _read_trainer(path)
    saved = _train_state(trainer.get("state"), path)
    written = read_meta(path).get("step")  # an edited "state": {} resumed at update 0 over trained weights
    if isinstance(written, int) and written != saved.step:
        raise CorruptFile(f"{path / 'trainer.json'}: corrupt training state (step={saved.step}, but "
                          f"meta.json says {written})")
    check_named_step(path, saved.step)
    state_by_param = _adam_state(tensors, optimizer, path / "trainer.safetensors", saved.step)
    _check_param_groups(trainer.get("param_groups"), optimizer, path / "trainer.json")
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict({"state": state_by_param, "param_groups": trainer["param_groups"]})
        _keep_configured(optimizer, configured, path)
        rank = d.rank if f"rng.cpu.{d.rank}" in tensors else 0
        torch.set_rng_state(tensors[f"rng.cpu.{rank}"])
        if d.device.type == "cuda" and f"rng.cuda.{rank}" in tensors:
            torch.cuda.set_rng_state(tensors[f"rng.cuda.{rank}"], d.device)
        if rank != d.rank:  # saved by fewer processes: process 0's stream, made this process' own
            own_random_stream(int(torch.randint(2**62, (1,))), d.rank)
        random.setstate(_as_tuple(trainer["python_rng"]))
        if scaler.is_enabled() and trainer.get("scaler"):
            scaler.load_state_dict(trainer["scaler"])
        return saved
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise UserError(f"{path}: training state does not fit this run ({e})") from None


def check_named_step(path: Path, step: int) -> None:
    """A step_N that holds another update (renamed, or linked in from another run) is a CorruptFile: the run
    resumed there and pruned the newer checkpoints as older, at every resume."""
    named = STEP_DIR.match(path.name)
    if named and int(named[1]) != step:
        raise CorruptFile(f"{path}: holds update {step}, not {int(named[1])} as its name says "
                          "(renamed or linked in by hand?)")


def _keep_configured(optimizer: torch.optim.Optimizer, configured: list[dict[str, Any]], where: Path) -> None:
    """Adam's settings are this run's configuration (train.adam_beta1, adam_beta2, adam_eps), on --resume
    as on a fresh start, and a change is said: loading the saved param_groups had put the old ones back
    silently, while the new checkpoints' meta.json recorded the new ones. The moments carry on."""
    for group, mine in zip(optimizer.param_groups, configured):
        changed = [f"{k} {_plain(group[k])} -> {_plain(v)}" for k, v in mine.items()
                   if k in ("betas", "eps", "weight_decay") and _plain(group[k]) != _plain(v)]
        group.update(mine)  # lr too: the schedule sets it before every update
        if changed:
            log.info("%s: Adam's %s, as configured now", where, ", ".join(changed))


def _plain(value: Any) -> Any:
    """A hyper-parameter as JSON holds it: (0.9, 0.98) and [0.9, 0.98] alike."""
    return list(value) if isinstance(value, (list, tuple)) else value


def _train_state(saved: Any, path: Path) -> TrainState:
    """trainer.json's "state", each field of its type (a hand's edit, "120" for 120, failed in arithmetic)
    and range (a negative step shifted the schedule, a negative cursor trained on the wrong batches)."""
    if not isinstance(saved, dict):
        raise CorruptFile(f"{path / 'trainer.json'}: corrupt training state ('state' is not a table)")
    for f in fields(TrainState):
        value = saved.get(f.name, f.default_factory() if f.default is MISSING else f.default)
        kinds = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "list[int]": (list,)}
        if (isinstance(value, bool) and f.type != "bool") or not isinstance(value, kinds[f.type]):
            what = {"int": "a whole number", "float": "a number", "bool": "true or false",
                    "str": "a string", "list[int]": "a list"}[f.type]
        elif f.type == "int" and not 0 <= value <= 2**53:  # past 2^53 the schedule's float math fails
            what = "a whole number from 0 to 2^53"
        elif f.type == "float" and (value < 0 or not (_finite(value) or (f.name == "best_valid"
                                                                          and value == math.inf))):
            what = "a finite number, at least 0"
        elif f.type == "list[int]" and not all(type(v) is int and 0 < v <= 2**53 for v in value):
            what = "a list of whole numbers from 1 to 2^53"
        else:
            continue
        raise CorruptFile(f"{path / 'trainer.json'}: corrupt training state ({f.name}={value!r} is "
                          f"not {what})")
    unknown = sorted(set(saved) - {f.name for f in fields(TrainState)})
    if unknown:  # a newer aiayn's field, or a hand's edit: a TypeError traceback
        raise CorruptFile(f"{path / 'trainer.json'}: corrupt training state (unknown field(s) "
                          f"{', '.join(map(repr, unknown))} in 'state')")
    state = TrainState(**saved)
    if state.best_step > state.step:
        raise CorruptFile(f"{path / 'trainer.json'}: corrupt training state (best_step={state.best_step} is "
                          f"past step={state.step})")
    if max(state.earlier_bests, default=0) > state.step:
        raise CorruptFile(f"{path / 'trainer.json'}: corrupt training state (earlier_bests="
                          f"{state.earlier_bests} holds a step past step={state.step})")
    return state


ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")  # each parameter's, once it has had a gradient
ADAM_SETTINGS = ("lr", "betas", "eps", "weight_decay", "params")  # every torch's Adam saves these; newer
# torch versions add flags (decoupled_weight_decay, ...) that loading an older group fills with defaults


def _adam_state(tensors: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                where: Path, updates: int) -> dict[int, dict[str, torch.Tensor]]:
    """trainer.safetensors' `optimizer.<param>.<name>` tensors as Adam's per-parameter state, each checked
    against this run's parameters: a damaged moment (another shape, a NaN) loaded without complaint and
    surfaced two updates later as a diverged run, and a missing one as a KeyError at the first update.
    After `updates` applied updates every trained parameter has its state: one without was loaded with
    its moments and step count restarted, and the run diverged from the one it continues."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    amsgrad = any(group.get("amsgrad") for group in optimizer.param_groups)
    names = ADAM_STATE + (("max_exp_avg_sq",) if amsgrad else ())
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if not name.startswith("optimizer."):
            continue
        _, index, key = (name.split(".", 2) + ["", ""])[:3]
        problem = None
        if not (index.isascii() and index.isdigit()) or int(index) >= len(params) or key not in names:
            problem = "is no Adam state of this model's parameters"
        elif not t.is_floating_point() or t.shape != (() if key == "step" else params[int(index)].shape):
            problem = f"has shape {tuple(t.shape)} and dtype {t.dtype}"
        elif not bool(torch.isfinite(t).all()) or (key != "exp_avg" and bool((t < 0).any())):
            problem = "holds a value that is not finite" + ("" if key == "exp_avg" else " and at least 0")
        if problem:
            raise CorruptFile(f"{where}: corrupt training state ({name} {problem})")
        state.setdefault(int(index), {})[key] = t
    for index, held in sorted(state.items()):
        if missing := [k for k in names if k not in held]:
            raise CorruptFile(f"{where}: corrupt training state (optimizer.{index} has no "
                              f"{', '.join(missing)})")
    stateless = [i for i, p in enumerate(params) if p.requires_grad and i not in state]
    if updates and stateless:
        raise CorruptFile(f"{where}: corrupt training state (no Adam state for parameter {stateless[0]} of "
                          f"{len(params)}, after {updates} updates)")
    return state


def _check_param_groups(groups: Any, optimizer: torch.optim.Optimizer, where: Path) -> None:
    """trainer.json's Adam hyper-parameters, each of the kind this run's optimizer holds (betas "x" was
    accepted, and the first update failed unpacking it), over this run's parameters in their order
    (another order would hand each parameter another's moments)."""
    ours = optimizer.state_dict()["param_groups"]
    tables = isinstance(groups, list) and all(isinstance(g, dict) for g in groups)
    if not tables or len(groups) != len(ours):
        raise CorruptFile(f"{where}: corrupt training state (param_groups is not {len(ours)} table(s))")
    for saved, group in zip(groups, ours):
        if missing := [k for k in ADAM_SETTINGS if k not in saved]:
            raise CorruptFile(f"{where}: corrupt training state (param_groups has no {', '.join(missing)})")
        if saved["params"] != group["params"] or not all(type(i) is int for i in saved["params"]):
            raise CorruptFile(f"{where}: corrupt training state (param_groups' params are not this model's "
                              f"{len(group['params'])} parameters in order)")
        for key, value in group.items():
            if key != "params" and key in saved and not _same_kind(saved[key], value):
                raise CorruptFile(f"{where}: corrupt training state (param_groups {key}="
                                  f"{saved[key]!r}, where this optimizer has {value!r})")


def _same_kind(saved: Any, ours: Any) -> bool:
    """Whether a saved hyper-parameter can stand where `ours` does: a flag for a flag (or None), a
    finite non-negative number for a number, a list of those of the same length for a list."""
    if ours is None or isinstance(ours, bool):
        return saved is None or isinstance(saved, bool)
    if isinstance(ours, (int, float)):
        return type(saved) in (int, float) and _finite(saved) and saved >= 0
    if isinstance(ours, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(ours) and all(map(_same_kind, saved, ours))
    return True


def _finite(value: float) -> bool:
    """A float that is not NaN or infinite, or an integer a float holds (JSON reads 10**400 as an int,
    which math.isfinite and torch's Adam fail to convert, with an OverflowError)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def model_differences(path: Path, config: ModelConfig) -> list[tuple[str, Any, Any]]:
    """Each setting of the model `config` that is not that of the checkpoint `path`: (name, the
    checkpoint's value, this run's), compared as what they mean (n_decoder_layers=6 restates a 6-layer
    run's None). A damaged value in its meta.json (d_model "32", -32) is named there, not as a change."""
    meta = read_meta(path)
    meta_model_config(path, meta)
    saved = meta["model"]
    mine = resolved_settings(to_dict(config))
    theirs = resolved_settings({key: saved.get(key) for key in mine})
    # Both n_layers' (None): another n_decoder_layers is n_layers' difference, said once as that
    follows = saved.get("n_decoder_layers") is None and config.n_decoder_layers is None
    return [(key, theirs[key], value) for key, value in mine.items()
            if theirs[key] != value and not (key == "n_decoder_layers" and follows)]


def check_compatible(path: Path, config: ModelConfig) -> None:
    """A checkpoint of another model gives one line naming every difference."""
    if differ := model_differences(path, config):
        said = "; ".join(f"{key}={toml_value(theirs)}, this run has {toml_value(mine)}"
                         for key, theirs, mine in differ)
        raise UserError(f"{path}: checkpoint from an incompatible model ({said}); --resume keeps the model's "
                        "settings")


def _read_trainer(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors_file, json_file = path / "trainer.safetensors", path / "trainer.json"
    if not tensors_file.is_file() or not json_file.is_file():
        raise UserError(
            f"{path}: no training state (trainer.safetensors / trainer.json); cannot resume from it"
        )
    try:
        tensors = load_file(str(tensors_file))
    except (SafetensorError, OSError, ValueError) as e:  # cut short: a copy's or the disk's, as for weights
        said = "training state damaged or cut short" if cut_short(e) else "corrupt training state"
        raise CorruptFile(f"{tensors_file}: {said} ({e})") from None
    try:  # its own message: the file to restore from a backup is this one, not the tensors
        trainer = json.loads(json_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise CorruptFile(f"{json_file}: corrupt training state ({e})") from None
    if not isinstance(trainer, dict):
        raise CorruptFile(f"{json_file}: corrupt training state (not a JSON object)")
    return tensors, trainer


def _as_tuple(x: Any) -> Any:
    """JSON turned random.getstate()'s tuples into lists; setstate needs them back."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, list) else x

"""Checkpoint averaging (paper section 6.1: the last 5 checkpoints for base, the last 20 for big)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, replace
from pathlib import Path

import torch

from aiayn.checkpoint import (
    CHECKPOINT_KIND,
    WEIGHTS,
    check_fits,
    check_meta_vocabulary,
    checkpoint_tokenizer,
    checkpoints_said,
    config_section,
    is_checkpoint,
    load_checkpoint,
    load_into,
    load_weights,
    meta_model_config,
    not_found,
    read_meta,
    save_checkpoint,
    stored_tensors,
    trained_on,
)
from aiayn.config import resolved_settings
from aiayn.data.tokenizer import Tokenizer
from aiayn.errors import UserError
from aiayn.files import MOVED_ASIDE, AlreadyExists, check_output, moved_aside, overlap
from aiayn.model import Transformer
from aiayn.train.state import (
    STEP_DIR,
    check_outside_checkpoints,
    checkpoint_dirs,
    is_interrupted,
    run_of_checkpoints_folder,
    runs_meant,
)

log = logging.getLogger(__name__)


class RunningMean:
    """The element-wise mean of state dicts with the same names and shapes, added one at a time into a
    float64 sum: a checkpoint in memory at a time, not all of them (the paper's last 20 of `big` held
    17 GB at once). Whole-number and boolean tensors (a counter, a mask) have no mean of their kind: they
    must agree, and are kept (their mean was truncated toward zero, or a boolean OR, and int64 past 2^53
    rounded)."""

    def __init__(self) -> None:
        self.total: dict[str, torch.Tensor] = {}
        self.count = 0

    def add(self, state: dict[str, torch.Tensor]) -> None:
        for name, t in state.items():
            if not (t.is_floating_point() or t.is_complex()):
                if self.count and not torch.equal(t, self.total[name]):
                    raise ValueError(f"{name}: a {t.dtype} tensor that differs between the states has no "
                                     "mean of its kind")
                self.total[name] = t
            elif self.count:
                self.total[name] += t  # float64 += t's dtype: exact for every float32, bf16 or fp16 value
            else:
                self.total[name] = t.to(torch.complex128 if t.is_complex() else torch.float64, copy=True)
        self.count += 1

    def mean(self, dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """The means, each in its tensor's stored dtype; the sums are handed over as they go (a float64
        sum and its float32 mean of every tensor at once would be three models' worth)."""
        if not self.count:
            raise ValueError("nothing to average")
        means = {}
        for name in list(self.total):
            t = self.total.pop(name)
            means[name] = (t / self.count).to(dtypes[name]) if t.is_floating_point() or t.is_complex() else t
        self.count = 0
        return means


def average_state_dicts(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of several state dicts with the same names and shapes (in float64)."""
    mean = RunningMean()
    for s in states:
        mean.add(s)
    return mean.mean({n: t.dtype for n, t in states[0].items()} if states else {})


def check_same_tensors(path: Path, state: dict[str, torch.Tensor], ref_path: Path,
                       ref: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
    """`state` has the newest checkpoint's shapes and dtypes (`ref`). Both fit one model (`check_fits`: its
    tensor names and shapes, and finite values), whose float tensors may yet be stored in another float
    dtype: that is what this finds."""
    for name, t in state.items():
        if (t.shape, t.dtype) != ref[name]:
            shape, dtype = ref[name]
            raise UserError(f"{path}: weight {name} is {tuple(t.shape)} {t.dtype} but {tuple(shape)} "
                            f"{dtype} in {ref_path}; cannot average them")


def mean_weights(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The mean of the checkpoints' weights, read one file at a time, each checked against the model their
    meta.json describes (`check_same_model`: one model), then against the newest. The newest's header is
    checked first: a tensor gone from it, or of another shape or dtype, was the reference the intact older
    checkpoints were refused by ("step_000020: weight names differ from step_000030")."""
    with torch.device("meta"):  # shapes only
        model = Transformer(meta_model_config(paths[-1], read_meta(paths[-1])))
    newest = stored_tensors(paths[-1])
    check_fits(model, newest, paths[-1] / WEIGHTS)
    ref = {name: (t.shape, t.dtype) for name, t in newest.items()}
    mean = RunningMean()
    for i, p in enumerate(paths):
        state = load_weights(p)
        check_fits(model, state, p / WEIGHTS)  # and finite: a NaN was blamed on the newest, into which the
        check_same_tensors(p, state, paths[-1], ref)  # mean was loaded
        mean.add(state)
        del state
        log.info("read %d/%d: %s", i + 1, len(paths), p)
    return mean.mean({name: dtype for name, (_, dtype) in ref.items()})


def check_same_tokenizer(paths: list[Path], tokenizers: list[Tokenizer]) -> None:
    """Every checkpoint has the first's tokenizer (pieces, vocabularies, special ids), as an ensemble
    must: the same weight shapes under another spm.model mean different tokens at the same ids."""
    for p, tokenizer in zip(paths[1:], tokenizers[1:]):
        if not tokenizer.same_as(tokenizers[0]):
            raise UserError(f"{p}: its tokenizer differs from {paths[0]}'s; cannot average them")


def warn_other_seeds(paths: list[Path], metas: list[dict]) -> None:
    """One warning when the checkpoints come from runs with different train.seed: independently
    trained models, whose average is usually garbage (not refused: related runs can be intended)."""
    seeds = [(p, (config_section(m, "train") or {}).get("seed")) for p, m in zip(paths, metas)]
    known = [(p, s) for p, s in seeds if s is not None]
    if len({json.dumps(s) for _, s in known}) > 1:
        log.warning("averaging checkpoints of runs with different train.seed (%s): independently trained "
                    "models average into a broken one", ", ".join(f"{p}: {s}" for p, s in known))


def warn_other_data(paths: list[Path], metas: list[dict]) -> None:
    """One warning when the checkpoints are recorded as trained on other files, or in the other direction
    (train_src and train_tgt swapped), as their meta.json records them: two such runs of one seed were
    averaged silently (`warn_other_seeds`), into a broken model as well. Each pair of files is named once,
    with its first checkpoint. Paths as recorded do not tell (`_same_file`)."""
    first: list[tuple[tuple[str, str], Path]] = []
    for p, meta in zip(paths, metas):
        files = trained_on(meta)
        if files is None:
            continue
        files = (os.path.normpath(files[0]), os.path.normpath(files[1]))
        if not any(all(map(_same_file, files, seen)) for seen, _ in first):
            first.append((files, p))
    if len(first) > 1:
        log.warning("averaging checkpoints of runs recorded as trained on other files (%s): models of other "
                    "data or direction average into a broken one",
                    ", ".join(f"{p}: {src} -> {tgt}" for (src, tgt), p in first))


def _same_file(a: str, b: str) -> bool:
    """Whether two recorded training files are taken for one: where both are on this machine, whether
    they are one file (a link to it under another name, a run moved with its data here); where one is
    not (a run moved from another machine, each job's scratch copy: /scratch/job1/tr.de and
    /scratch/job2/tr.de, an older aiayn's relative path), whether they have the same name. Whole paths
    warned of one run's data recorded otherwise; names alone missed two data sets of the usual names
    (/data/wmt14-en-de/train.de, /data/iwslt17-en-de/train.de), which are both here where it matters."""
    if os.path.isabs(a) and os.path.isabs(b):  # a relative one (no workdir recorded) is not to be found
        try:
            return os.path.samefile(a, b)
        except (OSError, ValueError):  # one is not on this machine
            pass
    return os.path.basename(a) == os.path.basename(b)


def average_checkpoints(paths: list[Path], out: str | Path, force: bool = False, *,
                        replace_average: bool = False) -> Path:
    """Average the weights of `paths` (checkpoints of one model) into a new checkpoint `out`.

    An existing `out` is replaced only with `force`, and never when it is or holds one of `paths`;
    `replace_average` (`average_last`'s default output) replaces one that is an earlier average."""
    if isinstance(paths, (str, bytes, os.PathLike)):  # one path: a str was read character by character
        raise TypeError(f"paths is a list of checkpoints: pass [{os.fsdecode(paths)!r}]")  # ("r: not an ...")
    if not paths:
        raise UserError("no checkpoints to average")
    paths = [Path(p) for p in paths]  # strings failed at `directory / META`
    check_outside_checkpoints(Path(out), may_be_one=True)  # first (--force cannot mend it); Python callers
    check_output(out, list(paths), force, earlier=CHECKPOINT_KIND)  # too: keep_last deleted it there
    metas = [read_meta(p) for p in paths]
    tokenizers = []  # each read once, for both checks
    for p, meta in zip(paths, metas):  # an edited vocab_size was "a different model", or blamed on the weights
        tokenizers.append(checkpoint_tokenizer(p, meta))
        check_meta_vocabulary(p, meta_model_config(p, meta), tokenizers[-1])
    check_same_model(paths, metas)
    check_same_tokenizer(paths, tokenizers)
    warn_other_seeds(paths, metas)
    warn_other_data(paths, metas)
    mean = mean_weights(paths)  # first: the check of every file comes before a model is built
    last = load_checkpoint(paths[-1])
    tensors = dict(last.model.named_parameters()) | dict(last.model.named_buffers())
    for name, t in mean.items():  # each in its stored dtype: bf16 checkpoints were saved from the float32
        if name in tensors and t.is_floating_point():  # model as float32, twice the size (a tied weight is
            tensors[name].data = tensors[name].data.to(t.dtype)  # one Parameter, named once in `mean`)
    load_into(last.model, mean, paths[-1])
    # The newest member's meta, less what describes it alone: a signal's save is an average's no more
    # (save_checkpoint writes "format", "model" and "tokenizer" of its own)
    meta = {k: v for k, v in last.meta.items() if k != "interrupted"}
    meta["averaged"] = [os.path.abspath(p) for p in paths]  # relative, they meant nothing from elsewhere
    # --force replaces a training checkpoint too (save_checkpoint refuses one, for a resave in place); the
    # rest is checked again at the write (files may have come in the minutes this took), and without
    # --force any `out` there (another average into it: the first one's result was replaced silently)
    # (an average there now, with `replace_average`, is another `average RUN` run at once: replaced as the one
    # before it would have been, not refused with an advice to pass --force that a rerun does not need)
    saved = save_checkpoint(out, last.model, last.tokenizer, meta, replace_training_state=force,
                            exist_ok=force or (replace_average and is_average(Path(out))))
    # after the write: a failed one is not reported as done
    log.info("averaged %s into %s", checkpoints_said(len(paths)), saved)
    return saved


def check_same_model(paths: list[Path], metas: list[dict]) -> None:
    """All of `paths` hold one model. Otherwise the odd one out is named (the one whose model fewer of
    them share; with two, both), with a setting that differs: each was compared with the newest, which
    blamed every other checkpoint when the newest was the damaged one. The models are compared as they
    load (a setting left out of meta.json is its default, as loading reads it), less their dropout, which
    shapes training and not the weights (a fine-tune's may differ), and each None as what it means
    (n_decoder_layers None is n_layers, as a fine-tune may restate it)."""
    configs = [resolved_settings(asdict(replace(meta_model_config(p, m), dropout=0.0)))
               for p, m in zip(paths, metas)]
    models = [json.dumps(c, sort_keys=True) for c in configs]
    if len(set(models)) == 1:
        return
    odd = min(range(len(paths)), key=lambda i: (models.count(models[i]), -i))  # the rarest, newest first
    other = next(i for i in reversed(range(len(paths))) if models[i] != models[odd])
    a, b = configs[odd], configs[other]
    diff = next((f" ({k} {a[k]!r} against {b[k]!r})" for k in a if a[k] != b[k]), "")
    if models.count(models[other]) == 1:  # two, or all different: nothing tells which is odd
        raise UserError(f"{paths[odd]} and {paths[other]}: different models{diff}; cannot average them")
    raise UserError(f"{paths[odd]}: a different model from the other checkpoints{diff}; cannot average them")


def _wrong_directory_hint(directory: Path) -> str:
    """What to give instead, when `directory` is a checkpoint itself, a run's checkpoints folder or a folder
    holding a run (`average demo` said only "no checkpoints found": the demo's run is demo/run)."""
    if is_checkpoint(directory):
        return " (it is a checkpoint: give the run directory whose last checkpoints to average)"
    run = next((run for run in runs_meant(directory) if checkpoint_dirs(run)), None)  # "." inside too
    if run is None:
        return ""
    if run == run_of_checkpoints_folder(directory):
        return f" (it is a run's checkpoints folder: give the run directory, {run})"
    return f" (the run directory is {run})"  # as `plot demo` says it


def is_average(directory: Path) -> bool:
    """Whether `directory` is a checkpoint written by an earlier average (its meta.json says "averaged")."""
    try:
        return directory.is_dir() and not directory.is_symlink() and "averaged" in read_meta(directory)
    except UserError:
        return False


def _warn_out_of_window(chosen: list[Path]) -> None:
    """Say when the last k checkpoints reach past the run's train.keep_last: the older ones survive only
    as its best validation's (or from a larger keep_last earlier), kept from much earlier, and the average
    mixes them with the recent ones (averaging 5, 35 and 40 looked like three consecutive checkpoints)."""
    try:
        keep_last = (config_section(read_meta(chosen[-1]), "train") or {}).get("keep_last")
    except UserError:
        return  # the average names the damaged checkpoint itself
    if isinstance(keep_last, int) and not isinstance(keep_last, bool) and 0 < keep_last < len(chosen):
        older = ", ".join(p.name for p in chosen[:-keep_last])
        log.warning("%s: kept beyond train.keep_last=%d (the run's best validation, or an earlier "
                    "keep_last), averaged with %s to %s",
                    older, keep_last, chosen[-keep_last].name, chosen[-1].name)


def _regular(found: list[Path], log_skipped: bool) -> list[Path]:
    """The checkpoints of `found` not saved on a signal. That one is there to resume from, one or a few
    updates after the last regular save: averaged, it counted twice the same weights and pushed out an
    older checkpoint (as `state.prune` keeps it out of keep_last). A run with no other keeps it."""
    regular = [p for p in found if not is_interrupted(p)]
    if not regular:
        return found
    if log_skipped and len(regular) < len(found):
        log.info("left out %s: saved on a signal, to resume from",
                 ", ".join(p.name for p in found if p not in regular))
    return regular


def _refuse_moved_aside(run_dir: Path) -> None:
    """A checkpoint that a save killed as it replaced it left moved aside (`files.moved_aside`) is not
    listed: the last k were silently others. Named, not put back: a training run starting in `run_dir`
    meanwhile would have been refused its lock (one run at a time, `state.RunLock`), and it puts the
    checkpoint back itself."""
    root = run_dir / "checkpoints"
    for old in sorted(root.glob(f".step_*{MOVED_ASIDE}")):
        checkpoint = root / old.name[1:-len(MOVED_ASIDE)]
        if STEP_DIR.match(checkpoint.name) and moved_aside(checkpoint) is not None:
            raise UserError(f"{checkpoint}: {not_found(checkpoint)}; average the run's last checkpoints once "
                            "it is back")


PRUNED_RETRIES = 3  # a run training in run_dir may prune a listed checkpoint before it is read


def average_last(run_dir: str | Path, k: int, out: str | Path | None = None, force: bool = False) -> Path:
    """Average a run's last `k` checkpoints into `out`, by default `run_dir/average_last_N`.

    N counts the checkpoints averaged (fewer than `k` in a short run), so that the name tells what is
    inside. The default output replaces an earlier average there (averaging again after more training
    is the usual workflow), but nothing else; an existing `out` given by name needs `force`. Neither
    may be or lie inside the run's `checkpoints`, nor be or contain the run directory.
    """
    run_dir = Path(run_dir)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:  # found[-0:] would be every checkpoint
        raise UserError(f"average the last {k!r} checkpoints: give a whole number >= 1")
    if not run_dir.is_dir():  # was "no checkpoints found", as if it were a run that had saved none
        raise UserError(f"{run_dir}: {'is not a directory' if run_dir.exists() else 'no such run directory'}")
    if out is not None:  # before the listing and its warnings, and "already exists": --force cannot mend it
        check_outside_checkpoints(Path(out), may_be_one=True)
    _refuse_moved_aside(run_dir)
    for attempt in range(PRUNED_RETRIES + 1):
        found = _regular(checkpoint_dirs(run_dir), log_skipped=attempt == 0)
        if not found:
            raise UserError(f"{run_dir}: no checkpoints found{_wrong_directory_hint(run_dir)}")
        if len(found) < k and attempt == 0:
            log.warning("%s: only %s where %d were asked for; averaging %s", run_dir,
                        checkpoints_said(len(found)), k, "that one" if len(found) == 1 else "those")
        chosen = found[-k:]
        if attempt == 0:
            _warn_out_of_window(chosen)
        target = run_dir / f"average_last_{len(chosen)}" if out is None else out
        replace = force or (out is None and is_average(target))
        root = run_dir / "checkpoints"
        if (relation := overlap(Path(target), root)) in ("is", "lies inside"):  # "contains": the check below
            raise UserError(f"{target}: {relation} {root}, which training owns (it resumes from and prunes "
                            "what is there)")
        check_output(target, [], replace, enclosing=[run_dir], earlier=CHECKPOINT_KIND, forced=force)
        try:
            return average_checkpoints(chosen, target, replace, replace_average=out is None)
        except UserError as e:
            if (out is None and isinstance(e, AlreadyExists) and e.path == Path(target)
                    and is_average(Path(target))):
                # another average landed during this one's write, too late to be replaced
                raise UserError(f"{target}: another average was written there meanwhile; run again") from None
            if all(p.is_dir() for p in chosen):  # a real problem, not a run pruning what was listed
                raise
            log.info("%s: the training run pruned a checkpoint while it was read; listing again", run_dir)
    raise UserError(f"{run_dir}: the training run there pruned the last {k} checkpoints while they were read, "
                    f"{PRUNED_RETRIES + 1} times; average after it stops, or raise its train.keep_last")

"""What `--resume` checks before the training loop starts: which checkpoint it continues from, and what the
configuration it is given may change of the run that checkpoint records.

- Which checkpoint: `checkpoint_to_resume` (the latest; without --resume, a run directory that holds
  checkpoints is refused), `what_resume_does` (as a stopped job's error says it), `read_resumed` and
  `resume_hint` (a damaged latest checkpoint's error names the one before, to go on from).
- train.init_from, also in a run moved or copied with it (`fine_tuned_from`, `same_init_from`,
  `init_from_here`), and [data]'s tokenizer settings against a checkpoint's, which a fine-tune adopts
  or refuses (`with_checkpoint_tokenizer_settings`, `refuse_tokenizer_settings`).
- The configuration against the one the checkpoint's meta.json records (`compare_with_trained`): other
  batches, another model or another tokenizer refused, every such setting in one line (`Kept`); another
  precision, schedule, validation set or number of CPU threads said.
- The restored `TrainState` against this run's corpus, validation set and smoothing
  (`epoch_on_this_corpus`, `same_validation`, `same_smoothing`, `best_still_there`).

Apart from `loop`, so that the loop reads as one linear function of short ones (the guide's habit 9): all
of this runs once, before the first update, and compares a checkpoint's record with the configuration;
none of it trains. `loop` calls it; it imports nothing of `loop` (`Data` for a type hint alone).
"""

from __future__ import annotations

import filecmp
import logging
import math
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from aiayn.checkpoint import (
    META,
    WEIGHTS,
    check_meta_describes_weights,
    check_meta_vocabulary,
    checkpoint_tokenizer,
    config_section,
    meta_model_config,
    read_meta,
)
from aiayn.config import PRESETS, ConfigError
from aiayn.data.dataset import tokenizer_differences, tokenizer_setting_changes, tokenizer_settings
from aiayn.errors import CorruptFile, UserError
from aiayn.train import distributed
from aiayn.train.config import (
    SETTING,
    TOKENIZER_FIELDS,
    TOKENIZER_SETTINGS,
    DataConfig,
    RunConfig,
    finetune_model_config,
    toml_value,
    vocabulary_model_config,
)
from aiayn.train.distributed import Dist, SameOnEveryProcess
from aiayn.train.state import TrainState, check_named_step, checkpoint_dirs, model_differences, step_dir_name

if TYPE_CHECKING:
    from aiayn.train.loop import Data

T = TypeVar("T")
log = logging.getLogger(__name__)


def what_resume_does(run_dir: Path) -> str:
    """What --resume would do now, as a stopped job's error says it (`checkpoint_to_resume` picks the
    same): the checkpoint it continues from, or the beginning, where "the last checkpoint" was said too."""
    try:
        found = checkpoint_dirs(run_dir)
    except OSError:  # the job's own error matters more than this listing's
        return "--resume continues from the last checkpoint, if one was saved"
    return f"--resume continues from {found[-1].name}" if found else \
        "--resume starts from the beginning: no checkpoint was saved yet"


def read_resumed(d: Dist, run_dir: Path, resume_from: Path | None, work: Callable[[], T]) -> T:
    """`work`, reading the checkpoint to resume from (or init_from's) on every process: its errors with
    `resume_hint`'s hint, said once for all processes (`distributed.on_every`)."""

    def hinted() -> T:
        with resume_hint(run_dir, resume_from):
            return work()

    return distributed.on_every(d, hinted)


@contextmanager
def resume_hint(run_dir: Path, resume_from: Path | None):
    """A damaged latest checkpoint (a failing disk: kills never leave one) stops --resume; say how to go
    on from the one before instead of leaving the user to find out."""
    try:
        yield
    except UserError as e:  # damaged: unreadable (CorruptFile), or a file of it missing
        found = checkpoint_dirs(run_dir)
        # a file of the checkpoint's, not the run directory's own tokenizer, which no other checkpoint mends
        inside = resume_from is not None and str(e).startswith((f"{resume_from}{os.sep}", f"{resume_from}:"))
        missing = resume_from is not None and _missing_files(resume_from)
        damaged = (isinstance(e, CorruptFile) and inside) or missing
        if not damaged or resume_from is None or len(found) < 2 or found[-1] != resume_from:
            raise
        raise CorruptFile(f"{e}; to resume from {found[-2].name} instead, move {resume_from} out of "
                          f"{resume_from.parent}") from None


def _missing_files(checkpoint: Path) -> list[str]:
    """The files a training checkpoint must hold that `checkpoint` lacks (its tokenizer's as its
    meta.json names them, when that can be read)."""
    names = [META, WEIGHTS, "trainer.safetensors", "trainer.json"]
    try:
        files = read_meta(checkpoint).get("tokenizer", {}).get("files", {})
        names += [f for f in files.values() if isinstance(f, str)] if isinstance(files, dict) else []
    except (UserError, AttributeError):
        pass  # no or unreadable meta.json: already missing, or named by the error itself
    return [n for n in names if not (checkpoint / n).is_file()]


def checkpoint_to_resume(run_dir: Path, resume: bool, init_from: str = "") -> Path | None:
    found = checkpoint_dirs(run_dir)
    if resume and not found:  # killed before its first save: a restart loop passing --resume goes on
        log.info("%s: no checkpoint to resume from yet; starting from the beginning", run_dir)
        return None
    if not resume and found and init_from and not same_init_from(found[-1], fine_tuned_from(found[-1]),
                                                                 init_from):
        # --resume, which the plain hint offered, was then refused: the run there fine-tunes no init_from
        raise UserError(f"{run_dir}: already holds the checkpoints of a run that did not fine-tune "
                        f"{init_from}; set another train.run_dir")
    if not resume and found:
        raise UserError(
            f"{run_dir}: already holds checkpoints; pass --resume (resume=True in Python) to continue, "
            "or another run_dir"
        )
    return found[-1] if resume else None


def with_checkpoint_tokenizer_settings(config: RunConfig, resume_from: Path | None) -> RunConfig:
    """Fine-tuning keeps the checkpoint's tokenizer, so [data]'s tokenizer settings left at their defaults
    take the values the checkpoint records: a run.toml naming only its files was refused ("vocab_size was
    300, now 8000": a default, not a change), or printed and saved 8,000 pieces for a 300-piece model.
    A value set (`RunConfig.given_data_keys`), even to the default, is still refused
    (`refuse_tokenizer_settings`), also when the run is resumed."""
    if not config.train.init_from:
        return config
    source = resume_from or Path(config.train.init_from)
    try:
        saved = config_section(read_meta(source), "data") or {}
    except UserError:  # not a checkpoint: `loop.initial_checkpoint` says so in its own words
        return config
    defaults, given = DataConfig(), config.given_data_keys() or frozenset()
    if "vocab_size" not in saved:  # a converted Marian model, one saved by hand, or a fine-tune of either
        if set_here := [k for k in TOKENIZER_SETTINGS if k in given]:  # was taken, ignored and recorded
            # each named, and where it was written, as `refuse_tokenizer_settings` does: the first alone
            # was, naming neither the file's line nor the --set item
            settings, them = [f"data.{k}" for k in set_here], "it" if len(set_here) == 1 else "them"
            raise UserError(f"{config.written_where(*settings)}{source}: records no tokenizer settings "
                            "(imported, or saved outside training), and its tokenizer is kept: "
                            f"{', '.join(settings)} cannot be set (drop {them})")
        return replace(config, tokenizer_imported=True)
    adopted = {k: saved[k] for k in config_tokenizer_settings(config)
               if k in saved and type(saved[k]) is type(getattr(defaults, k))  # a hand's edit: compared later
               and k not in given and getattr(config.data, k) == getattr(defaults, k)}
    return replace(config, data=replace(config.data, **adopted)) if adopted else config


def refuse_tokenizer_settings(config: RunConfig, meta: dict, path: Path) -> None:
    """Fine-tuning keeps the checkpoint's tokenizer: [data] tokenizer settings other than those it records
    could not take effect (they were ignored, and printed as the run's configuration). A checkpoint that
    records none (a converted Marian model) is not compared."""
    saved = config_section(meta, "data")
    if saved is None or "vocab_size" not in saved:  # see `with_checkpoint_tokenizer_settings`
        return
    if changes := tokenizer_setting_changes(saved, config_tokenizer_settings(config)):
        raise UserError(f"{tokenizer_written_at(config, saved)}{path}: train.init_from keeps this "
                        f"checkpoint's tokenizer ({'; '.join(changes)}); drop the change")


def tokenizer_written_at(config: RunConfig, saved: dict) -> str:
    """A refusal's start naming where [data]'s tokenizer settings other than `saved`'s were written."""
    return config.written_where(*(f"data.{key}" for key, value in config_tokenizer_settings(config).items()
                                  if tokenizer_setting_changes(saved, {key: value})))


def left_at_defaults(config: RunConfig) -> list[str]:
    """[data]'s tokenizer settings written nowhere, at their defaults."""
    return [key for key in TOKENIZER_SETTINGS if config.is_default(f"data.{key}", getattr(config.data, key))]


def config_tokenizer_settings(config: RunConfig) -> dict:
    dc = config.data
    return tokenizer_settings(dc.vocab_size, dc.spm_type, dc.shared_vocab, dc.normalization,
                              dc.character_coverage)


def same_init_from(checkpoint: Path, saved: str | None, given: str) -> bool:
    """Whether train.init_from `given` names `saved`, the one the run that saved `checkpoint` fine-tuned (or
    both are empty): as written, the same directory, or, in a copy or move of the run with it, the one at
    the same place relative to the run directory. Recorded absolute, `saved` names the old place, where a
    copied project's own checkpoint was refused; a resume never reads init_from again, and another
    checkpoint beside the run, or the same name from elsewhere, is still refused."""
    if not saved or not given:
        return not saved and not given
    try:
        if saved == given or Path(saved).resolve() == Path(given).resolve():
            return True
    except (OSError, RuntimeError):  # a symlink loop
        return False
    moved = _moved_with_run(checkpoint, saved)
    return moved is not None and os.path.abspath(moved) == os.path.abspath(given)


def init_from_here(checkpoint: Path, saved: str) -> str:
    """The train.init_from to resume with: `saved`, as recorded, or where the run was moved or copied with it
    and `saved` is gone, the one at the same place relative to the run directory (which `same_init_from`
    takes): the old place, deleted, was advised."""
    return saved if os.path.lexists(saved) else _moved_with_run(checkpoint, saved) or saved


def _moved_with_run(checkpoint: Path, saved: str) -> str | None:
    """`saved`, the init_from the run that saved `checkpoint` recorded, at the same place relative to where
    that run's directory is now (RUN/checkpoints/step_N); None where it was recorded as written (before
    aiayn recorded it absolute) or meta.json does not say where the run was."""
    if not os.path.isabs(saved) or (trained_in := _recorded_run_dir(checkpoint)) is None:
        return None
    return os.path.normpath(os.path.join(checkpoint.parent.parent, os.path.relpath(saved, trained_in)))


def _recorded_run_dir(checkpoint: Path) -> str | None:
    """The absolute run directory that saved `checkpoint`, as its meta.json records it (the directory it
    ran in, and train.run_dir as written there), or None where it does not."""
    meta = read_meta(checkpoint)
    workdir, run_dir = meta.get("workdir"), (config_section(meta, "train") or {}).get("run_dir")
    if not isinstance(workdir, str) or not isinstance(run_dir, str) or not os.path.isabs(workdir):
        return None
    return os.path.join(workdir, run_dir)


def fine_tuned_from(checkpoint: Path) -> str | None:
    """The train.init_from that the run which saved `checkpoint` started from, if it was a fine-tuning run."""
    config = read_meta(checkpoint).get("config", {})
    if not isinstance(config, dict):
        raise CorruptFile(f"{checkpoint / 'meta.json'}: corrupt checkpoint metadata ('config' is not a table)")
    train_config = config.get("train", {})
    tuned_from = train_config.get("init_from") if isinstance(train_config, dict) else None
    if tuned_from is not None and not isinstance(tuned_from, str):  # a hand's edit: a TypeError traceback
        raise CorruptFile(f"{checkpoint / 'meta.json'}: corrupt checkpoint metadata "
                          f"(init_from={tuned_from!r} is not a path)")
    return tuned_from


# Settings --resume may change, each said in the log (Adam's own are said by `state.restore`, the number of
# CPU threads by `_say_other_threads`): the updates from there are computed otherwise, and a log that said
# nothing left no trace of why the curves bent
RESUME_CHANGES = ("precision", "compile", "lr_scale", "warmup", "cooldown", "label_smoothing", "clip_norm")


# With a cooldown, the budgets too: its lr is a fraction of the budget left (`loop._budget_used`), so another
# max_updates on --resume moved the lr (12 times higher, once) unsaid
BUDGETS = ("max_updates", "max_epochs", "max_minutes")


def _say_changed_settings(checkpoint: Path, trained: dict[str, Any] | None, config: RunConfig,
                          d: Dist) -> None:
    """Another train.precision or compile (rounding otherwise: a compiled run resumes close to, not bit
    for bit as, an unbroken one), learning-rate schedule, label smoothing or clipping on --resume is
    allowed, and said, one line each; so is another budget where a cooldown, trained or resumed with,
    makes the lr depend on it, and another train.bleu_lang where BLEU is scored."""
    cooled = (trained or {}).get("cooldown") or config.train.cooldown
    # another bleu_lang scores on another scale (13a, then char): said, as `plot` draws it apart
    scored = ("bleu_lang",) if config.train.bleu_every and (trained or {}).get("bleu_every") else ()
    for key in RESUME_CHANGES + (BUDGETS if cooled else ()) + scored:
        saved, now = (trained or {}).get(key), getattr(config.train, key)
        if saved is not None and saved != now and d.is_main:
            log.info("%s: trained with train.%s=%s, resumed with %s", checkpoint, key, toml_value(saved),
                     toml_value(now))


def _say_other_validation(checkpoint: Path, data: dict[str, Any] | None, config: RunConfig, d: Dist) -> None:
    """Another validation set on --resume, or none, is said, as other settings are: dropped, the run went on
    without validating, unsaid (another set's pairs restart the best loss, `same_validation`)."""
    files = ("valid_src", "valid_tgt")
    saved = [(data or {}).get(key) for key in files]
    now = [getattr(config.data, key) for key in files]
    if not d.is_main or not all(isinstance(path, str) for path in saved):
        return
    trained, resumed = (", ".join(f"data.{key}={toml_value(path)}" for key, path in zip(files, paths))
                        for paths in (saved, now))
    if any(saved) and not any(now):
        log.info("%s: trained with the validation set %s, resumed without one: no validation from here",
                 checkpoint, trained)
    elif any(now) and not any(saved):
        log.info("%s: trained without a validation set, resumed with %s", checkpoint, resumed)
    elif any(saved) and any(map(_other_text, saved, now)):
        log.info("%s: trained with %s, resumed with %s", checkpoint, trained, resumed)


def _other_text(saved: str, now: str) -> bool:
    """Whether the validation file `saved` (as the checkpoint records it) holds other text than `now`. The
    same text under another path is the same set; a relative path recorded from another directory, not
    there from this one, cannot be compared and is not said (it was, as other files, on every resume from
    elsewhere): other pairs restart the best loss, which `same_validation` says."""
    try:
        return not filecmp.cmp(saved, now, shallow=False)
    except OSError:
        return False


def _say_other_threads(checkpoint: Path, meta: dict[str, Any], trained: dict[str, Any] | None, threads: int,
                       d: Dist) -> None:
    """Another number of CPU threads on --resume sums in another order (the weights then differ from an
    unbroken run's, as with another precision): said, with the counts where the checkpoint records the
    one it trained with (train.threads=0 is the machine's own, another on another machine); else another
    train.threads. On a GPU the threads sum nothing of the model's."""
    if d.device.type != "cpu" or not d.is_main:
        return
    setting, count = (trained or {}).get("threads"), meta.get("threads")
    now = threads or torch.get_num_threads()  # set after this check: the machine's, or the caller's
    if "threads" in meta:  # counted, or None: trained on a GPU, which another device's change is not said of
        if type(count) is int and count != now:
            log.info("%s: CPU threads trained with %d, resumed with %d (train.threads=%d)", checkpoint, count,
                     now, threads)
    elif setting is not None and setting != threads:  # saved before the count was recorded
        log.info("%s: trained with train.threads=%r, resumed with %r", checkpoint, setting, threads)


def compare_with_trained(checkpoint: Path, config: RunConfig, d: Dist) -> dict[str, Any] | None:
    """--resume's configuration against the one `checkpoint`'s meta.json records (read once): another
    precision, schedule, smoothing or clipping said; other batches, another model or another tokenizer
    refused, every such setting in one line (one a try was four tries to find four). Returns that
    [train]."""
    meta = read_meta(checkpoint)
    if type(meta.get("step")) is int:  # first: a link to another run's checkpoint was refused for its
        check_named_step(checkpoint, meta["step"])  # tokenizer, or its model, and never said to be one
    trained, data = config_section(meta, "train"), config_section(meta, "data")
    _say_changed_settings(checkpoint, trained, config, d)
    _say_other_validation(checkpoint, data, config, d)
    _say_other_threads(checkpoint, meta, trained, config.train.threads, d)
    kept = _other_batches(checkpoint, trained, data, config, d)
    # One resumed without its init_from, or a run that fine-tuned none resumed with one, is refused by
    # `loop.initial_checkpoint`, saying which: its model and tokenizer are not compared (without init_from,
    # [data] adopted none of a fine-tune's tokenizer settings, whose defaults were refused as changes)
    tuned = config.train.init_from, (trained or {}).get("init_from")
    if all(tuned):
        kept += _other_finetune_model(checkpoint, meta, config)
    elif not any(tuned):
        kept += _other_model(checkpoint, meta, config)
    recorded = data is not None and "vocab_size" in data  # else `with_checkpoint_tokenizer_settings`'s
    if recorded and (all(tuned) or not any(tuned)):
        defaults = left_at_defaults(config)
        kept += [Kept(f"data.{key}", toml_value(was), toml_value(now), "tokenizer",
                      "the default" if key in defaults else "")
                 for key, was, now in tokenizer_differences(data, config_tokenizer_settings(config))]
    if kept:
        raise _resume_refusal(checkpoint, config, kept)
    return trained


@dataclass(frozen=True)
class Kept:
    """A setting --resume keeps that the resumed run's configuration changes: `setting` was `trained`, is
    `now` (both as TOML writes them), `note` says where that came from ("the default", "from
    model.preset='tiny'"), `written` is the setting whose place the refusal names, if not `setting` (the
    preset, for its values), `why` what the setting makes: the run's "batches", "model" or "tokenizer";
    `fix`, where setting it as trained is not the way (another number of processes), what is."""

    setting: str
    trained: str
    now: str
    why: str
    note: str = ""
    written: str = ""
    fix: str = ""


def _resume_refusal(checkpoint: Path, config: RunConfig, kept: list[Kept]) -> SameOnEveryProcess:
    """One line naming every setting in `kept`, each with the value to set, after where they were written:
    "run.toml:3: ck: trained with data.max_len=64 (resumed with the default 256), ...; --resume continues
    the run with ...". Settings a preset gives are said together, with the preset."""
    groups: list[list[Kept]] = []
    for k in kept:  # a preset's settings together, where its first is, also with a written one between
        group = next((g for g in groups if k.note.startswith("from ") and g[0].note == k.note), None)
        if group:
            group.append(k)
        else:
            groups.append([k])
    said = []
    for group in groups:
        now, note = _and_list([k.now for k in group]), group[0].note
        resumed = f"the default {now}" if note == "the default" else f"{now} {note}".strip()
        if group[0].fix:  # "4 batches an update (4 processes x train.update_freq=1; resumed with 2 x 1)"
            said.append(f"{group[0].trained} ({group[0].setting}; resumed with {now})")
        else:
            said.append(f"{', '.join(f'{k.setting}={k.trained}' for k in group)} (resumed with {resumed})")
    whys = {k.why for k in kept}
    kinds = {"batches": "its batches (the saved position in the epoch counts them)", "model": "its model",
             "tokenizer": "its tokenizer"}
    what = _and_list([kind for why, kind in kinds.items() if why in whys])
    dropout = ("; to train on with another dropout, fine-tune from the checkpoint (train.init_from) in "
               "another train.run_dir" if any(k.setting == "model.dropout" for k in kept) else "")
    settings = [k.written or k.setting for k in kept]  # not "2 processes x train.update_freq=1"
    places = config.written_where(*filter(SETTING.fullmatch, settings))
    fixes, rest = [k.fix for k in kept if k.fix], len([k for k in kept if not k.fix])
    them = "it" if len(kept) == 1 else "them" if not fixes else "the other" + "s" * (rest > 1)
    remedy = " and ".join(fixes + [f"set {them} as trained"] * bool(rest))
    return SameOnEveryProcess(
        f"{places}{checkpoint}: trained with "
        f"{', '.join(said)}; --resume continues the run with {what}: {remedy}, or use a new "
        f"train.run_dir{dropout}")


def _and_list(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    *before, last = items
    return f"{', '.join(before)} and {last}" if before else last


def _other_finetune_model(checkpoint: Path, meta: dict[str, Any], config: RunConfig) -> list[Kept]:
    """A resumed fine-tune's model is its own checkpoint's with [model]'s dropout (`finetune_model_config`,
    which refuses any other [model] key): another dropout than it trained with was refused by `restore`,
    after the data work, naming neither the setting nor where it was written."""
    try:
        saved = meta_model_config(checkpoint, meta)
    except UserError:  # damaged: `loop.initial_checkpoint` names it
        return []
    tuned = finetune_model_config(config, saved, checkpoint)
    return [Kept(f"model.{key}", toml_value(theirs), toml_value(mine), "model")
            for key, theirs, mine in model_differences(checkpoint, tuned)]


def _other_model(checkpoint: Path, meta: dict[str, Any], config: RunConfig) -> list[Kept]:
    """[model] against the model `checkpoint` was trained with (as its meta.json records it), before the
    data work, each setting that differs named where it was written (its own line, or the preset's): the
    weights refused the first after the tokenizer and the caches were read, naming neither. Its tokenizer's
    fields are the checkpoint's, whose tokenizer a resumed run takes. A damaged meta.json is named as such:
    a value no model has (d_model "32"), or a model its weights do not fit (a meta.json copied from
    another run's checkpoint), was blamed on [model]."""
    saved = meta_model_config(checkpoint, meta)
    try:
        mine = vocabulary_model_config(config, **{key: meta["model"].get(key) for key in TOKENIZER_FIELDS})
    except ConfigError:  # the saved ids are no model's (a hand's edit)
        return []
    try:
        tokenizer = checkpoint_tokenizer(checkpoint, meta)
    except UserError:  # damaged: named where the run reads it
        tokenizer = None
    if tokenizer is not None:  # `mine`'s vocabulary is meta.json's: an edited vocab_size differed from
        check_meta_vocabulary(checkpoint, saved, tokenizer)  # nothing, and was blamed on the run late
    differ = model_differences(checkpoint, mine)
    if differ:  # another model: the run's, if the weights are meta.json's; else meta.json's fault
        check_meta_describes_weights(checkpoint, saved)
    preset = config.model.get("preset")
    from_preset = f"from {'the default ' * (preset is None)}model.preset={toml_value(preset or 'base')}"
    kept = []
    for key, theirs, now in differ:
        if key in config.model:
            note, written = "", ""
        elif key in PRESETS[preset or "base"]:
            note, written = from_preset, "model.preset"
        else:  # ModelConfig's own default
            note, written = "the default", ""
        kept.append(Kept(f"model.{key}", toml_value(theirs), toml_value(now), "model", note, written))
    return kept


def _other_batches(checkpoint: Path, trained: dict[str, Any] | None, data: dict[str, Any] | None,
                   config: RunConfig, d: Dist) -> list[Kept]:
    """The saved position in the epoch counts updates of (processes x update_freq) batches of max_tokens,
    in the order train.seed shuffles the pairs data.max_len keeps: resuming with another product,
    max_tokens, seed or max_len would train part of the epoch twice and skip the rest, so each is refused
    (the same product with other factors is the same batches per update, and is allowed). `trained` and
    `data`: the sections the checkpoint's meta.json records."""
    from safetensors import safe_open

    tc = config.train
    recorded = ((trained, "seed"), (data, "max_len"), (trained, "update_freq"), (trained, "max_tokens"))
    for section, key in recorded:
        value = (section or {}).get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):  # a hand's edit
            raise CorruptFile(f"{checkpoint / META}: corrupt checkpoint metadata ({key}={value!r} is not a "
                              "whole number)")
    kept = [_kept_batches(config, name, saved, value)
            for name, saved, value in (("train.seed", (trained or {}).get("seed"), tc.seed),
                                       ("data.max_len", (data or {}).get("max_len"), config.data.max_len))
            if saved is not None and saved != value]
    tensors = checkpoint / "trainer.safetensors"
    if not isinstance(trained, dict) or not tensors.is_file():
        return kept  # restore() names what is missing
    try:
        with safe_open(str(tensors), "pt") as f:
            processes = sum(1 for k in f.keys() if k.startswith("rng.cpu."))
    except Exception:  # a damaged file: restore() says so in its own words
        return kept
    update_freq, max_tokens = trained.get("update_freq") or 1, trained.get("max_tokens") or tc.max_tokens
    if processes and processes * update_freq != d.world_size * tc.update_freq:
        if processes == d.world_size:
            kept.append(_kept_batches(config, "train.update_freq", update_freq, tc.update_freq))
        else:  # another number of processes is the command's: the product is what must be as it was
            kept.append(_kept_product(processes, update_freq, d.world_size, tc.update_freq))
    if processes and max_tokens != tc.max_tokens:
        kept.append(_kept_batches(config, "train.max_tokens", max_tokens, tc.max_tokens))
    return kept


def _kept_product(processes: int, update_freq: int, world_size: int, now: int) -> Kept:
    """Another number of processes, which is no setting: the batches an update (processes x update_freq)
    to keep, by the update_freq that makes them with this many processes, or, where none does, by as many
    processes as trained ("set it as trained" said neither, and no update_freq made 1 of 2 processes)."""
    product = processes * update_freq
    if product % world_size == 0:
        freq = product // world_size
        fix = f"set train.update_freq={freq} ({world_size} process{'es' * (world_size > 1)} x {freq})"
    else:
        fix = f"resume it with {processes} process{'es' * (processes > 1)}" + (
            f" and train.update_freq={update_freq}" if update_freq != now else "")
    written = "train.update_freq" if update_freq != now else ""  # else the command's alone
    return Kept(f"{processes} process{'es' * (processes > 1)} x train.update_freq={update_freq}",
                f"{product} batch{'es' * (product > 1)} an update", f"{world_size} x {now}", "batches",
                written=written, fix=fix)


def _kept_batches(config: RunConfig, setting: str, trained: int, now: int) -> Kept:
    return Kept(setting, str(trained), str(now), "batches", "the default" * config.is_default(setting, now))


def epoch_on_this_corpus(state: TrainState, n_updates: int, digest: str, resume_from: Path | None,
                         d: Dist) -> None:
    """Where a resumed epoch stands. On another corpus (other pairs, `digest` of their ids, or an epoch of
    another number of updates) the saved position means nothing: the next epoch starts, from this
    corpus' first update, and that is said. (Told by the epoch's length alone, another corpus of as many
    updates went on mid-epoch, skipping the first part of its first epoch.) Otherwise the position must
    lie within the epoch, or trainer.json was damaged."""
    saved, state.epoch_updates = state.epoch_updates, n_updates
    saved_digest, state.train_digest = state.train_digest, digest
    same_length = saved in (0, n_updates)  # 0, "": a checkpoint that did not record it
    if resume_from is None or (same_length and saved_digest in ("", digest)):
        if state.cursor > n_updates:
            raise CorruptFile(f"{resume_from / 'trainer.json'}: corrupt training state (cursor={state.cursor} "
                              f"is past the {n_updates} updates of an epoch)")
        return
    if d.is_main:
        where = f"{resume_from.name} was saved (at update {state.cursor} of epoch {state.epoch + 1})"
        why = (f"the training pairs are not those of when {where}" if same_length else
               f"an epoch is {n_updates} updates on this corpus, {saved} when {where}")
        log.info("%s: epoch %d starts", why, state.epoch + 1 + (state.cursor > 0))
    if state.cursor > 0:
        state.epoch, state.cursor = state.epoch + 1, 0


def same_validation(state: TrainState, data: Data, run_dir: Path, d: Dist) -> None:
    """best_valid and patience hold on the pairs they were measured on. Resumed on another validation set,
    a run compared its losses with the old set's best: no validation was better, patience stopped it, and
    `prune` kept the old best's checkpoint. Then they start again, and that is said."""
    if data.valid is None:
        return
    digest = data.valid.digest()
    if state.valid_digest not in ("", digest) and state.best_valid != math.inf:
        _best_starts_again(state, "the validation pairs differ from those of the best validation loss so "
                                  f"far ({state.best_valid:.4f} at update {state.best_step})", run_dir, d)
    state.valid_digest = digest


def best_still_there(state: TrainState, run_dir: Path, d: Dist) -> None:
    """The best validation loss's checkpoint, deleted by hand (to free a full disk): the run went on
    measuring patience against it and its answer named the missing directory. It is said; the best stays
    the criterion (validation did not get better), and no answer names a checkpoint that is not there."""
    best = run_dir / "checkpoints" / step_dir_name(state.best_step)
    if state.best_step and d.is_main and not best.is_dir():
        log.warning("%s, the best validation loss so far (%.4f), is gone; train.patience still counts from "
                    "it, and the best checkpoint is named again once a validation beats it", best,
                    state.best_valid)


def same_smoothing(state: TrainState, trained: dict[str, Any] | None, smoothing: float, run_dir: Path,
                   d: Dist) -> None:
    """best_valid is a label-smoothed loss, whose scale moves with train.label_smoothing: resumed with
    more smoothing, a run compared its losses with a best of less, no validation was better, patience
    stopped it, and `prune` kept the old best's checkpoint (with less, any was better). Then, as on
    another validation set, the best and the patience count start again, and that is said. (Every
    such resume resets them, so the best always holds the smoothing of the checkpoint it resumes.)"""
    saved = (trained or {}).get("label_smoothing")
    if saved is None or saved == smoothing or state.best_valid == math.inf:
        return
    _best_starts_again(state, f"the best validation loss so far ({state.best_valid:.4f} at update "
                              f"{state.best_step}) was smoothed with train.label_smoothing={saved!r}, not "
                              f"{smoothing!r}", run_dir, d)


def _best_starts_again(state: TrainState, why: str, run_dir: Path, d: Dist) -> None:
    """The best loss and patience's count start again, said after `why`. The old best's checkpoint is kept
    for good (`state.earlier_bests`): as the new best's at once, it went at the next save with keep_last's
    older ones, unsaid, though the new criterion never measured it and it may well be the better model.
    The same decision on every process; process 0 alone says it."""
    old = run_dir / "checkpoints" / step_dir_name(state.best_step)
    if d.is_main:
        kept = (f", and that best's checkpoint {old} is kept besides the new best's, outside "
                "train.keep_last: training no longer deletes it" if old.is_dir() else "")
        log.warning("%s: the best loss and train.patience's count start again%s", why, kept)
    if state.best_step:
        state.earlier_bests.append(state.best_step)
    state.best_valid, state.bad_validations, state.best_step = math.inf, 0, 0

"""`train(config)`: the paper's recipe (section 5), from one CPU to many GPUs.

Four functions, read in this order: `train` (the process group; a caller's autocast and grad mode kept
out) -> `_train` (settings checked, run_dir locked) -> `_train_locked` (prepare data, build the model, or
start from `train.init_from`'s checkpoint and its tokenizer: fine-tuning, and Adam, maybe resume) ->
`_loop` (the updates). One update accumulates `update_freq` token-batches per process (DDP synchronizes
gradients on the last one only, `no_sync`), normalizes by the update's target tokens, sets the learning
rate of equation 3 and steps. Every `valid_every` updates: validation loss, a checkpoint, the curves.

torch.compile, DDP and autocast wrap the model at the edges; checkpoints see only the plain model.
"""

from __future__ import annotations

import filecmp
import inspect
import json
import logging
import math
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from aiayn.checkpoint import (
    META,
    WEIGHTS,
    Checkpoint,
    averaged_from,
    check_meta_describes_weights,
    checkpoint_tokenizer,
    config_section,
    enclosing_checkpoint,
    load_checkpoint,
    meta_model_config,
    model_from_weights,
    read_meta,
    state_dict_for_saving,
)
from aiayn.config import PRESETS, ConfigError, ModelConfig
from aiayn.data.batching import epoch_order, token_batches, update_batches, updates_in_epoch
from aiayn.data.dataset import (
    TOKENIZER_INPUTS,
    Batch,
    EncodedCorpus,
    ParallelText,
    cache_encoded,
    check_tokenizer_inputs,
    collate,
    find_tokenizer,
    read_encoded,
    read_parallel,
    refuse_other_tokenizer_settings,
    scan_parallel,
    tokenizer_differences,
    tokenizer_inputs,
    tokenizer_setting_changes,
    tokenizer_settings,
    train_tokenizer,
    warn_if_unknown,
    write_tokenizer_inputs,
)
from aiayn.data.tokenizer import SHARED, SOURCE, TARGET, Tokenizer, trained_settings
from aiayn.decoding.options import MAX_CPU_SEED
from aiayn.errors import CorruptFile, Stopped, UserError, is_out_of_memory
from aiayn.files import moved_aside, recover_replaced, remove_abandoned, require_file
from aiayn.memory import cap_kernel_caches, keep_freed_memory, release_freed_memory
from aiayn.model import Transformer, evaluating
from aiayn.train import distributed
from aiayn.train.config import (
    DATA_FILES,
    NORMALIZATIONS,
    SETTING,
    SPM_TYPES,
    TOKENIZER_FIELDS,
    TOKENIZER_SETTINGS,
    DataConfig,
    RunConfig,
    finetune_model_config,
    toml_value,
)
from aiayn.train.distributed import Dist, SameOnEveryProcess
from aiayn.train.loss import label_smoothed_nll
from aiayn.train.metrics import MetricsLog, capped_ppl, plot_metrics, shown_ppl
from aiayn.train.progress import lines_above, shown_if_unconfigured
from aiayn.train.schedule import cooldown_factor, inverse_sqrt_lr
from aiayn.train.state import (
    STEP_DIR,
    RunLock,
    TrainState,
    check_named_step,
    checkpoint_dirs,
    model_differences,
    own_random_stream,
    prune,
    restore,
    rng_states,
    save_training_checkpoint,
    step_dir_name,
    training_owned,
)

T = TypeVar("T")
log = logging.getLogger(__name__)
# tqdm's default bar without its time left ("<00:06"): that counts max_updates and max_epochs alone, and
# contradicted the postfix's left= (`_time_left`), which knows max_minutes too, where the minutes end first
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"


@dataclass
class Data:
    tokenizer: Tokenizer
    train: EncodedCorpus
    train_batches: list[list[int]]  # pair indices per batch, fixed for the run
    valid: EncodedCorpus | None
    valid_batches: list[list[int]]
    valid_text: ParallelText | None  # raw validation text, for BLEU (only with train.bleu_every)
    train_too_long: int = 0  # training pairs dropped as longer than data.max_len
    # where an update takes more batches than there are: the highest data.max_len this run may set, and the
    # batches the corpus then makes (None: no pair dropped, or none needed)
    raised: tuple[int, int] | None = None


def train(config: RunConfig, resume: bool = False) -> dict[str, Any]:
    """Train (or continue training) the model `config` describes. Returns the last checkpoint's record:
    "step", "stop" (why it ended), and with "epoch" the validation's "valid_loss", "valid_nll",
    "valid_ppl" (and "valid_bleu") when it validated, as a resumed run already at its budget finds them
    in its checkpoint; "best_checkpoint", the path of the best validation loss's, once there is one. The
    training loss is in metrics.jsonl.

    SIGTERM, SIGHUP (a closed terminal) or a first Ctrl-C (a notebook's interrupt too) during the updates
    saves the update under way and raises `aiayn.errors.Stopped`; `resume=True` continues from there. One
    during the last update (the budget reached) or the validation and save after it ends the run as usual,
    and the answer names it: "signal", e.g. "SIGTERM", for a caller with more to do to stop there. The
    run seeds torch's and Python's global generators with train.seed (as fairseq does) and leaves them
    where it ended: two runs at once in one process draw from the same generators, and neither is then its
    seed's run. On Linux with glibc it makes malloc keep freed memory for reuse, for the whole process and
    after it returns (`aiayn.memory.keep_freed_memory`: mallopt turns mmap off and raises the trim
    threshold); AIAYN_SYSTEM_MALLOC=1 in the environment before the process first does so leaves malloc as
    it is. It caps oneDNN's kernel caches too (`aiayn.memory.cap_kernel_caches`: two environment variables,
    which subprocesses inherit).

    Progress (updates, validations, saves) goes through the `aiayn` logger: where nothing is set up to
    show it (a script or notebook that configured no logging), to stderr for the run, as the command line
    shows it. A caller's autocast, `no_grad` or `inference_mode` does not reach the run."""
    if not isinstance(config, RunConfig):  # a dict failed with an AttributeError deep inside
        raise TypeError(f"train() takes a RunConfig, not {type(config).__name__}: build one with "
                        "aiayn.train.config.load_config(path, overrides) or run_config(dict)")
    if not isinstance(resume, bool):  # "no" or "false" is true: the run resumed
        raise TypeError(f"resume must be True or False, not {type(resume).__name__} ({resume!r})")
    d = distributed.setup(config.train.device, config.written_at("train.device", config.train.device))
    threads = torch.get_num_threads()
    try:
        # the caller's autocast ran the backward in bf16 under an fp32 run, and its no_grad or inference_mode
        # failed at the first update after the data work: a run is its config's wherever it is called
        with shown_if_unconfigured(d.is_main), torch.inference_mode(False), torch.enable_grad(), \
                torch.autocast(d.device.type, enabled=False):
            return _train(config, resume, d)
    except RuntimeError as e:
        if (lost := distributed.peer_lost(e, d, _what_resume_does(Path(config.train.run_dir)))) is not None:
            raise lost from None
        raise
    finally:
        torch.set_num_threads(threads)  # the caller's: train.threads=1 left a notebook's later runs on one
        distributed.teardown(d)


def _what_resume_does(run_dir: Path) -> str:
    """What --resume would do now, as a stopped job's error says it (`_checkpoint_to_resume` picks the
    same): the checkpoint it continues from, or the beginning, where "the last checkpoint" was said too."""
    try:
        found = checkpoint_dirs(run_dir)
    except OSError:  # the job's own error matters more than this listing's
        return "--resume continues from the last checkpoint, if one was saved"
    return f"--resume continues from {found[-1].name}" if found else \
        "--resume starts from the beginning: no checkpoint was saved yet"


def _train(config: RunConfig, resume: bool, d: Dist) -> dict[str, Any]:
    # each machine reads its own config file and command line: one machine's train.lr_scale trained replicas
    # that drifted apart unsaid, its valid_every aborted in gloo, its max_updates left the others waiting
    distributed.check_same(d, _shared_settings(config), "give every machine the same --config file and "
                           "--set items (the data files' paths alone may differ: process 0 alone reads them)")
    # settings refused on this machine, named where they were written as load_config's refusals are
    if config.train.precision == "fp16" and d.device.type != "cuda":
        raise config.refusal("train.precision", "fp16",
                             "train.precision='fp16' needs a GPU (use 'bf16' on a CPU)")
    if config.train.compile and d.device.type == "cpu":
        from aiayn.decoding.compiled import check_compile_works, has_cxx_compiler, missing_compiler

        if not has_cxx_compiler():  # inductor's CPU code is C++: a 180-line traceback at the first update,
            # the data prepared
            raise config.refusal("train.compile", True, missing_compiler("train.compile=true on a CPU")
                                 + ", or set train.compile=false")
        try:  # one that is there but cannot build (no Python headers): the same traceback, the same place
            check_compile_works("train.compile=true")
        except UserError as e:
            where = config.written_at("train.compile", True)
            raise UserError(f"{where + ': ' if where else ''}{e}; or set train.compile=false") from None
    if config.data.valid_src and config.train.bleu_every:  # ja and ko need MeCab: say so now, not after
        from aiayn.evaluate import bleu_metrics  # the tokenizer's training and the encoding

        # on every process, said once: process 0's failure, or another's named (packages are a machine's,
        # and MeCab missing on a second machine alone was taken as the same everywhere and never said)
        distributed.on_every(d, lambda: bleu_metrics(config.train.bleu_lang))
    run_dir = Path(config.train.run_dir)
    made = not os.path.lexists(run_dir)  # by this run, below (process 0's view: the one that holds the lock)

    def check() -> None:  # on process 0, the others told (one line, not one a process)
        _check_data_files(config)  # before run_dir is made for nothing
        _check_run_dir(run_dir)

    distributed.on_main(d, check)
    lock = RunLock(run_dir)

    def take_run_dir() -> None:  # on process 0, while the others wait: they then see what it put back
        lock.acquire()  # a second run in this run_dir stops here, every process with it
        _remove_leftovers(run_dir)  # only this run writes checkpoints/ and cache/ now

    try:
        distributed.on_main(d, take_run_dir)
        result = _train_locked(config, resume, d)
    except BaseException:
        if made:  # refused before writing anything (a fine-tune's model settings): no empty run_dir left
            lock.release_made()
        raise
    finally:
        lock.release()
    return result


def _counted(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def _too_few_batches(config: RunConfig, data: Data, d: Dist) -> SameOnEveryProcess:
    """The refusal of a corpus cut into fewer batches than one update takes, with only the changes that
    give one: a batch holds at least one pair, so with fewer pairs than batches an update takes, a lower
    train.max_tokens (once the only advice) cannot help."""
    dc, tc = config.data, config.train
    pairs, batches, per_update = len(data.train), len(data.train_batches), d.world_size * tc.update_freq
    ways = []
    if batches >= d.world_size:  # then an update_freq below this one gives one update at least
        ways.append(f"set train.update_freq={batches // d.world_size}")
    if d.enabled and batches >= tc.update_freq:
        most = batches // tc.update_freq
        ways.append(f"run {_counted(most, 'process', 'processes')}{' or fewer' * (most > 1)}")
    if pairs >= per_update and (lower := _max_tokens_for(data.train, dc.max_len, tc.max_tokens, per_update)):
        ways.append(f"set train.max_tokens={lower[0]} ({_counted(lower[1], 'batch', 'batches')})")
    if data.raised and data.raised[1] >= per_update:  # the dropped pairs kept, batched as they would be
        also = " and model.max_len" * (data.raised[0] > _model_max_len(config))
        ways.append(f"set data.max_len{also}={data.raised[0]} ({_counted(data.raised[1], 'batch', 'batches')}"
                    f" with the {_counted(data.train_too_long, 'longer pair', 'longer pairs')} it dropped)")
    ways.append("train on more pairs")
    processes = f" x {d.world_size} processes" if d.enabled else ""
    return SameOnEveryProcess(
        f"{dc.train_src}, {dc.train_tgt}: {_counted(pairs, 'training pair', 'training pairs')} "
        f"{'makes' if pairs == 1 else 'make'} {_counted(batches, 'batch', 'batches')} of train.max_tokens="
        f"{tc.max_tokens}, fewer than the {per_update} one update takes (train.update_freq={tc.update_freq}"
        f"{processes}); {', or '.join(ways)}"
    )


def _max_tokens_for(train: EncodedCorpus, max_len: int, max_tokens: int,
                    per_update: int) -> tuple[int, int] | None:
    """The largest train.max_tokens below `max_tokens`, and at least data.max_len (the least allowed), that
    cuts `train` into `per_update` batches or more, and its number of batches; None where none does.
    Bisected: more tokens a batch make fewer batches (the greedy cut is not strictly so, but the value
    returned is one that does). Cheap: a corpus this short has few pairs."""
    src, tgt = train.src_lengths(), train.tgt_lengths()
    lo, hi = max_len, max_tokens - 1
    if hi < lo or (n := len(token_batches(src, tgt, lo))) < per_update:
        return None
    best = lo, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if (n := len(token_batches(src, tgt, mid))) >= per_update:
            lo, best = mid, (mid, n)
        else:
            hi = mid - 1
    return best


def _shared_settings(config: RunConfig) -> dict[str, str]:
    """The settings every process of a job must share, as a refusal shows them: aiayn's version, [model]
    as written, and [data] and [train] (train.threads too: a norm summed in another order moves a replica
    apart; run_dir as written, each machine's working directory unknown), but the data files' paths, which
    process 0 alone reads (the others train on its encoding: each machine may keep its copy elsewhere),
    compared by whether they are given (a validation set given to some processes alone left the others
    in other collectives)."""
    from aiayn import __version__

    shown = {"aiayn.__version__": repr(__version__)}
    shown |= {f"model.{key}": toml_value(value) for key, value in config.model.items()}
    for section in ("data", "train"):
        for key, value in asdict(getattr(config, section)).items():
            given = section == "data" and key in DATA_FILES
            shown[f"{section}.{key}"] = ("(a file)" if value else "''") if given else toml_value(value)
    return shown


def _remove_leftovers(run_dir: Path) -> None:
    """A killed run's temporaries (a cache is hundreds of MB, a checkpoint as much, and on a nearly full disk
    they left no room for the next save), and a checkpoint a kill left moved aside as it was replaced."""
    checkpoints = run_dir / "checkpoints"
    recover_replaced(checkpoints)
    remove_abandoned(run_dir)  # also `aiayn average`'s, which may be another machine's: not `locked`
    for directory in (run_dir / "cache", checkpoints):
        remove_abandoned(directory, locked=True)
    # Checkpoints `prune` hid to delete, a kill stopping it: it clears them after a save, which a finished
    # run resumed with nothing to train never makes (a full checkpoint each, for good). Only a run holding
    # this lock hides them, so none is being written.
    for hidden in checkpoints.glob(".step_*.deleting"):
        shutil.rmtree(hidden, ignore_errors=True)


def _train_locked(config: RunConfig, resume: bool, d: Dist) -> dict[str, Any]:
    cap_kernel_caches()  # first: token batches make thousands of shapes, one cached oneDNN kernel each
    tc, run_dir = config.train, Path(config.train.run_dir)
    # chosen once, for all: a lagging listing on another machine could resume another step
    resume_from = distributed.on_main(d, lambda: _checkpoint_to_resume(run_dir, resume, tc.init_from))
    # on every process, its refusal said once
    config = distributed.on_every(d, lambda: _with_checkpoint_tokenizer_settings(config, resume_from))
    trained = None  # the [train] the checkpoint resumed from was trained with
    if resume_from:
        trained = _read_resumed(d, run_dir, resume_from,
                                lambda: _compare_with_trained(resume_from, config, d))
    if tc.threads:
        torch.set_num_threads(tc.threads)
    keep_freed_memory()  # every step frees and re-allocates the same large tensors
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    start_from = _read_resumed(d, run_dir, resume_from, lambda: initial_checkpoint(config, resume_from))
    with _resume_hint(run_dir, resume_from):  # the tokenizer of a resumed run is read from its checkpoint
        fixed = (start_from.model.config.max_len if start_from else _model_max_len(config)) if (
            resume_from or tc.init_from) else None
        data = prepare_data(config, run_dir, d, start_from.tokenizer if start_from else None, fixed)
    release_freed_memory()  # what the tokenizer's training and the encoding freed (a quarter GB at 1.5 M
    # pairs) was kept until the first validation's trim
    tok = data.tokenizer
    model = (start_from.model if start_from else build_model(config, tok)).to(d.device)
    own_random_stream(tc.seed, d.rank)  # after the model: built alike (DDP then copies process 0's anyway)
    optimizer = torch.optim.Adam(  # fused: one pass per tensor, 3x faster than the default on a CPU
        model.parameters(), lr=0.0, betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps, fused=True
    )
    scaler = torch.amp.GradScaler("cuda", enabled=tc.precision == "fp16")
    per_update = d.world_size * tc.update_freq
    n_updates = updates_in_epoch(len(data.train_batches), per_update)
    if n_updates == 0:
        raise _too_few_batches(config, data, d)
    def restored() -> TrainState:
        state = restore(resume_from, model, optimizer, scaler, d) if resume_from else TrainState()
        _epoch_on_this_corpus(state, n_updates, data.train.digest(), resume_from, d)
        return state

    state = _read_resumed(d, run_dir, resume_from, restored)
    _same_validation(state, data, run_dir, d)
    _same_smoothing(state, trained, tc.label_smoothing, run_dir, d)
    _best_still_there(state, run_dir, d)  # after those: a best that starts again is no longer "gone"
    if d.is_main:
        log.info("configuration:\n%s", _describe(config, model, data, d))
        if resume_from:
            log.info("resuming from %s (update %d, epoch %d)", resume_from, state.step, state.epoch + 1)
        if not 0 <= tc.seed <= MAX_CPU_SEED:  # said, not refused: runs trained with one resume as they began
            log.warning("train.seed=%d: PyTorch's CPU generator keeps a seed's low 32 bits, so this run is "
                        "initialized, its batches ordered and (on a CPU) its dropout drawn as with "
                        "train.seed=%d; a seed from 0 to 2**32 - 1 is a run of its own",
                        tc.seed, tc.seed % 2**32)
    net = torch.compile(model) if tc.compile else model
    if tc.compile and d.is_main:  # else silence, with no terminal for a bar, until the first update's line
        log.info("torch.compile: the first updates compile the model (minutes for `small` on a CPU)")
    net = data_parallel(net) if d.enabled else net  # outermost, so that no_sync is reachable
    autocast = torch.autocast(
        d.device.type,
        dtype=torch.float16 if tc.precision == "fp16" else torch.bfloat16,
        enabled=tc.precision != "fp32",
    )
    if d.enabled and not tc.compile:  # compiled, a resume is close, not bit for bit, anyway
        _settle_buckets(net, model, data, d, autocast)
    # validation_due: the resume validates its update first, so any record of that validation goes
    metrics = MetricsLog(run_dir / "metrics.jsonl", state.step, state.validation_due) if d.is_main else None
    tgt_lengths = data.train.tgt_lengths()
    batch_tokens = [sum(tgt_lengths[i] for i in b) for b in data.train_batches]
    planned = [n for n in (tc.max_updates, _epochs_end(state, tc, n_updates)) if n]
    bar = tqdm(
        total=min(planned) if planned else None,
        initial=state.step,
        file=sys.stderr,
        disable=not d.is_main or None,
        unit="upd",
        dynamic_ncols=True,
        bar_format=BAR_FORMAT if planned else None,  # without a total, tqdm's own shows no time left
    )  # a terminal only: tokens/s, loss, ppl, lr, and time left
    before = state.seconds  # a resumed run's training time so far
    clock = _training_clock(before, tc, d)
    validated = {}
    stopper = StopSignal(announce=d.is_main)
    with stopper.installed(), lines_above(bar):
        if state.validation_due:  # a signal's save skipped it: validate now, as the unbroken run did then
            state.validation_due = False
            validated = _validate_and_save(model, optimizer, scaler, state, data, config, d, autocast,
                                           metrics, stopper=stopper, clock=clock)
        # A resumed run may have reached its budget, or run out of patience, already: it trains no more.
        stop = _stop_reason(state, tc, n_updates) or _patience_exhausted(state, tc)
        if stop and d.is_main:
            log.info("%s: already at update %d (%s); nothing to train", resume_from, state.step, stop)
        stop = stop or stopper.agreed(d)  # one during that validation: its checkpoint is the one to resume
        stop, last = _loop(stop, state, data, config, d, net, model, optimizer, scaler, autocast, metrics, bar,
                           n_updates, batch_tokens, stopper, clock)
    bar.close()
    if d.is_main:  # the run's training time, as max_minutes and metrics.jsonl's elapsed_s count it
        session = f" ({(state.seconds - before) / 60:.1f} min in this session)" if resume_from else ""
        log.info("stopped (%s) after %d updates, %.1f min of training%s", stop, state.step,
                 state.seconds / 60, session)
    if stop in STOPPED_BY:  # the agreed signal, not the latest: a SIGTERM
        # during the save changed one process' and that one exited 0
        raise Stopped(f"stopped by {stop} at update {state.step}, saved in {checkpoint_dirs(run_dir)[-1]}; "
                      "--resume (resume=True in Python) continues from there", signal.Signals[stop])
    result = _result(last or validated, state, stop, resume_from, run_dir)
    if stopper.signum is not None:  # one at the budget's end, which the run ended as usual: the caller's
        result["signal"] = signal.Signals(stopper.signum).name  # to act on (`aiayn demo` stops there)
    return result


def _result(last: dict[str, Any], state: TrainState, stop: str, resume_from: Path | None,
            run_dir: Path) -> dict[str, Any]:
    """`train`'s answer: the last save's record (of a resumed run that trained nothing, the one its
    checkpoint's meta.json holds: it answered the step alone), why it stopped, and the checkpoint of the
    best validation loss, which pruning keeps and which the answer never named."""
    if not last and resume_from is not None:
        last = _recorded_result(resume_from)
    result = {**last, "stop": stop, "step": state.step}
    best = run_dir / "checkpoints" / step_dir_name(state.best_step)
    if state.best_step and best.is_dir():  # 0: no validation yet (or none since the best started again)
        result["best_checkpoint"] = str(best)
    return result


def data_parallel(net: torch.nn.Module) -> DistributedDataParallel:
    """`net` under DDP, whose buffers are not broadcast from process 0 before every forward pass (its
    default): the position tables and a logits bias are the same in every process (computed from the
    config, or read from one checkpoint), and broadcasting them was a collective per micro-batch. torch
    2.13 renamed the switch `forward_sync_buffers` (the old name warns in every process); older ones know
    only `broadcast_buffers`."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return DistributedDataParallel(net, forward_sync_buffers=False)
    return DistributedDataParallel(net, broadcast_buffers=False)


def _recorded_result(checkpoint: Path) -> dict[str, Any]:
    """The epoch and validation results `checkpoint`'s meta.json records; what is not a number there (a
    hand's edit) is left out, as the command line formats them."""
    metrics = read_meta(checkpoint).get("metrics")
    if not isinstance(metrics, dict):
        return {}
    kept = ("epoch", "valid_loss", "valid_nll", "valid_ppl", "valid_bleu")
    recorded = {k: v for k, v in metrics.items() if k in kept and type(v) in (int, float)}
    if "valid_bleu" in recorded and isinstance(metrics.get("bleu_signature"), str):  # as the run answered
        recorded["bleu_signature"] = metrics["bleu_signature"]
    return recorded


def _loop(stop, state, data, config, d, net, model, optimizer, scaler, autocast, metrics, bar, n_updates,
          batch_tokens, stopper, clock) -> tuple[str, dict]:
    """The updates until `stop`, validating and saving on schedule; (why it stopped, the last results)."""
    tc, tok = config.train, data.tokenizer
    per_update = d.world_size * tc.update_freq
    last_log = time.monotonic()
    # Since the last log line: (smoothed loss, NLL) sums, kept on the device (reading them is a sync), and
    # target tokens.
    sums, tokens = _no_losses(d.device), 0.0
    last = {}
    saved_step = state.step

    def log_window() -> dict[str, Any]:
        nonlocal sums, tokens, last_log
        window = [*sums.tolist(), tokens]  # the window's one sync: then its work is done, and timed
        now = time.monotonic()
        left = _time_left(state, tc, n_updates)
        line = _log_window(window, state, lr, now - last_log, state.seconds, d, bar, metrics, left)
        sums, tokens, last_log = _no_losses(d.device), 0.0, now
        return line

    while not stop:
        order = epoch_order(len(data.train_batches), tc.seed, state.epoch)
        while state.cursor < n_updates and not stop:
            mine = update_batches(order, state.cursor, per_update, d.rank, d.world_size)
            group_tokens = sum(
                batch_tokens[b] for b in order[state.cursor * per_update : (state.cursor + 1) * per_update]
            )
            batches = [collate(data.train, data.train_batches[b], tok).to(d.device) for b in mine]
            lr = inverse_sqrt_lr(state.step + 1, model.config.d_model, tc.warmup, tc.lr_scale)
            lr *= cooldown_factor(_budget_used(state, tc, n_updates), tc.cooldown)
            with _memory_said(f"update {state.step + 1}", tc):
                step_sums, step_tokens, applied = train_step(
                    net, optimizer, scaler, batches, group_tokens, lr, tc.label_smoothing, tc.clip_norm, d,
                    autocast,
                )
            state.cursor += 1  # the batches are used up either way, as fairseq's are
            if applied:  # a skipped update's loss may be the overflow itself (inf): kept out of the log
                state.step += 1
                bar.update(1)
                sums, tokens = sums + step_sums, tokens + step_tokens
            elif d.is_main:
                log.warning("update %d skipped: fp16 gradients overflowed; loss scale lowered to %g",
                            state.step + 1, scaler.get_scale())
            state.seconds = clock()
            stop = _stop_reason(state, tc, n_updates)
            # At the budget's end, the last window too, however short: the curve ran up to log_every - 1
            # updates short of the run, and the loss of its last updates was nowhere
            if applied and (state.step % tc.log_every == 0 or stop):
                last = log_window()
            signalled = None if stop else stopper.agreed(d)  # a run at its budget ends as usual
            due = state.step % tc.valid_every == 0 or bool(tc.bleu_every and state.step % tc.bleu_every == 0)
            if state.step == saved_step:  # only skipped updates since the last save: nothing new to save
                stop = stop or signalled
            elif due or stop or signalled:
                state.validation_due = bool(signalled and due)  # saved so: --resume validates first
                _check_unlogged(sums, state.step, d)
                begun = time.monotonic()
                last = _validate_and_save(  # on a signal only the save: a scheduler's grace is short
                    model, optimizer, scaler, state, data, config, d, autocast, metrics, not signalled,
                    None if stop else stopper,  # at its budget a run ends as usual, validated
                    clock,
                )
                release_freed_memory()  # the free pages of a fragmented heap back to the kernel
                saved_step = state.step
                last_log += time.monotonic() - begun  # tokens/s counts training, not this validation
                # A signal during the validation or the save, or the time budget spent in them, stops here,
                # not after one more update and checkpoint: the one just saved is where --resume goes on
                stop = (stop or signalled or _patience_exhausted(state, tc) or stopper.agreed(d)
                        or _stop_reason(state, tc, n_updates))
                if stop and tokens and stop not in STOPPED_BY:  # patience, or the budget
                    log_window()  # spent in the validation: the window the update's own check left open
                    if metrics is not None:  # logged after the save's curves.png: drawn again, with it
                        _draw_curves(metrics.path, Path(tc.run_dir) / "curves.png")
        if state.cursor >= n_updates:
            state.epoch, state.cursor = state.epoch + 1, 0
            if tc.max_epochs and state.epoch >= tc.max_epochs:
                stop = stop or f"max_epochs={tc.max_epochs}"
    if saved_step != state.step:  # stopped at an epoch end between validations
        _check_unlogged(sums, state.step, d)
        last = _validate_and_save(model, optimizer, scaler, state, data, config, d, autocast, metrics,
                                  clock=clock)
    return stop, last


# The signals that stop a run with a checkpoint, in the order that picks one status for all processes where
# they got different ones: a scheduler's, a closed terminal's (or a lost SSH connection's), a Ctrl-C.
# Windows has no SIGHUP.
STOP_SIGNALS = tuple(s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None), signal.SIGINT) if s)
STOPPED_BY = frozenset(s.name for s in STOP_SIGNALS)  # a run's stop reason where a signal stopped it


class StopSignal:
    """SIGTERM (what a scheduler or `docker stop` sends), SIGHUP (a closed terminal, a lost SSH connection)
    or a first Ctrl-C: finish the current update, save a checkpoint (without validating) and stop, instead
    of losing the updates since the last checkpoint; one during a validation ends it at its next batch, one
    during a save stops once it is written. A second Ctrl-C interrupts at once (under torchrun too, whose
    launcher passes it on as SIGTERM; after a first SIGTERM or SIGHUP it passes a Ctrl-C on as SIGTERM as
    well, which cannot be told from a scheduler's second one, so none is offered). Under torchrun the
    processes agree on it at every update, and after each validation and save."""

    def __init__(self, announce: bool = True) -> None:
        self.signum: int | None = None
        self.announce = announce  # say so when the signal comes: process 0 alone, or 16 lines for 16 GPUs

    @contextmanager
    def installed(self):
        """The handlers for the duration of the block (signal handlers live in the main thread only). A
        signal the process was started ignoring stays ignored: a background job of a script (`aiayn train
        &` in a non-interactive shell) inherits SIGINT ignored, and a Ctrl-C meant for the script stopped
        its training, though not its data preparation; one started by `nohup` has SIGHUP ignored, and
        trains on when its terminal closes."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        previous = {s: h for s, h in handlers.items() if h != signal.SIG_IGN}

        # torchrun's launcher takes a terminal's Ctrl-C (its processes run in sessions of their own), passes
        # the first on as SIGINT and a second one as SIGTERM: that SIGTERM only set the stop again, and a
        # long validation or BLEU pass ran on until the launcher's SIGKILL, though "at once" was announced
        launched = "TORCHELASTIC_RUN_ID" in os.environ

        def handle(signum: int, frame) -> None:
            first = self.signum
            if first is not None and (signum == signal.SIGINT or launched and first == signal.SIGINT):
                raise KeyboardInterrupt  # the second Ctrl-C
            again = first is not None  # a second signal other than a Ctrl-C: the stop already under way
            self.signum = signum
            if self.announce and not again:
                # a SIGTERM or SIGHUP had no first Ctrl-C, and a process that ignores SIGINT has none at all
                again = " (Ctrl-C again: at once)" if signum == signal.SIGINT else " (a Ctrl-C: at once)"
                # torchrun passes any signal after the first on as SIGTERM: a Ctrl-C after a SIGTERM too
                offered = signal.SIGINT in previous and not (launched and signum != signal.SIGINT)
                log.warning("%s: stopping after this update, with a checkpoint%s",
                            signal.Signals(signum).name, again if offered else "")

        for s in previous:
            signal.signal(s, handle)
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def agreed(self, d: Dist) -> str | None:
        """The signal's name once any process got one (a collective under torchrun), else None.

        Decided from the sums alone, which every process gets: a signal that arrived during the reduction
        counts at the next update. Read again after it, it stopped that process alone, which then waited
        in the checkpoint's collectives while the others waited in the next update's (a deadlock)."""
        mine = self.signum
        if not d.enabled:
            return None if mine is None else signal.Signals(mine).name
        got = distributed.all_reduce_sum([float(mine == s) for s in STOP_SIGNALS], d)  # processes per signal
        if not any(got):
            return None
        # one status for all, the first in STOP_SIGNALS (SIGINT and SIGTERM on two processes: SIGTERM)
        self.signum = next(s for s, n in zip(STOP_SIGNALS, got) if n)
        name = signal.Signals(self.signum).name
        if self.announce and mine is None:  # sent to another process alone
            log.warning("%s in another process: stopping after this update, with a checkpoint", name)
        return name


def build_model(config: RunConfig, tok: Tokenizer) -> Transformer:
    """The configured Transformer with the tokenizer's vocabulary sizes and special ids."""
    model_config = vocabulary_model_config(
        config, vocab_size=tok.src_vocab_size, tgt_vocab_size=None if tok.shared else tok.tgt_vocab_size,
        pad_id=tok.pad_id, decoder_start_id=tok.bos_id, eos_id=tok.eos_id,
    )
    try:
        return Transformer(model_config)
    except (RuntimeError, MemoryError) as e:  # a [model] far too large: the allocator's traceback before
        if not (is_out_of_memory(e) or "memory" in str(e).lower()):
            raise
        m = model_config
        raise UserError(f"[model]: not enough memory for the model (d_model={m.d_model}, d_ff={m.d_ff}, "
                        f"{m.n_layers}+{m.decoder_layers} layers, vocabulary {m.vocab_size:,})") from None


def vocabulary_model_config(config: RunConfig, **vocabulary: Any) -> ModelConfig:
    """[model] with a vocabulary's `TOKENIZER_FIELDS` (sizes and special ids): one with a target size of
    its own (separate vocabularies) cannot share one matrix, unless [model] says so itself (refused)."""
    shared = vocabulary.get("tgt_vocab_size") is None or "share_embeddings" in config.model
    return config.model_config(**vocabulary, **({} if shared else {"share_embeddings": False}))


def initial_checkpoint(config: RunConfig, resume_from: Path | None) -> Checkpoint | None:
    """With train.init_from: its model (in training mode, [model]'s dropout) and tokenizer, else None.

    A resumed fine-tuning run reads them from its own checkpoint (the same tokenizer files and model
    config, saved there), so the init_from directory is needed only for the first invocation.
    """
    tuned_from = _fine_tuned_from(resume_from) if resume_from else None
    if resume_from and not _same_init_from(resume_from, tuned_from, config.train.init_from):
        # no init_from: the model built from [model] failed to load with a less helpful mismatch; another
        # one was ignored (the run goes on from its own checkpoint) and saved as where the run started
        if tuned_from:
            raise UserError(f"{resume_from}: this run fine-tunes {tuned_from}; "
                            f"resume it with train.init_from={_init_from_here(resume_from, tuned_from)}")
        raise UserError(f"{resume_from}: this run was not fine-tuned from a checkpoint; resume it without "
                        "train.init_from")
    if not config.train.init_from:
        return None
    path = resume_from or Path(config.train.init_from)
    ck = load_checkpoint(path) if resume_from else _load_init_from(config)
    tuned = finetune_model_config(config, ck.model.config, path)  # a new model: dropout may have changed
    model = model_from_weights(tuned, state_dict_for_saving(ck.model), path)
    # resumed too: the run's own checkpoint records the settings it adopted (another vocab_size was
    # trained with, and saved into meta.json for a tokenizer that does not have it)
    _refuse_tokenizer_settings(config, ck.meta, path)
    if not resume_from:
        log.info("fine-tuning %s%s", path, _origin(ck.meta))
    return Checkpoint(model.train(), ck.tokenizer, ck.meta, path)


def _origin(meta: dict[str, Any]) -> str:
    """What train.init_from's checkpoint is, for the log, as `aiayn info` says it: an average of its run's
    last checkpoints keeps the newest's step, and was said to be that update alone."""
    if (averaged := averaged_from(meta)) is not None:
        return f" (the average of {averaged})"
    step = meta.get("step")  # none in a converted model, or one saved outside training
    return f" (update {step} of its run)" if step is not None else ""


def _load_init_from(config: RunConfig) -> Checkpoint:
    """train.init_from's checkpoint; a refusal of it named with the setting and where it was written, as a
    data file's is (`_placed_path`): "runs/x/step_000015: checkpoint not found" said neither."""
    path = config.train.init_from
    try:
        return load_checkpoint(path)
    except UserError as e:
        raise UserError(_placed_path(config, "train.init_from", path, str(e))) from None


def _with_checkpoint_tokenizer_settings(config: RunConfig, resume_from: Path | None) -> RunConfig:
    """Fine-tuning keeps the checkpoint's tokenizer, so [data]'s tokenizer settings left at their defaults
    take the values the checkpoint records: a run.toml naming only its files was refused ("vocab_size was
    300, now 8000": a default, not a change), or printed and saved 8,000 pieces for a 300-piece model.
    A value set (`RunConfig.given_data_keys`), even to the default, is still refused
    (`_refuse_tokenizer_settings`), also when the run is resumed."""
    if not config.train.init_from:
        return config
    source = resume_from or Path(config.train.init_from)
    try:
        saved = config_section(read_meta(source), "data") or {}
    except UserError:  # not a checkpoint: `initial_checkpoint` says so in its own words
        return config
    defaults, given = DataConfig(), config.given_data_keys() or frozenset()
    if "vocab_size" not in saved:  # a converted Marian model, one saved by hand, or a fine-tune of either
        if set_here := [k for k in TOKENIZER_SETTINGS if k in given]:  # was taken, ignored and recorded
            # each named, and where it was written, as `_refuse_tokenizer_settings` does: the first alone
            # was, naming neither the file's line nor the --set item
            settings, them = [f"data.{k}" for k in set_here], "it" if len(set_here) == 1 else "them"
            raise UserError(f"{config.written_where(*settings)}{source}: records no tokenizer settings "
                            "(imported, or saved outside training), and its tokenizer is kept: "
                            f"{', '.join(settings)} cannot be set (drop {them})")
        return replace(config, tokenizer_imported=True)
    adopted = {k: saved[k] for k in _tokenizer_settings(config)
               if k in saved and type(saved[k]) is type(getattr(defaults, k))  # a hand's edit: compared later
               and k not in given and getattr(config.data, k) == getattr(defaults, k)}
    return replace(config, data=replace(config.data, **adopted)) if adopted else config


def _refuse_tokenizer_settings(config: RunConfig, meta: dict, path: Path) -> None:
    """Fine-tuning keeps the checkpoint's tokenizer: [data] tokenizer settings other than those it records
    could not take effect (they were ignored, and printed as the run's configuration). A checkpoint that
    records none (a converted Marian model) is not compared."""
    saved = config_section(meta, "data")
    if saved is None or "vocab_size" not in saved:  # see `_with_checkpoint_tokenizer_settings`
        return
    if changes := tokenizer_setting_changes(saved, _tokenizer_settings(config)):
        raise UserError(f"{_tokenizer_written_at(config, saved)}{path}: train.init_from keeps this "
                        f"checkpoint's tokenizer ({'; '.join(changes)}); drop the change")


def _tokenizer_written_at(config: RunConfig, saved: dict) -> str:
    """A refusal's start naming where [data]'s tokenizer settings other than `saved`'s were written."""
    return config.written_where(*(f"data.{key}" for key, value in _tokenizer_settings(config).items()
                                  if tokenizer_setting_changes(saved, {key: value})))


def _left_at_defaults(config: RunConfig) -> list[str]:
    """[data]'s tokenizer settings written nowhere, at their defaults."""
    return [key for key in TOKENIZER_SETTINGS if config.is_default(f"data.{key}", getattr(config.data, key))]


def _tokenizer_settings(config: RunConfig) -> dict:
    dc = config.data
    return tokenizer_settings(dc.vocab_size, dc.spm_type, dc.shared_vocab, dc.normalization,
                              dc.character_coverage)


def _same_init_from(checkpoint: Path, saved: str | None, given: str) -> bool:
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


def _init_from_here(checkpoint: Path, saved: str) -> str:
    """The train.init_from to resume with: `saved`, as recorded, or where the run was moved or copied with it
    and `saved` is gone, the one at the same place relative to the run directory (which `_same_init_from`
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


def _fine_tuned_from(checkpoint: Path) -> str | None:
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


def _log_window(
    window, state: TrainState, lr: float, seconds: float, elapsed: float, d: Dist, bar, metrics,
    left: float | None = None,
):
    """Training loss, NLL, perplexity, speed since the last line and the time `left` (seconds, None without
    a budget): progress bar, log, metrics.jsonl."""
    loss, nll, tokens = distributed.all_reduce_sum(window, d)  # over all processes
    _check_finite("training loss", loss, state.step)  # all processes see the sum: all stop together
    line = {
        "step": state.step,
        "epoch": state.epoch + 1,
        "loss": loss / tokens,
        "nll": nll / tokens,
        "ppl": capped_ppl(nll / tokens),
        "lr": lr,
        "tokens_per_s": tokens / seconds,
        "elapsed_s": elapsed,
    }
    bar.set_postfix(
        tok_s=f"{line['tokens_per_s']:.0f}",
        loss=f"{line['loss']:.3f}",
        ppl=shown_ppl(line["nll"], 1),
        lr=f"{lr:.2e}",
        **({"left": _clock(left)} if left is not None else {}),
    )
    if metrics:
        metrics.write(line)
        log.info(
            "update %d epoch %d: loss %.3f nll %.3f ppl %s lr %.2e %.0f tok/s%s",
            state.step,
            state.epoch + 1,
            line["loss"],
            line["nll"],
            shown_ppl(line["nll"], 1),
            lr,
            line["tokens_per_s"],
            f", {_clock(left)} left" if left is not None else "",
        )
    return line


def _epochs_end(state: TrainState, tc, n_updates: int) -> int:
    """The update at which max_epochs ends the run (0 without it): the updates done and those left of this
    corpus' epochs. max_epochs x n_updates ran past its total after a --resume on another corpus (whose
    epochs were of another length) or after skipped fp16 updates."""
    if not tc.max_epochs:
        return 0
    left = (tc.max_epochs - state.epoch) * n_updates - state.cursor
    return state.step + max(left, 0)


def _time_left(state: TrainState, tc, n_updates: int) -> float | None:
    """Seconds of training left before the first budget (minutes, updates, epochs) ends, at the pace so far;
    None without a budget. (tqdm's own estimate, which `BAR_FORMAT` leaves out, knows only updates and
    epochs.)"""
    used = _budget_used(state, tc, n_updates)
    if not 0.0 < used < 1.0:
        return None if used == 0.0 else 0.0
    return state.seconds * (1.0 - used) / used


def _clock(seconds: float) -> str:
    """h:mm:ss or m:ss."""
    m, sec = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def train_step(
    net: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batches: list[Batch],
    update_tokens: int,
    lr: float,
    eps: float,
    clip_norm: float,
    d: Dist,
    autocast,
) -> tuple[Tensor, float, bool]:
    """One update: accumulate this process' batches, normalize by the update's tokens, step Adam.

    The gradient is that of (sum of smoothed losses over all processes' batches) / update_tokens.
    DDP averages gradients over processes, so each process scales its loss by world_size first.
    Returns this process' (smoothed loss, NLL) sums, (2,) float64 on the device, its target tokens, for
    the log, and whether Adam stepped: with fp16 the GradScaler skips an update whose gradients overflowed
    and lowers its scale, and such an update is not counted (as fairseq: the step, the learning-rate
    schedule and max_updates see only real updates). Telling costs fp16 two reads of the scale an update.
    The sums stay on the device: .item() here waited for the GPU at every batch, so the host could not
    collate the next batch while the GPU worked.
    """
    optimizer.zero_grad(set_to_none=True)
    sums = _no_losses(d.device)
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        sync = nullcontext() if last or not isinstance(net, DistributedDataParallel) else net.no_sync()
        with sync:
            loss, nll = batch_loss(net, batch, eps, autocast)
            scaler.scale(loss * (d.world_size / update_tokens)).backward()
        sums = sums + torch.stack([loss.detach(), nll.detach()]).double()  # (2,)
    if clip_norm > 0:
        scaler.unscale_(optimizer)  # clip the true gradient, not the loss-scaled one
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip_norm)
    for group in optimizer.param_groups:
        group["lr"] = lr
    scale = scaler.get_scale() if scaler.is_enabled() else None  # fp16 only: a read from the GPU
    scaler.step(optimizer)
    scaler.update()
    applied = scale is None or scaler.get_scale() >= scale  # a lowered scale: inf/NaN found, step skipped
    return sums, float(sum(b.n_tokens for b in batches)), applied


def _settle_buckets(net: DistributedDataParallel, model: Transformer, data: Data, d: Dist, autocast) -> None:
    """One forward and backward of one training pair, its gradients dropped, before the first update.

    DDP all-reduces the first update of each process with every gradient in one bucket, then regroups
    them in the order backward made them. Where an element lies in its bucket sets the order in which
    the all-reduce adds the processes' gradients, which matters from 3 processes on ((a + b) + c is not
    a + (b + c)): a resumed job's first update summed otherwise than the unbroken job's, and the
    weights drifted apart. After this pass every update of every start uses the regrouped buckets. In
    eval mode: no dropout, so no random draws that the run's own would then miss."""
    with evaluating(model):
        batch = collate(data.train, data.train_batches[0][:1], data.tokenizer).to(d.device)
        loss, _ = batch_loss(net, batch, 0.0, autocast)
        loss.backward()
        model.zero_grad(set_to_none=True)


def batch_loss(net: torch.nn.Module, batch: Batch, eps: float, autocast) -> tuple[Tensor, Tensor]:
    """(smoothed loss sum, NLL sum) of one batch; only its non-pad targets are projected and scored,
    selected by the indices `collate` found on the host: nothing here waits for a GPU."""
    with autocast:
        logits = net(batch.src, batch.tgt_in, batch.positions)  # (N, V), N = real target tokens
    # Autocast keeps its bf16/fp16 copies of the weights until the outermost autocast ends, and train()
    # runs inside one (disabled, to keep a caller's out): without this, every update after the first
    # computed with the first update's copies, and the weights saved were never the ones validated.
    torch.clear_autocast_cache()
    return label_smoothed_nll(logits, batch.targets, eps, ignore_index=None)


@torch.no_grad()
def validate(model: Transformer, data: Data, d: Dist, autocast, eps: float,
             stop: Callable[[], bool] | None = None) -> dict[str, float] | None:
    """Smoothed loss and NLL per target token on the validation set (shared out over processes); None
    where `stop()` turned true on any process before its share was done (training's stop signal: it
    stops at its next batch, a host check; the shares' sum, a collective, is reached either way).

    On a terminal, process 0's bar counts its batches and goes when the pass ends: a large validation set
    on a CPU took minutes with the training bar standing still, as if hung (the BLEU pass has one too)."""
    sums, tokens, cut = _no_losses(d.device), 0.0, False
    share = data.valid_batches[d.rank :: d.world_size]
    with evaluating(model):
        for indices in tqdm(share, desc="validation", unit="batch", leave=False, file=sys.stderr,
                            disable=not d.is_main or None):
            if stop is not None and (cut := stop()):
                break
            batch = collate(data.valid, indices, data.tokenizer).to(d.device)
            loss, nll = batch_loss(model, batch, eps, autocast)
            sums = sums + torch.stack([loss, nll]).double()  # (2,), on the device: no sync per batch
            tokens += batch.n_tokens
    loss, nll, tokens, cut = distributed.all_reduce_sum([*sums.tolist(), tokens, float(cut)], d)
    if cut:  # on any process: none uses the partial sums
        return None
    if not tokens:  # prepare_data refuses an empty validation set; this keeps a division by zero out
        raise UserError("data.valid_src: the validation set has no target tokens")
    return {
        "valid_loss": loss / tokens,
        "valid_nll": nll / tokens,
        "valid_ppl": capped_ppl(nll / tokens),
    }


def _validate_and_save(
    model, optimizer, scaler, state, data, config, d, autocast, metrics, validating: bool = True,
    stopper: StopSignal | None = None, clock: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Validation (if there is a validation set and `validating`), the patience count, a checkpoint and the
    curves. With `stopper`, a signal during the validation drops it: the update is saved unvalidated, as
    on a signal during the update, and --resume validates first. With `clock`, the training time is read
    again before the save (`_training_clock`)."""
    tc = config.train
    result: dict[str, Any] = {"step": state.step, "epoch": state.epoch + 1}
    if data.valid is not None and validating:
        with _memory_said(f"the validation at update {state.step}", tc):
            measured = _measure(model, state, data, config, d, autocast, stopper)
        state.validation_due = measured is None  # dropped on a signal: --resume makes it first
        validating = measured is not None
        result.update(measured or {})
    _check_finite_weights(model, state.step)  # also without a validation set: never save NaN weights
    if clock is not None:  # the validation's time counted, in the checkpoint too: a budget it used up ends
        state.seconds = clock()  # the run here, and a --resume from here trains nothing more, alike
    rngs = rng_states(d)  # collective: every process takes part

    def save() -> None:
        run_dir = Path(tc.run_dir)
        # Logged before the checkpoint appears: a kill between the two left a checkpoint whose validation
        # was never logged (the resumed run starts after it). Logged and then not saved, the step is done
        # again from the checkpoint before, whose resume drops the record (MetricsLog: the records past it,
        # and that of a validation it makes first, as a signal's save at this step left it to).
        # Only what was measured: a signal's save (or any without a validation set) left {"step": 7,
        # "epoch": 1}, a record no unbroken run has; a validation the signal skipped, the resumed run logs.
        if set(result) - {"step", "epoch"}:
            metrics.write(result)
        path = save_training_checkpoint(
            run_dir, model, data.tokenizer, optimizer, scaler, state, config.to_dict(), result, rngs,
            interrupted=not validating,  # only a signal's save skips validation
        )
        prune(run_dir, tc.keep_last, state.best_step, state.earlier_bests)
        _draw_curves(metrics.path, run_dir / "curves.png")
        if "valid_loss" in result:
            log.info(
                "update %d: valid loss %.3f nll %.3f ppl %s; saved %s",
                state.step,
                result["valid_loss"],
                result["valid_nll"],
                shown_ppl(result["valid_nll"], 2),
                path,
            )
        else:  # no validation set: where the checkpoint went was never said
            log.info("update %d: saved %s", state.step, path)

    # Process 0 writes while the others wait (nobody runs ahead of a checkpoint being written); a failed
    # write (a full disk) reaches them as its one line, not as gloo's "connection reset" tracebacks.
    distributed.on_main(d, save)
    return result


def _measure(model, state, data, config, d, autocast, stopper: StopSignal | None) -> dict[str, Any] | None:
    """The validation loss, BLEU on schedule, and with them the best loss and patience's count; None where
    `stopper` got a signal before they ended, as every process then agrees: each pass stops at its next
    batch (a scheduler's grace is short, and a BLEU pass can take minutes) and nothing is counted. Passes
    that ended are kept, whenever a signal came: the run then stops after saving them."""
    tc = config.train
    stop = None if stopper is None else (lambda: stopper.signum is not None)
    result = validate(model, data, d, autocast, tc.label_smoothing, stop)
    if result is None:  # on every process alike
        return None
    _check_finite("validation loss", result["valid_loss"], state.step)
    if tc.bleu_every and state.step % tc.bleu_every == 0 and config.data.valid_src:
        def score() -> tuple[float, str] | None:
            from aiayn.train.bleu import validation_bleu  # the decoding package, only when asked for

            return validation_bleu(model, data.tokenizer, data.valid_text, tc.max_tokens, d.device,
                                   tc.bleu_lang, stop)

        # Process 0 alone holds the text and scores; the others wait as for the data's preparation, and
        # learn whether the pass was cut. Under GROUP_TIMEOUT they gave up on a pass past 30 minutes (a big
        # validation set on CPUs), and the job stopped without that checkpoint.
        bleu = distributed.on_main(d, score, long=True)
        if bleu is None:
            return None
        result["valid_bleu"], result["bleu_signature"] = bleu
        if d.is_main:
            log.info("update %d: valid BLEU (greedy) %.2f", state.step, result["valid_bleu"])
    if result["valid_loss"] < state.best_valid:
        state.best_valid, state.bad_validations, state.best_step = result["valid_loss"], 0, state.step
    else:
        state.bad_validations += 1
    return result


@contextmanager
def _memory_said(doing: str, tc) -> Iterator[None]:
    """An allocation failing in `doing` as one line naming the setting that sizes it, where it was an
    out-of-memory traceback (CUDA's, or the CPU allocator's). Both the updates' batches and the
    validation's (loss and BLEU) hold up to train.max_tokens tokens a side. A --resume must keep
    max_tokens (`_check_same_batches`): it helps only where the memory was taken by something else."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        sized = f"out of memory in {doing} (batches of up to train.max_tokens={tc.max_tokens} tokens a side)"
        keep = "train.update_freq to keep the tokens of an update"
        if saved := checkpoint_dirs(tc.run_dir):
            raise UserError(f"{sized}: --resume goes on from {saved[-1]} where more memory is free, or "
                            f"train anew with a lower train.max_tokens (a resume keeps it) and a higher "
                            f"{keep}") from None
        raise UserError(f"{sized}: lower train.max_tokens, and raise {keep}") from None


def _draw_curves(log_path: Path, png: Path) -> None:
    """curves.png from the log so far; none before anything is logged (a signal's save before the first
    train.log_every updates), which would only warn that there is nothing to draw."""
    try:
        if log_path.is_file() and log_path.stat().st_size:
            plot_metrics(log_path, png)
    except (UserError, OSError) as e:  # a picture is not worth a training run: warn and go on
        log.warning("curves.png not drawn: %s", e)


def _check_finite(what: str, value: float, step: int) -> None:
    """Stop a diverged run before it saves: a NaN checkpoint would also push the good ones out (keep_last).
    Checked on numbers already on the CPU (the log window, validation), so it adds no device sync."""
    if not math.isfinite(value):  # a value summed over the processes: all stop, process 0 says so
        raise SameOnEveryProcess(
            f"update {step}: {what} is {value}; training diverged and stopped before saving (no checkpoint "
            "holds its weights): lower train.lr_scale, and --resume from the last checkpoint if one was saved"
        )


def _check_unlogged(sums: Tensor, step: int, d: Dist) -> None:
    """Before a save, the training loss since the last log line: a sum, so one NaN update shows. `sums`:
    the window's (smoothed loss, NLL) sums on the device; reading them is one sync per save."""
    _check_finite("training loss", distributed.all_reduce_sum(sums[:1].tolist(), d)[0], step)


def _no_losses(device: torch.device) -> Tensor:
    """(2,) float64 zeros on `device`: (smoothed loss, NLL) sums to add batches' losses to. float64, as the
    Python floats that .item() gave were: the same sums, bit for bit."""
    return torch.zeros(2, dtype=torch.float64, device=device)


def _check_finite_weights(model: Transformer, step: int) -> None:
    """A NaN or inf weight (a huge lr, a corrupted checkpoint) is never saved; one device sync per save."""
    finite = torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all()
    if not finite.item():
        _check_finite("a model weight", math.nan, step)


def _training_clock(before: float, tc, d: Dist) -> Callable[[], float]:
    """A clock of the training time for state.seconds: `before` (a resumed run's, so that max_minutes spans
    resumes) plus the wall time from now, updates, validations and saves alike; each read of it a
    collective with a time budget (`_training_seconds`)."""
    start = time.monotonic()
    return lambda: _training_seconds(before, start, tc, d)


def _training_seconds(before: float, start: float, tc, d: Dist) -> float:
    """Training wall time so far; with a time budget, the mean over processes, so all agree on lr and stop."""
    seconds = before + time.monotonic() - start
    if tc.max_minutes and d.enabled:
        seconds = distributed.all_reduce_sum([seconds], d)[0] / d.world_size
    return seconds


def _budget_used(state: TrainState, tc, n_updates: int) -> float:
    """The fraction used of whichever budget ends first: minutes, updates or epochs (0 with none)."""
    used = [0.0]
    if tc.max_minutes:
        used.append(state.seconds / (tc.max_minutes * 60))
    if tc.max_updates:
        used.append(state.step / tc.max_updates)
    if tc.max_epochs:  # the epochs' position: skipped fp16 updates used their batches too
        used.append((state.epoch * n_updates + state.cursor) / (tc.max_epochs * n_updates))
    return max(used)


def _stop_reason(state: TrainState, tc, n_updates: int) -> str:
    """Why to stop after this update ("" = go on); the same answer on every process."""
    if tc.max_updates and state.step >= tc.max_updates:
        return f"max_updates={tc.max_updates}"
    # Past the budget as well as at its end: a resume with max_epochs lowered below the epoch under way
    epochs_done = state.epoch + (1 if state.cursor >= n_updates else 0)
    if tc.max_epochs and epochs_done >= tc.max_epochs:
        return f"max_epochs={tc.max_epochs}"
    if tc.max_minutes and state.seconds > tc.max_minutes * 60:
        return f"max_minutes={tc.max_minutes}"
    return ""


def _patience_exhausted(state: TrainState, tc) -> str:
    if tc.patience and state.bad_validations >= tc.patience:
        return f"no better validation loss for {state.bad_validations} validations"
    return ""


def _epoch_on_this_corpus(state: TrainState, n_updates: int, digest: str, resume_from: Path | None,
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


def _same_validation(state: TrainState, data: Data, run_dir: Path, d: Dist) -> None:
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


def _best_still_there(state: TrainState, run_dir: Path, d: Dist) -> None:
    """The best validation loss's checkpoint, deleted by hand (to free a full disk): the run went on
    measuring patience against it and its answer named the missing directory. It is said; the best stays
    the criterion (validation did not get better), and no answer names a checkpoint that is not there."""
    best = run_dir / "checkpoints" / step_dir_name(state.best_step)
    if state.best_step and d.is_main and not best.is_dir():
        log.warning("%s, the best validation loss so far (%.4f), is gone; train.patience still counts from "
                    "it, and the best checkpoint is named again once a validation beats it", best,
                    state.best_valid)


def _same_smoothing(state: TrainState, trained: dict[str, Any] | None, smoothing: float, run_dir: Path,
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


def _check_data_files(config: RunConfig) -> None:
    """Training files named, and every named corpus file there: a run.toml without them made train.run_dir
    and its lock before it was refused. (Process 0 reads them; the others take its encoded cache.)"""
    dc = config.data
    if unnamed := config.unnamed_training_files():
        raise ConfigError(unnamed)
    for name in DATA_FILES:
        if path := getattr(dc, name):
            _require_data_file(config, f"data.{name}", path)


def _require_data_file(config: RunConfig, setting: str, path: str) -> None:
    """`require_file`, its refusal named with the setting and where it was written, as other settings'
    problems are. Of a relative path not found, where it was looked for: from a config in another
    directory ("cd /tmp; aiayn train --config ~/aiayn/configs/tiny.toml"), a bare "file not found"."""
    try:
        require_file(Path(path))
    except UserError as e:
        raise UserError(_placed_path(config, setting, path, str(e))) from None


def _placed_path(config: RunConfig, setting: str, path: str, problem: str) -> str:
    """`problem` with the path that `setting` names, after where it was written; one of the path itself
    ("PATH: file not found") as `setting`=PATH, and of a relative path not found, the directory it was
    looked for in."""
    if not problem.startswith(f"{Path(path)}: "):  # a file inside (a checkpoint's meta.json) names itself
        return f"{config.written_where(setting)}{problem}"
    # not there: a broken link is, and a checkpoint a killed save moved aside is found (its error says so)
    relative = not os.path.isabs(path) and not os.path.lexists(path) and moved_aside(Path(path)) is None
    looked = ""
    with suppress(OSError):  # a current directory deleted: the refusal without the hint
        looked = f" (a relative path is read from the current directory, {os.getcwd()})" if relative else ""
    # the path as written (./nodir/ was said as nodir), then the problem
    return f"{config.written_where(setting)}{setting}={path}{problem[len(str(Path(path))):]}{looked}"


def _check_run_dir(run_dir: Path) -> None:
    """An unusable run_dir fails now, in one line, not with a traceback after the tokenizer's training."""
    try:
        os.lstat(run_dir)
    except FileNotFoundError:
        pass
    except OSError as e:  # a name too long: exists() let its error through, a traceback
        raise UserError(f"{run_dir}: train.run_dir cannot be used ({e.strerror or e})") from None
    except ValueError:  # a NUL in the name
        raise UserError(f"{str(run_dir)!r}: train.run_dir cannot be used (a NUL character in its "
                        "name)") from None
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"{run_dir}: train.run_dir exists and is not a directory")
    if run_dir.is_symlink() and not run_dir.exists():  # mkdir said "File exists"
        target = os.readlink(run_dir)
        raise UserError(f"{run_dir}: train.run_dir is a link that leads to no directory ({target})")
    _check_outside_other_runs(run_dir)
    _check_usable(run_dir, "train.run_dir ")
    # The first save can come hours later, the ids cache is written after the tokenizer's training (and was
    # a traceback where it could not be read): an unusable one fails now
    for directory in (run_dir / "checkpoints", run_dir / "cache"):
        if directory.is_dir():
            _check_usable(directory)
        elif os.path.lexists(directory):  # a file, or a link to nothing: nothing can be written under it
            raise UserError(f"{directory}: exists and is not a directory")
    _refuse_stray_steps(run_dir / "checkpoints")


def _refuse_stray_steps(checkpoints: Path) -> None:
    """A step_N in checkpoints/ that is no directory (a file, a link to none) is no checkpoint to
    `checkpoint_dirs`: --resume went on from the one before, trained up to update N and failed at its save
    ("exists and is not a directory"), at every resume."""
    if not checkpoints.is_dir():
        return
    for path in sorted(checkpoints.iterdir()):
        if STEP_DIR.match(path.name) and not path.is_dir():
            what = ("is a link that leads to no directory" if path.is_symlink() and not path.exists()
                    else "is a file, not a checkpoint directory")
            raise UserError(f"{path}: {what}, under a name training saves its checkpoints by; move it out "
                            f"of {checkpoints}")


def _check_usable(directory: Path, name: str = "") -> None:
    """`directory` made if missing, listed (leftovers and stale caches are swept by listing) and written to,
    or a one-line `UserError`; `name` says what it is."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with os.scandir(directory):
            pass
    except OSError as e:
        raise UserError(f"{directory}: {name}cannot be read ({e.strerror or e})") from None
    try:
        # Writing is the only test root cannot pass by rights; a byte, as an empty file is made on a full
        # disk too (unbuffered: written now, not when closed)
        with tempfile.TemporaryFile(dir=directory, buffering=0) as probe:
            probe.write(b"\0")
    except OSError as e:
        raise UserError(f"{directory}: {name}cannot be written ({e.strerror or e})") from None


def _check_outside_other_runs(run_dir: Path) -> None:
    """A run_dir that is or lies inside a checkpoint (the one `init_from` reads, say), or inside another
    run's checkpoints/, would be deleted whole, this run's checkpoints with it, when that run prunes."""
    if (inside := enclosing_checkpoint(run_dir)) is not None:
        relation, place = inside
        raise UserError(f"{run_dir}: train.run_dir {relation} the checkpoint {place}, which its run's "
                        "keep_last may delete; choose another run_dir")
    if (owned := training_owned(run_dir)) is not None:
        relation, place = owned
        raise UserError(f"{run_dir}: train.run_dir {relation} {place}, the checkpoints of the run "
                        f"{place.parent}; choose another run_dir")


def _read_resumed(d: Dist, run_dir: Path, resume_from: Path | None, work: Callable[[], T]) -> T:
    """`work`, reading the checkpoint to resume from (or init_from's) on every process: its errors with
    `_resume_hint`'s hint, said once for all processes (`distributed.on_every`)."""

    def hinted() -> T:
        with _resume_hint(run_dir, resume_from):
            return work()

    return distributed.on_every(d, hinted)


@contextmanager
def _resume_hint(run_dir: Path, resume_from: Path | None):
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


def _checkpoint_to_resume(run_dir: Path, resume: bool, init_from: str = "") -> Path | None:
    found = checkpoint_dirs(run_dir)
    if resume and not found:  # killed before its first save: a restart loop passing --resume goes on
        log.info("%s: no checkpoint to resume from yet; starting from the beginning", run_dir)
        return None
    if not resume and found and init_from and not _same_init_from(found[-1], _fine_tuned_from(found[-1]),
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


def prepare_data(config: RunConfig, run_dir: Path, d: Dist, tokenizer: Tokenizer | None = None,
                 fixed_positions: int | None = None) -> Data:
    """Tokenizer (trained on the training text once, kept in the run directory) and cached ids.

    Process 0 trains the tokenizer and fills the cache; the others wait, then read the cache.
    A given `tokenizer` (a fine-tuned checkpoint's) is used as it is: nothing is trained.
    `fixed_positions`: a fine-tune's or a resume's model.max_len, which the run cannot change.
    """
    dc = config.data  # its files are named and there (`_check_data_files`)
    # Process 0's caches, named to all: every process trains on the pairs process 0 encoded, whatever the
    # files look like from its own machine. Errors reach every process.
    caches, shared = distributed.on_main(d, lambda: _prepare_files(config, run_dir, tokenizer), long=True)
    tokenizer = tokenizer or find_tokenizer(run_dir, shared)  # the kind process 0 found or trained
    if tokenizer is None:  # process 0 wrote it: this process is on a machine that cannot see run_dir
        raise UserError(f"{run_dir}: no tokenizer; with several machines, put run_dir on a shared filesystem")
    read = read_encoded(Path(caches[0][0]), caches[0][1], tokenizer)
    train, train_too_long = read.filter_length(dc.max_len)
    # the pair named: its target may be the long side ("tr.ja: ... 1 longer" blamed the source file)
    pair = f"{dc.train_src}, {dc.train_tgt}"
    _require_pairs(pair, "training", len(train), train_too_long, dc.max_len)
    highest = _highest_max_len(config, fixed_positions)
    if d.is_main:
        _say_too_long(config, pair, len(train), train_too_long, fixed_positions)
    batches = token_batches(train.src_lengths(), train.tgt_lengths(), config.train.max_tokens)
    raised = None
    if train_too_long and highest > dc.max_len and len(batches) < d.world_size * config.train.update_freq:
        wider = read.filter_length(highest)[0]  # a corpus this short is cheap to batch again
        raised = highest, len(token_batches(wider.src_lengths(), wider.tgt_lengths(),
                                            config.train.max_tokens))
    valid, valid_batches = None, []
    if dc.valid_src:
        valid = read_encoded(Path(caches[1][0]), caches[1][1], tokenizer)
        valid, too_long = valid.filter_length(dc.max_len)
        pair = f"{dc.valid_src}, {dc.valid_tgt}"
        _require_pairs(pair, "validation", len(valid), too_long, dc.max_len)
        if too_long and d.is_main:
            scored = " from the loss (BLEU scores them too)" if config.train.bleu_every else ""
            log.warning("%s: %d validation %s longer than max_len=%d dropped%s", pair, too_long,
                        "pair" if too_long == 1 else "pairs", dc.max_len, scored)
        valid_batches = token_batches(valid.src_lengths(), valid.tgt_lengths(), config.train.max_tokens)
    valid_text = (  # BLEU is scored by process 0
        read_parallel(dc.valid_src, dc.valid_tgt, report=False)
        if dc.valid_src and config.train.bleu_every and d.is_main else None
    )
    return Data(tokenizer, train, batches, valid, valid_batches, valid_text, train_too_long, raised)


def _model_max_len(config: RunConfig) -> int:
    """model.max_len as [model] sets it (the vocabulary's size aside, which the tokenizer gives)."""
    return config.model_config(vocab_size=64).max_len


def _highest_max_len(config: RunConfig, fixed_positions: int | None) -> int:
    """The highest data.max_len a run may set: a batch of train.max_tokens holds a pair, and a checkpoint's
    model (a fine-tune's, a resume's) has `fixed_positions`."""
    tokens = config.train.max_tokens
    return tokens if fixed_positions is None else min(tokens, fixed_positions)


def _say_too_long(config: RunConfig, pair: str, kept: int, too_long: int,
                  fixed_positions: int | None) -> None:
    """The training pairs kept and those dropped as longer than data.max_len, a warning from 1% dropped
    on: a corpus' few stray long lines (noisy web text) are routine and said at INFO, as fairseq's warning
    on any drop, every run, teaches users to skip warnings; a larger share is a max_len that does not fit
    the corpus or its tokenizer (the line said 1968 of 2000 dropped at INFO, as routine as the others).
    The cure said is one this run may take (a fine-tune's or a resume's model fixes its positions: raising
    model.max_len was advised, and refused)."""
    max_len = config.data.max_len
    if too_long * 100 < kept + too_long:
        log.info("%s: %s; %d longer than max_len=%d dropped", pair,
                 _counted(kept, "training pair", "training pairs"), too_long, max_len)
        return
    highest = _highest_max_len(config, fixed_positions)
    if highest > max_len:
        limit = "train.max_tokens" if highest == config.train.max_tokens else "the model's positions"
        also = " (and model.max_len)" * (fixed_positions is None and highest > _model_max_len(config))
        cure = f"raise data.max_len{also} (up to {highest}, {limit})"
    elif fixed_positions == max_len:
        cure = f"the model has {max_len} positions: split or shorten them"
    else:  # data.max_len is train.max_tokens
        also = " (and model.max_len)" * (fixed_positions is None and max_len >= _model_max_len(config))
        cure = f"raise train.max_tokens with data.max_len{also}"
    log.warning("%s: %s of %s training pairs are longer than %d tokens (%s) and dropped; %s to train on them",
                pair, f"{too_long:,}", f"{kept + too_long:,}", max_len,
                config.shown("data.max_len", max_len), cure)


def _require_pairs(pair: str, kind: str, kept: int, too_long: int, max_len: int) -> None:
    """Before training, not at the first validation: a set whose every pair is too long is empty. `pair`:
    its files ("train.de, train.en")."""
    if not kept:  # every process reads process 0's pairs: process 0 says so
        raise SameOnEveryProcess(
            f"{pair}: all {too_long} {kind} pairs are longer than data.max_len={max_len} tokens; "
            "raise data.max_len (and model.max_len) or use shorter sentences"
        )


def _prepare_files(config: RunConfig, run_dir: Path,
                   tokenizer: Tokenizer | None) -> tuple[list[tuple[str, str]], bool]:
    """On process 0: the tokenizer and the caches, so that the other processes only read; the (path, key)
    of the training set's cache, then the validation set's if there is one; and whether the tokenizer is
    shared (the kind of files the others read: a resumed run's, whatever else is left there)."""
    dc = config.data
    # a fine-tune's tokenizer, or that of a run resumed on other training files, learnt from other text
    kept, made_elsewhere = tokenizer is not None, False
    if tokenizer is None:
        tokenizer, kept, made_elsewhere = _run_tokenizer(config, run_dir)
    caches = []
    pairs = ((dc.train_src, dc.train_tgt, "training"), (dc.valid_src, dc.valid_tgt, "validation"))
    for src, tgt, kind in pairs:
        if src:  # it says what it dropped
            # a tokenizer made elsewhere: its rewriting of the training text, as training one checks it
            normalization = dc.normalization if made_elsewhere and kind == "training" else None
            corpus, _, (cache, key) = cache_encoded(src, tgt, tokenizer, run_dir / "cache", kept=kept,
                                                    kind=kind, normalization=normalization)
            # every run, from the cache too: the pairs used are data.max_len's, which its key leaves out
            # (a rerun at a raised max_len was never warned); validation's BLEU translates every pair
            max_len = None if kind == "validation" and config.train.bleu_every else dc.max_len
            warn_if_unknown(src, tgt, corpus, tokenizer.unk_id, max_len, kept)
            caches.append((str(cache), key))
    return caches, tokenizer.shared


# Settings --resume may change, each said in the log (Adam's own are said by `state.restore`, the number of
# CPU threads by `_say_other_threads`): the updates from there are computed otherwise, and a log that said
# nothing left no trace of why the curves bent
RESUME_CHANGES = ("precision", "compile", "lr_scale", "warmup", "cooldown", "label_smoothing", "clip_norm")
# With a cooldown, the budgets too: its lr is a fraction of the budget left (`_budget_used`), so another
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
    without validating, unsaid (another set's pairs restart the best loss, `_same_validation`)."""
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
    elsewhere): other pairs restart the best loss, which `_same_validation` says."""
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


def _compare_with_trained(checkpoint: Path, config: RunConfig, d: Dist) -> dict[str, Any] | None:
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
    # `initial_checkpoint`, saying which: its model and tokenizer are not compared (without init_from,
    # [data] adopted none of a fine-tune's tokenizer settings, whose defaults were refused as changes)
    tuned = config.train.init_from, (trained or {}).get("init_from")
    if all(tuned):
        kept += _other_finetune_model(checkpoint, meta, config)
    elif not any(tuned):
        kept += _other_model(checkpoint, meta, config)
    recorded = data is not None and "vocab_size" in data  # else `_with_checkpoint_tokenizer_settings`'s
    if recorded and (all(tuned) or not any(tuned)):
        defaults = _left_at_defaults(config)
        kept += [Kept(f"data.{key}", toml_value(was), toml_value(now), "tokenizer",
                      "the default" if key in defaults else "")
                 for key, was, now in tokenizer_differences(data, _tokenizer_settings(config))]
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
        *before, last = [k.now for k in group]
        now, note = f"{', '.join(before)} and {last}" if before else last, group[0].note
        resumed = f"the default {now}" if note == "the default" else f"{now} {note}".strip()
        if group[0].fix:  # "4 batches an update (4 processes x train.update_freq=1; resumed with 2 x 1)"
            said.append(f"{group[0].trained} ({group[0].setting}; resumed with {now})")
        else:
            said.append(f"{', '.join(f'{k.setting}={k.trained}' for k in group)} (resumed with {resumed})")
    whys = {k.why for k in kept}
    kinds = {"batches": "its batches (the saved position in the epoch counts them)", "model": "its model",
             "tokenizer": "its tokenizer"}
    *before, last = [kind for why, kind in kinds.items() if why in whys]
    what = f"{', '.join(before)} and {last}" if before else last
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


def _other_finetune_model(checkpoint: Path, meta: dict[str, Any], config: RunConfig) -> list[Kept]:
    """A resumed fine-tune's model is its own checkpoint's with [model]'s dropout (`finetune_model_config`,
    which refuses any other [model] key): another dropout than it trained with was refused by `restore`,
    after the data work, naming neither the setting nor where it was written."""
    try:
        saved = meta_model_config(checkpoint, meta)
    except UserError:  # damaged: `initial_checkpoint` names it
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
        fix = f"set train.update_freq={freq} ({world_size} processes x {freq})"
    else:
        fix = f"resume it with {processes} process{'es' * (processes > 1)}" + (
            f" and train.update_freq={update_freq}" if update_freq != now else "")
    written = "train.update_freq" if update_freq != now else ""  # else the command's alone
    return Kept(f"{processes} process{'es' * (processes > 1)} x train.update_freq={update_freq}",
                f"{product} batch{'es' * (product > 1)} an update", f"{world_size} x {now}", "batches",
                written=written, fix=fix)


def _kept_batches(config: RunConfig, setting: str, trained: int, now: int) -> Kept:
    return Kept(setting, str(trained), str(now), "batches", "the default" * config.is_default(setting, now))


def _check_found_tokenizer(found: Tokenizer, config: RunConfig, run_dir: Path) -> None:
    """A tokenizer left in run_dir (by a first run that failed later, or copied there) must be one that
    [data] trains: separate source.spm and target.spm under shared_vocab, or an 8,696-piece spm.model
    beside a record of 300, were used silently and recorded as trained with [data]'s settings.
    SentencePiece may make fewer pieces than asked (a small corpus), never more."""
    dc = config.data
    sizes = {found.src_vocab_size, found.tgt_vocab_size}
    problem = None
    if found.shared != dc.shared_vocab:
        kind = "one shared" if found.shared else "separate"
        problem = f"{kind} vocabulary, not data.shared_vocab={toml_value(dc.shared_vocab)}"
    elif max(sizes) > dc.vocab_size:
        problem = f"{max(sizes)} pieces, more than data.vocab_size={dc.vocab_size}"
    if problem:
        raise UserError(f"{run_dir}: its tokenizer has {problem}; delete it (spm.model, or source.spm and "
                        "target.spm) to train a new one, or use a new train.run_dir")
    _check_special_pieces(found)
    _check_trained_settings(found, config)


# [data]'s settings a SentencePiece model records and encodes by (`trained_settings`): another was overridden
# by the model unsaid, and recorded in meta.json as [data]'s (a case-folding model as "nmt_nfkc", a unigram
# one as "bpe"), which a fine-tune adopts and --resume compares
ENCODING_SETTINGS = {"spm_type": SPM_TYPES, "normalization": NORMALIZATIONS}


def _check_trained_settings(found: Tokenizer, config: RunConfig) -> None:
    """A tokenizer left in run_dir must have been trained with [data]'s spm_type and normalization (one
    that names no rule, built by hand, is not compared). data.character_coverage is not: it chose which
    characters training kept, and the pieces it made (checked above) are what the model holds; refused,
    the many models made with SentencePiece's default 0.9995 would need a `--set` that changes nothing
    but the record. Another is said instead."""
    dc = config.data
    models = [(found.src_path, found.src)] + ([] if found.shared else [(found.tgt_path, found.tgt)])
    for path, sp in models:
        trained = trained_settings(sp.serialized_model_proto(), path)
        other = {key: trained[key] for key in ENCODING_SETTINGS if trained[key] not in ("", getattr(dc, key))}
        delete = "delete the tokenizer (spm.model, or source.spm and target.spm) to train a new one"
        if cannot := [key for key, value in other.items() if value not in ENCODING_SETTINGS[key]]:
            key = cannot[0]
            raise UserError(f"{path}: trained with {key} {json.dumps(other[key])}, which data.{key} cannot "
                            f"be ({' or '.join(ENCODING_SETTINGS[key])}); {delete}")
        if other:
            was = " and ".join(f"{key} {json.dumps(value)}" for key, value in other.items())
            now = " and ".join(config.shown(f"data.{key}", getattr(dc, key)) for key in other)
            fix = " and ".join(f"data.{key}={json.dumps(value)}" for key, value in other.items())
            written = config.written_where(*(f"data.{key}" for key in other))
            raise UserError(f"{written}{path}: trained with {was}, not {now}; set {fix} to train with it, or "
                            f"{delete}")
        coverage = trained["character_coverage"]
        if struct.pack("<f", coverage) != struct.pack("<f", dc.character_coverage):
            log.info("%s: trained with character_coverage=%s, not data.character_coverage=%s, which only "
                     "training a tokenizer uses (the run records it as set)", path, coverage,
                     dc.character_coverage)


def _check_special_pieces(found: Tokenizer) -> None:
    """A SentencePiece model made elsewhere must have the pieces aiayn's batches use: pad, bos (the
    decoder's start) and eos. SentencePiece's defaults leave pad out (pad_id=-1): such a model was
    accepted, the corpus encoded and cached, and the model's configuration refused it after ("pad_id=-1
    is outside the vocabulary"). Any free ids will do. With two models, the ids come from target.spm
    (`Tokenizer`), so source.spm must give pad, eos and unk the same ones: its sentences are padded and
    ended with them, and their unknown pieces counted by them."""
    path, sp = (found.src_path, found.src) if found.shared else (found.tgt_path, found.tgt)
    ids = {"pad": sp.pad_id(), "bos": sp.bos_id(), "eos": sp.eos_id()}
    if missing := [name for name, i in ids.items() if i < 0]:
        raise UserError(
            f"{path}: the SentencePiece model has no {' or '.join(missing)} piece "
            f"({', '.join(f'{name}_id=-1' for name in missing)}); aiayn needs pad, bos and eos pieces: train "
            "it with an id for each (SentencePiece leaves pad out unless given one: e.g. --pad_id=3 beside "
            "its default unk_id=0 bos_id=1 eos_id=2), or delete it to train a new one"
        )
    if found.shared:
        return
    src = {"pad": found.src.pad_id(), "eos": found.src.eos_id(), "unk": found.src.unk_id()}
    tgt = {"pad": ids["pad"], "eos": ids["eos"], "unk": sp.unk_id()}
    if other := [f"{name}_id={src[name]}, not {tgt[name]}" for name in src if src[name] != tgt[name]]:
        raise UserError(
            f"{found.src_path}: special ids other than {path}'s ({'; '.join(other)}); aiayn takes both "
            f"sides' from {path.name}: train both models with the same pad_id, eos_id and unk_id, or delete "
            "them to train new ones"
        )


def _other_tokenizer(run_dir: Path, saved: list[Path], latest: Tokenizer, found: Tokenizer) -> UserError:
    """The refusal of a run directory whose tokenizer (`found`) is not its latest checkpoint's (`latest`):
    the earlier checkpoints' copies tell which is odd. The run's was blamed always, and putting the
    checkpoint's back over it, as advised, trained on silently with a swapped spm.model where that one
    was the file replaced."""
    earlier = []
    for checkpoint in saved[:-1]:
        with suppress(UserError):  # a damaged one tells nothing
            earlier.append(checkpoint_tokenizer(checkpoint, read_meta(checkpoint)))
    if earlier and all(found.same_as(t) for t in earlier):  # CorruptFile: `_resume_hint` adds the way out
        return CorruptFile(f"{_differing_file(latest, found, saved[-1])}: not the tokenizer of the run "
                           "directory and its earlier checkpoints (damaged, replaced, or another run's)")
    if earlier and all(latest.same_as(t) for t in earlier):
        return UserError(f"{run_dir}: its tokenizer is not the one {saved[-1].name} was trained with; put "
                         f"that checkpoint's back (the files in {saved[-1]}), or train in a new "
                         "train.run_dir")
    return UserError(f"{run_dir}: its tokenizer is not the one in {saved[-1]}, and no earlier checkpoint "
                     "tells which of the two the run was trained with; keep both, and train in a new "
                     "train.run_dir or put the right one in the other's place")


def _differing_file(latest: Tokenizer, found: Tokenizer, checkpoint: Path) -> Path:
    """The file of `checkpoint`'s tokenizer (`latest`) that is not `found`'s: a SentencePiece model, or
    meta.json where both models are the same (special ids, a vocabulary)."""
    (src, tgt), (their_src, their_tgt) = latest.models(), found.models()  # tgt None: one shared model
    if src != their_src or (tgt is None) != (their_tgt is None):
        return latest.src_path
    return latest.tgt_path if tgt != their_tgt and latest.tgt_path else checkpoint / META


@contextmanager
def _damaged_tokenizer():
    """A run directory's SentencePiece model that cannot be read: the remedy, which the checkpoints' own
    copy or a new tokenizer gives."""
    try:
        yield
    except CorruptFile as e:
        raise UserError(f"{e}; delete it: --resume puts the checkpoint's copy back, a run without "
                        "checkpoints trains a new one") from None


def _check_lone_model(run_dir: Path, trained_with: Tokenizer, checkpoint: Path) -> None:
    """Half of a resumed run's pair (a full disk or a kill while --resume put the pair back: source.spm
    is written first) is mended where it is the checkpoint's own model of its side; another is refused,
    named, not written over (it was, unsaid)."""
    if trained_with.shared:
        return
    for path, model, partner in ((run_dir / SOURCE, trained_with.src, TARGET),
                                 (run_dir / TARGET, trained_with.tgt, SOURCE)):
        if path.is_file() and Tokenizer(path).src.serialized_model_proto() != model.serialized_model_proto():
            raise UserError(f"{path}: not the {path.name} of {checkpoint}'s tokenizer (damaged, replaced, or "
                            f"another run's), and no {partner} beside it; move it out of {run_dir}: --resume "
                            "then puts the checkpoint's tokenizer back")


def _run_tokenizer(config: RunConfig, run_dir: Path) -> tuple[Tokenizer, bool, bool]:
    """The run directory's tokenizer: trained once on the training text, then reused if it fits; whether it
    is kept for other text than it was trained on (a run resumed on other training files); and whether
    it was made elsewhere (put in a new run directory, with no record of aiayn's training), so that its
    rewriting of this text was never checked."""
    dc = config.data
    saved = checkpoint_dirs(run_dir)
    with _damaged_tokenizer():
        found = None if saved else find_tokenizer(run_dir)  # resumed: the checkpoints' kind, below
    inputs = tokenizer_inputs(dc.train_src, dc.train_tgt, _tokenizer_settings(config))
    if saved:  # resumed: the tokenizer its checkpoints were trained with, which each of them holds
        latest = saved[-1]
        meta = read_meta(latest)
        trained_with = checkpoint_tokenizer(latest, meta)
        if (data := config_section(meta, "data")) is not None:  # what they were trained with, if recorded
            refuse_other_tokenizer_settings(latest, data, inputs, _tokenizer_written_at(config, data),
                                            _left_at_defaults(config))
        with _damaged_tokenizer():
            found = find_tokenizer(run_dir, trained_with.shared)
        if found is None:  # only checkpoints/ was copied here, or a pair's write stopped half way
            with _damaged_tokenizer():
                _check_lone_model(run_dir, trained_with, latest)
            trained_with.save(run_dir)  # put its tokenizer back, train none
            found = find_tokenizer(run_dir, trained_with.shared)
        elif not found.same_as(trained_with):
            raise _other_tokenizer(run_dir, saved, trained_with, found)
        mine = [SHARED] if found.shared else [SOURCE, TARGET]
        if others := [name for name in (SHARED, SOURCE, TARGET)
                      if name not in mine and (run_dir / name).is_file()]:
            log.warning("%s: %s left unused there: the checkpoints' tokenizer is %s", run_dir,
                        " and ".join(others), " and ".join(mine))
    if found is not None:  # resumed: the tokenizer of its checkpoints; else left by a first run that
        other_text = check_tokenizer_inputs(run_dir, inputs, resumed=bool(saved))  # failed later
        made_elsewhere = False
        if not saved:  # its record (tokenizer_inputs.json) says what it was asked, not what the files hold
            _check_found_tokenizer(found, config, run_dir)
            made_elsewhere = not (run_dir / TOKENIZER_INPUTS).is_file()
        # as the training line says it: "(200 pieces, shared)" (this read "(200, shared pieces)")
        pieces = "" if found.shared else f" and {found.tgt_vocab_size}"
        log.info("%s: using the tokenizer there (%d%s pieces, %s)", run_dir, found.src_vocab_size, pieces,
                 "shared" if found.shared else "separate")
        return found, other_text, made_elsewhere
    # Checked, not reported: the encoding that follows says what it dropped, once.
    if dc.valid_src:  # a bad validation file fails now, not after minutes of tokenizer training
        read_parallel(dc.valid_src, dc.valid_tgt, report=False)
    text = scan_parallel(dc.train_src, dc.train_tgt, report=False)  # streamed to SentencePiece, not held
    log.info(
        "training a %s SentencePiece model (%d pieces, %s) on %d pairs",
        dc.spm_type,
        dc.vocab_size,
        "shared" if dc.shared_vocab else "separate",
        len(text.src),
    )
    write_tokenizer_inputs(run_dir, inputs)
    # The sample of a large corpus is drawn with train_tokenizer's fixed seed, not train.seed: runs of other
    # seeds on one corpus get one tokenizer, as an ensemble of them needs
    return train_tokenizer(text, run_dir, dc.vocab_size, dc.spm_type, dc.shared_vocab,
                           dc.normalization, dc.character_coverage), False, False


def _describe(config: RunConfig, model: Transformer, data: Data, d: Dist) -> str:
    import json

    tc = config.train
    lines = [json.dumps({**config.to_dict(), "resolved_model": model.config.__dict__}, indent=2)]
    lines.append(
        f"parameters {model.num_parameters():,}; vocabulary {data.tokenizer.src_vocab_size}"
        f"{'' if data.tokenizer.shared else f' / {data.tokenizer.tgt_vocab_size}'}; "
        f"{len(data.train)} pairs in {len(data.train_batches)} batches; processes {d.world_size} on "
        f"{d.device}; tokens per update <= {tc.max_tokens * tc.update_freq * d.world_size}"
    )
    return "\n".join(lines)

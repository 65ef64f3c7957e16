"""`train(config)`: the paper's recipe (section 5), from one CPU to many GPUs.

Four functions, read in this order: `train` (the process group; a caller's autocast and grad mode kept
out) -> `_train` (settings checked, run_dir locked) -> `_train_locked` (prepare data, build the model, or
start from `train.init_from`'s checkpoint and its tokenizer: fine-tuning, and Adam, maybe resume) ->
`_loop` (the updates). One update accumulates `update_freq` token-batches per process (DDP synchronizes
gradients on the last one only, `no_sync`), normalizes by the update's target tokens, sets the learning
rate of equation 3 and steps. Every `valid_every` updates: validation loss, a checkpoint, the curves.

torch.compile, DDP and autocast wrap the model at the edges; checkpoints see only the plain model.
What --resume checks of the checkpoint it continues is `aiayn.train.resume`'s, the run directory's
tokenizer `aiayn.train.run_tokenizer`'s.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from aiayn.checkpoint import (
    Checkpoint,
    averaged_from,
    enclosing_checkpoint,
    load_checkpoint,
    model_from_weights,
    read_meta,
    state_dict_for_saving,
)
from aiayn.config import ConfigError
from aiayn.data.batching import epoch_order, token_batches, update_batches, updates_in_epoch
from aiayn.data.dataset import (
    Batch,
    EncodedCorpus,
    ParallelText,
    cache_encoded,
    collate,
    find_tokenizer,
    read_encoded,
    read_parallel,
    warn_if_unknown,
)
from aiayn.data.tokenizer import Tokenizer
from aiayn.decoding.options import MAX_CPU_SEED
from aiayn.errors import Stopped, Terminated, UserError, is_out_of_memory
from aiayn.files import moved_aside, raise_dropped_stop, recover_replaced, remove_abandoned, require_file
from aiayn.memory import cap_kernel_caches, keep_freed_memory, release_freed_memory
from aiayn.model import Transformer, evaluating
from aiayn.train import distributed
from aiayn.train.config import (
    DATA_FILES,
    RunConfig,
    finetune_model_config,
    toml_value,
    vocabulary_model_config,
)
from aiayn.train.distributed import Dist, SameOnEveryProcess
from aiayn.train.loss import label_smoothed_nll
from aiayn.train.metrics import MetricsLog, capped_ppl, plot_metrics, shown_ppl
from aiayn.train.progress import lines_above, shown_if_unconfigured
from aiayn.train.resume import (
    best_still_there,
    checkpoint_to_resume,
    compare_with_trained,
    epoch_on_this_corpus,
    fine_tuned_from,
    init_from_here,
    read_resumed,
    refuse_tokenizer_settings,
    resume_hint,
    same_init_from,
    same_smoothing,
    same_validation,
    what_resume_does,
    with_checkpoint_tokenizer_settings,
)
from aiayn.train.run_tokenizer import run_tokenizer
from aiayn.train.schedule import cooldown_factor, inverse_sqrt_lr
from aiayn.train.state import (
    STEP_DIR,
    RunLock,
    TrainState,
    checkpoint_dirs,
    own_random_stream,
    prune,
    restore,
    rng_states,
    save_training_checkpoint,
    step_dir_name,
    training_owned,
)

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
    except (RuntimeError, Terminated) as e:
        # torchrun SIGTERMs the others once a process stops: one that came as the collective's error left the
        # updates' handlers was raised over it, and "stopped by SIGTERM" was said instead of the cause
        failed = e.__context__ if isinstance(e, Terminated) else e
        resume_does = partial(what_resume_does, Path(config.train.run_dir))  # listed only for a lost peer
        if (lost := distributed.peer_lost(failed, d, resume_does)) is not None:
            raise lost from None
        raise
    finally:
        torch.set_num_threads(threads)  # the caller's: train.threads=1 left a notebook's later runs on one
        distributed.teardown(d)


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


def _too_few_batches(config: RunConfig, data: Data, d: Dist, resumed: bool = False) -> SameOnEveryProcess:
    """The refusal of a corpus cut into fewer batches than one update takes, with only the changes that
    give one: a batch holds at least one pair, so with fewer pairs than batches an update takes, a lower
    train.max_tokens (once the only advice) cannot help. A `resumed` run keeps its batches (`resume`
    refuses another update_freq, max_tokens, data.max_len or processes x update_freq, each once advised
    here): more pairs or a new run directory alone."""
    dc, tc = config.data, config.train
    pairs, batches, per_update = len(data.train), len(data.train_batches), d.world_size * tc.update_freq
    ways = ", or ".join(_ways_to_an_update(config, data, d)) if not resumed else (
        "--resume keeps the batches an update takes (the saved position counts them): train on more pairs, "
        "or use a new train.run_dir")
    processes = f" x {d.world_size} processes" if d.enabled else ""
    return SameOnEveryProcess(
        f"{dc.train_src}, {dc.train_tgt}: {_counted(pairs, 'training pair', 'training pairs')} "
        f"{'makes' if pairs == 1 else 'make'} {_counted(batches, 'batch', 'batches')} of train.max_tokens="
        f"{tc.max_tokens}, fewer than the {per_update} one update takes (train.update_freq={tc.update_freq}"
        f"{processes}); {ways}"
    )


def _ways_to_an_update(config: RunConfig, data: Data, d: Dist) -> list[str]:
    """The changes of a new run (or a fine-tune) that give `data` one update at least."""
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
    return ways


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
    resume_from = distributed.on_main(d, lambda: checkpoint_to_resume(run_dir, resume, tc.init_from))
    # on every process, its refusal said once
    config = distributed.on_every(d, lambda: with_checkpoint_tokenizer_settings(config, resume_from))
    trained = None  # the [train] the checkpoint resumed from was trained with
    if resume_from:
        trained = read_resumed(d, run_dir, resume_from,
                               lambda: compare_with_trained(resume_from, config, d))
    if tc.threads:
        torch.set_num_threads(tc.threads)
    keep_freed_memory()  # every step frees and re-allocates the same large tensors
    torch.manual_seed(tc.seed)
    random.seed(tc.seed)
    start_from = read_resumed(d, run_dir, resume_from, lambda: initial_checkpoint(config, resume_from))
    with resume_hint(run_dir, resume_from):  # the tokenizer of a resumed run is read from its checkpoint
        fixed = (start_from.model.config.max_len if start_from else _model_max_len(config)) if (
            resume_from or tc.init_from) else None
        data = prepare_data(config, run_dir, d, start_from.tokenizer if start_from else None, fixed,
                            resumed=resume_from is not None)
    release_freed_memory()  # what the tokenizer's training and the encoding freed (a quarter GB at 1.5 M
    # pairs) was kept until the first validation's trim
    tok = data.tokenizer
    model = (start_from.model if start_from else build_model(config, tok)).to(d.device)
    model.checkpoint_activations = tc.checkpoint_activations
    own_random_stream(tc.seed, d.rank)  # after the model: built alike (DDP then copies process 0's anyway)
    optimizer = torch.optim.Adam(  # fused: one pass per tensor, 3x faster than the default on a CPU
        model.parameters(), lr=0.0, betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps, fused=True
    )
    scaler = torch.amp.GradScaler("cuda", enabled=tc.precision == "fp16")
    per_update = d.world_size * tc.update_freq
    n_updates = updates_in_epoch(len(data.train_batches), per_update)
    if n_updates == 0:
        raise _too_few_batches(config, data, d, resumed=resume_from is not None)
    def restored() -> TrainState:
        state = restore(resume_from, model, optimizer, scaler, d) if resume_from else TrainState()
        epoch_on_this_corpus(state, n_updates, data.train.digest(), resume_from, d)
        return state

    state = read_resumed(d, run_dir, resume_from, restored)
    same_validation(state, data, run_dir, d)
    same_smoothing(state, trained, tc.label_smoothing, run_dir, d)
    best_still_there(state, run_dir, d)  # after those: a best that starts again is no longer "gone"
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
        log.info("stopped (%s) after %d update%s, %.1f min of training%s", stop, state.step,
                 "s"[: state.step != 1], state.seconds / 60, session)
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
            with _memory_said(f"update {state.step + 1}", tc, recompute=True):
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
        # one Python dropped before (during the data's preparation: `aiayn.cli._dropped_stops_kept`) stops
        # here, as it would have there, not at the first checkpoint's rename (which it would abort)
        raise_dropped_stop()
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


def initial_checkpoint(config: RunConfig, resume_from: Path | None) -> Checkpoint | None:
    """With train.init_from: its model (in training mode, [model]'s dropout) and tokenizer, else None.

    A resumed fine-tuning run reads them from its own checkpoint (the same tokenizer files and model
    config, saved there), so the init_from directory is needed only for the first invocation.
    """
    tuned_from = fine_tuned_from(resume_from) if resume_from else None
    if resume_from and not same_init_from(resume_from, tuned_from, config.train.init_from):
        # no init_from: the model built from [model] failed to load with a less helpful mismatch; another
        # one was ignored (the run goes on from its own checkpoint) and saved as where the run started
        if tuned_from:
            raise UserError(f"{resume_from}: this run fine-tunes {tuned_from}; "
                            f"resume it with train.init_from={init_from_here(resume_from, tuned_from)}")
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
    refuse_tokenizer_settings(config, ck.meta, path)
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
    # Autocast keeps its bf16/fp16 copies of the weights until the outermost autocast ends, and train()
    # runs inside one (disabled, to keep a caller's out): without these, every update after the first
    # computed with the first update's copies, and the weights saved were never the ones validated. Before
    # the forward too: a recompute of train.checkpoint_activations casts them again in the backward pass,
    # and a compiled model's bf16 CPU attention runs its checkpoint eagerly (a graph break), without the
    # model's own clearing (`Transformer._run`)
    torch.clear_autocast_cache()
    with autocast:
        logits = net(batch.src, batch.tgt_in, batch.positions)  # (N, V), N = real target tokens
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
def _memory_said(doing: str, tc, recompute: bool = False) -> Iterator[None]:
    """An allocation failing in `doing` as one line naming the setting that sizes it, where it was an
    out-of-memory traceback (CUDA's, or the CPU allocator's). Both the updates' batches and the
    validation's (loss and BLEU) hold up to train.max_tokens tokens a side. A --resume must keep
    max_tokens (`resume._other_batches`): it helps only where the memory was taken by something else,
    or, in an update (`recompute`) of a run that keeps its activations, with train.checkpoint_activations,
    which a --resume may turn on (the same updates, bit for bit)."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        sized = f"out of memory in {doing} (batches of up to train.max_tokens={tc.max_tokens} tokens a side)"
        keep = "train.update_freq to keep the tokens of an update"
        less = "train.checkpoint_activations=true (less memory, the same updates)"
        recompute = recompute and not tc.checkpoint_activations
        if saved := checkpoint_dirs(tc.run_dir):
            also = f"with {less} or " if recompute else ""
            raise UserError(f"{sized}: --resume goes on from {saved[-1]} {also}where more memory is free, or "
                            f"train anew with a lower train.max_tokens (a resume keeps it) and a higher "
                            f"{keep}") from None
        raise UserError(f"{sized}: {f'set {less}, or ' if recompute else ''}lower train.max_tokens, and "
                        f"raise {keep}") from None


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
        # an average or a copy outside checkpoints/ is no run's to prune, but is replaced whole
        fate = ("its run's keep_last may delete" if training_owned(place) is not None
                else "another average or save_checkpoint replaces whole")
        raise UserError(f"{run_dir}: train.run_dir {relation} the checkpoint {place}, which {fate}; choose "
                        "another run_dir")
    if (owned := training_owned(run_dir)) is not None:
        relation, place = owned
        raise UserError(f"{run_dir}: train.run_dir {relation} {place}, the checkpoints of the run "
                        f"{place.parent}; choose another run_dir")


def prepare_data(config: RunConfig, run_dir: Path, d: Dist, tokenizer: Tokenizer | None = None,
                 fixed_positions: int | None = None, resumed: bool = False) -> Data:
    """Tokenizer (trained on the training text once, kept in the run directory) and cached ids.

    Process 0 trains the tokenizer and fills the cache; the others wait, then read the cache.
    A given `tokenizer` (a fine-tuned checkpoint's) is used as it is: nothing is trained.
    `fixed_positions`: a fine-tune's or a resume's model.max_len, which the run cannot change; a `resumed`
    run cannot change data.max_len either (its batches are the checkpoint's), so none is advised.
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
    cure = _longer_pairs_cure(config, fixed_positions, resumed)
    _require_pairs(pair, "training", len(train), train_too_long, dc.max_len, cure)
    highest = _highest_max_len(config, fixed_positions)
    if d.is_main:
        _say_too_long(config, pair, len(train), train_too_long, cure)
    batches = token_batches(train.src_lengths(), train.tgt_lengths(), config.train.max_tokens)
    raised = None  # not on a resume, which keeps data.max_len (`_too_few_batches`)
    short = len(batches) < d.world_size * config.train.update_freq
    if train_too_long and highest > dc.max_len and short and not resumed:
        wider = read.filter_length(highest)[0]  # a corpus this short is cheap to batch again
        raised = highest, len(token_batches(wider.src_lengths(), wider.tgt_lengths(),
                                            config.train.max_tokens))
    valid, valid_batches = None, []
    if dc.valid_src:
        valid = read_encoded(Path(caches[1][0]), caches[1][1], tokenizer)
        valid, too_long = valid.filter_length(dc.max_len)
        pair = f"{dc.valid_src}, {dc.valid_tgt}"
        _require_pairs(pair, "validation", len(valid), too_long, dc.max_len, cure)
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


def _longer_pairs_cure(config: RunConfig, fixed_positions: int | None, resumed: bool) -> str:
    """What keeps the pairs longer than data.max_len, as this run may do it: a fine-tune's or a resume's
    model fixes its positions (raising model.max_len was advised, and refused), and a resume its
    data.max_len (raising it was advised, and refused by `resume`); model.max_len is named only where it is
    what stops a higher data.max_len (it was named where it was 1024 and data.max_len 3)."""
    max_len = config.data.max_len
    if resumed:
        return "--resume keeps data.max_len (the saved position counts its batches): use a new train.run_dir"
    highest = _highest_max_len(config, fixed_positions)
    if highest > max_len:
        limit = "train.max_tokens" if highest == config.train.max_tokens else "the model's positions"
        also = " (and model.max_len)" * (fixed_positions is None and highest > _model_max_len(config))
        return f"raise data.max_len{also} (up to {highest}, {limit})"
    if fixed_positions == max_len:
        return f"the model has {max_len} positions: split or shorten them"
    # data.max_len is train.max_tokens
    also = " (and model.max_len)" * (fixed_positions is None and max_len >= _model_max_len(config))
    return f"raise train.max_tokens with data.max_len{also}"


def _say_too_long(config: RunConfig, pair: str, kept: int, too_long: int, cure: str) -> None:
    """The training pairs kept and those dropped as longer than data.max_len, a warning from 1% dropped
    on: a corpus' few stray long lines (noisy web text) are routine and said at INFO, as fairseq's warning
    on any drop, every run, teaches users to skip warnings; a larger share is a max_len that does not fit
    the corpus or its tokenizer (the line said 1968 of 2000 dropped at INFO, as routine as the others).
    `cure`: `_longer_pairs_cure`'s."""
    max_len = config.data.max_len
    if too_long * 100 < kept + too_long:
        log.info("%s: %s; %d longer than max_len=%d dropped", pair,
                 _counted(kept, "training pair", "training pairs"), too_long, max_len)
        return
    log.warning("%s: %s of %s training pairs are longer than %d tokens (%s) and dropped; %s to train on them",
                pair, f"{too_long:,}", f"{kept + too_long:,}", max_len,
                config.shown("data.max_len", max_len), cure)


def _require_pairs(pair: str, kind: str, kept: int, too_long: int, max_len: int, cure: str) -> None:
    """Before training, not at the first validation: a set whose every pair is too long is empty. `pair`:
    its files ("train.de, train.en"); `cure`: `_longer_pairs_cure`'s."""
    if not kept:  # every process reads process 0's pairs: process 0 says so
        shorter = "" if cure.endswith("shorten them") else ", or use shorter sentences"
        raise SameOnEveryProcess(f"{pair}: all {too_long} {kind} pairs are longer than "
                                 f"data.max_len={max_len} tokens; {cure}{shorter}")


def _prepare_files(config: RunConfig, run_dir: Path,
                   tokenizer: Tokenizer | None) -> tuple[list[tuple[str, str]], bool]:
    """On process 0: the tokenizer and the caches, so that the other processes only read; the (path, key)
    of the training set's cache, then the validation set's if there is one; and whether the tokenizer is
    shared (the kind of files the others read: a resumed run's, whatever else is left there)."""
    dc = config.data
    # a fine-tune's tokenizer, or that of a run resumed on other training files, learnt from other text
    kept, made_elsewhere = tokenizer is not None, False
    if tokenizer is None:
        tokenizer, kept, made_elsewhere = run_tokenizer(config, run_dir)
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


def _describe(config: RunConfig, model: Transformer, data: Data, d: Dist) -> str:
    tc = config.train
    lines = [json.dumps({**config.to_dict(), "resolved_model": model.config.__dict__}, indent=2)]
    lines.append(
        f"parameters {model.num_parameters():,}; vocabulary {data.tokenizer.src_vocab_size}"
        f"{'' if data.tokenizer.shared else f' / {data.tokenizer.tgt_vocab_size}'}; "
        f"{len(data.train)} pairs in {len(data.train_batches)} batches; processes {d.world_size} on "
        f"{d.device}; tokens per update <= {tc.max_tokens * tc.update_freq * d.world_size}"
    )
    return "\n".join(lines)

"""Many processes with PyTorch's own engine: torchrun sets RANK / WORLD_SIZE / LOCAL_RANK, we join.

    torchrun --nproc_per_node 8 -m aiayn train --config configs/base.toml         # one machine
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d \\
             --rdzv_endpoint HOST:29500 --rdzv_id RUN -m aiayn train ...           # on each machine

NCCL on GPUs, gloo on CPUs. Without torchrun's variables this is one process and nothing here talks.
The few numbers the processes agree on at every update (stop signals, the training clock) and per log
line go through gloo even on GPUs: an NCCL all-reduce of a host value first copies it to the GPU, which
waits for the update's queued work, so the host could not prepare the next batches meanwhile.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from aiayn.config import ConfigError
from aiayn.errors import UserError

T = TypeVar("T")

log = logging.getLogger(__name__)

# How long a process waits in a collective before it takes the others as stuck, and gives up.
GROUP_TIMEOUT = datetime.timedelta(minutes=30)
# How long the others wait for process 0's data preparation (`on_main(..., long=True)`): the tokenizer's
# training and the corpus's encoding. Under GROUP_TIMEOUT they gave up while process 0 encoded a large
# corpus (the paper's 36M EN-FR pairs, twice as long as Multi30k's: past half an hour at the README's 43 s
# a million Multi30k pairs), and a rerun began it again. Also its validation BLEU, a greedy decoding of the
# whole validation set. A process 0 that fails or dies ends the wait at once (its message, or gloo's reset
# connection), so only a process 0 stuck for a day is waited for that long. Its other work (a checkpoint's
# save) keeps GROUP_TIMEOUT: a stalled disk stops the job.
MAIN_WORK_TIMEOUT = datetime.timedelta(hours=24)
# How long a process waits for the job's others to join (`_join`): to start, read their configuration and
# reach `setup`. torchrun starts a machine's processes once every machine's launcher has met the others, so
# this is their start-up: seconds, a minute or two for a cold import of torch from a network filesystem. A
# process that failed before joining (a missing --config on another machine) or a WORLD_SIZE left in the
# environment never comes, and the wait was GROUP_TIMEOUT's, silent, then a 40-line DistStoreError.
JOIN_TIMEOUT = datetime.timedelta(minutes=5)
JOIN_NOTICE_S = 20.0  # seconds of waiting to join before a machine's first process says so
# This process' joins so far: a second train() in it (the README's train(config), then train(config,
# resume=True)) counted on the first one's keys, found 3 of 2 processes joined and was refused as a
# finished attempt's. Every process of a job calls train() as often: the n-th joins meet under keys of
# their own.
_JOINS = itertools.count()


@dataclass(frozen=True)
class Dist:
    rank: int  # this process among all (0 writes checkpoints, logs and metrics)
    world_size: int  # processes in the job
    local_rank: int  # this process on its machine (picks the GPU)
    device: torch.device  # where this process computes
    host_group: Any = None  # gloo group for host values when the default group is NCCL (None: the default)
    main_group: Any = None  # gloo group in which the others wait for process 0's data preparation
    joined: bool = False  # setup made the default group (teardown ends it), not the caller (it stays theirs)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup(device: str = "auto", written: str | None = None) -> Dist:
    """Join the torchrun job if there is one (or use the caller's own default group, already made);
    choose this process' device (train.device, `written` there: "run.toml:4", named if it is refused)."""
    world_size, rank, local_rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if world_size > 1 and not dist.is_initialized() and not os.environ.get("MASTER_ADDR"):
        # a WORLD_SIZE left in the environment: torch's ValueError traceback about env://
        raise ConfigError(f"WORLD_SIZE={world_size} is set, but MASTER_ADDR is not: start many processes "
                          "with torchrun, or unset WORLD_SIZE for one")
    if world_size < 1:
        raise ConfigError(f"environment variable WORLD_SIZE={world_size} is below 1 (torchrun sets it)")
    size = f"WORLD_SIZE={world_size}" if os.environ.get("WORLD_SIZE", "").strip() else "WORLD_SIZE is not"
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank)):
        if not 0 <= value < world_size:  # a RANK left in the environment made a process 1 in a job of one,
            # which left every write to a process 0 that did not exist (exit 2, or a TypeError, no line)
            fix = (f"it must be from 0 to {world_size - 1} (torchrun sets both)" if world_size > 1 else
                   f"start many processes with torchrun, or unset {name} for one")
            raise ConfigError(f"{name}={value} is set, but {size}: {fix}")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        _check_gpu(device, local_rank, written)
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    host_group = main_group = None
    joined = world_size > 1 and not dist.is_initialized()
    if joined:
        _join("nccl" if use_cuda else "gloo", rank, world_size, local_rank)
    if world_size > 1:  # our groups in the caller's group too: its host values on NCCL failed, and the others
        # waited for process 0's data preparation its timeout alone. Every process calls new_group, as it must
        if dist.get_backend() != "gloo":
            host_group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
        main_group = dist.new_group(backend="gloo", timeout=MAIN_WORK_TIMEOUT)
    return Dist(rank, world_size, local_rank, dev, host_group, main_group, joined)


def _join(backend: str, rank: int, world_size: int, local_rank: int) -> None:
    """init_process_group once every process of the job has come, counted on the job's store: a wait is
    said after JOIN_NOTICE_S, and given up after JOIN_TIMEOUT in one line naming what it waited for."""
    start = time.monotonic()
    store, address = _store(rank, world_size, local_rank, start + JOIN_TIMEOUT.total_seconds())
    # torchrun's launcher keeps its store, at the same port, across restarts (--max-restarts): each attempt
    # counts and meets under keys of its own. The groups' gloo read a dead attempt's addresses there
    # ("connectFullMesh failed ... Connection refused", or a hang in connecting) 1 restart in 2
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"aiayn/attempt/{attempt}/{next(_JOINS)}", store)
    key = "joined"
    joined, said = store.add(key, 1), False
    if joined > world_size:  # these keys are a finished attempt's: the others count under another prefix
        # (a machine whose processes torchrun restarted as a membership change, without counting), and its
        # dead processes' gloo addresses are here to be read (a hang, or "connectFullMesh failed")
        lost = SameOnEveryProcess if local_rank else UserError
        raise lost(f"process {rank}: this machine's restart count (TORCHELASTIC_RESTART_COUNT={attempt}) "
                   f"does not match the job's: the {world_size} processes of its attempt {attempt} joined "
                   "before; restarts across machines need the same count (torchrun's restarts on one "
                   "machine are handled): start the job again on every machine")
    while joined < world_size:
        waited = time.monotonic() - start
        if waited >= JOIN_TIMEOUT.total_seconds():
            lost = SameOnEveryProcess if local_rank else UserError  # said once a machine, as peer_lost's
            raise lost(f"process {rank}: {joined} of the job's {world_size} processes joined at {address} "
                       f"within {_duration(JOIN_TIMEOUT.total_seconds())}; the others did not start, or "
                       f"failed before joining (each machine's torchrun log says why){_outside_torchrun()}")
        if waited >= JOIN_NOTICE_S and not said and not local_rank:
            log.warning("waiting for the job's other processes at %s: %d of %d joined (waiting up to %s)",
                        address, joined, world_size, _duration(JOIN_TIMEOUT.total_seconds()))
            said = True
        time.sleep(0.1)
        joined = store.add(key, 0)
    store.set_timeout(GROUP_TIMEOUT)  # for the groups' own exchanges over it, as init_process_group sets it
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)


def _store(rank: int, world_size: int, local_rank: int, deadline: float) -> tuple[Any, str]:
    """The job's store and its address: torchrun's launcher serves one, else process 0 does, as torch's
    env:// rendezvous makes them, but without its server's wait in C++ for the others (`_join` waits).
    A client gives up at `deadline` (time.monotonic()'s)."""
    host, port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0)
    if not 0 < port < 65536:  # torch's ValueError traceback
        given = os.environ.get("MASTER_PORT", "").strip()
        wrong = f"MASTER_PORT={port} is no port" if given else "MASTER_PORT is not"
        raise ConfigError(f"MASTER_ADDR is set, but {wrong}: start many processes with torchrun, or unset "
                          "WORLD_SIZE for one")
    address = f"{host}:{port}"
    serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if not serve and (why := _wait_to_listen(host, port, deadline, notice=not local_rank)):
        raise UserError(f"process {rank}: cannot reach the job's store at {address} within "
                        f"{_duration(JOIN_TIMEOUT.total_seconds())} ({why}){_outside_torchrun()}")
    try:
        return dist.TCPStore(host, port, world_size, serve, timeout=JOIN_TIMEOUT, wait_for_workers=False,
                             multi_tenant=True), address
    except dist.DistError as e:  # a port in use; something else listening there
        line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
        role = "serve" if serve else "reach"
        raise UserError(f"process {rank}: cannot {role} the job's store at {address} ({line})"
                        f"{_outside_torchrun()}") from None


def _wait_to_listen(host: str, port: int, deadline: float, notice: bool) -> str | None:
    """Wait until something listens at host:port (the job's process 0, started by hand, later), saying so
    after JOIN_NOTICE_S where `notice`: None, or at `deadline` why not. TCPStore's client waited for it
    twice its timeout (a second try after the first timed out: 10.5 minutes, not 5), and logged each
    try with some 15 lines of C++ stack frames, which only TORCH_CPP_LOG_LEVEL set before torch's import
    silences."""
    start, said = time.monotonic(), False
    while True:
        left = deadline - time.monotonic()
        try:  # tries of at most 5 s: a host whose firewall drops the connection answers nothing at all
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, left))):
                return None
        except OSError as e:  # refused (nothing listens yet), a name not resolved yet, timed out
            why = e.strerror or str(e) or type(e).__name__
        now = time.monotonic()
        if now >= deadline:
            return why
        if notice and not said and now - start >= JOIN_NOTICE_S:
            log.warning("waiting for the job's process 0 at %s:%d", host, port)
            said = True
        time.sleep(min(0.5, deadline - now))


def _outside_torchrun() -> str:
    """A hint where no torchrun started this process: its WORLD_SIZE may be left in the environment."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return ""
    return "; torchrun did not start this process: to train in one, unset WORLD_SIZE, RANK and MASTER_ADDR"


def _duration(seconds: float) -> str:
    """`seconds` as a message says them: "8 s", "30 minutes", "24 hours"."""
    if seconds >= 7200:
        return f"{seconds / 3600:g} hours"
    return f"{seconds:g} s" if seconds < 60 else f"{seconds / 60:g} minutes"


def _env_int(name: str, default: int) -> int:
    """torchrun's variable `name` as a number, or one line naming it (an int() traceback before)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not a whole number (torchrun sets "
                          "it)") from None


def _check_gpu(device: str, local_rank: int, written: str | None = None) -> None:
    """One line instead of torch's AttributeError (no CUDA build) or invalid-ordinal error."""
    if not torch.cuda.is_available():
        raise ConfigError(f"{written + ': ' if written else ''}train.device={device!r}, but PyTorch sees no "
                          "CUDA GPU; use 'auto' or 'cpu'")
    if local_rank >= torch.cuda.device_count():  # not on process 0, which the CLI leaves a ConfigError to:
        # a UserError, said by each process it stops (nothing at all was said)
        raise UserError(
            f"LOCAL_RANK={local_rank}, but this machine has {torch.cuda.device_count()} GPU(s); "
            "start at most that many processes per machine"
        )


def teardown(d: Dist) -> None:
    """Leave the job (the groups setup made: a caller's own default group stays), then let gloo's worker
    threads take the GIL once more before the interpreter exits.

    A gloo worker frees a finished collective's tensors after the caller's wait() has returned, and
    freeing a tensor that Python has already dropped needs the GIL. A process whose last Python steps
    after its last collective took less than the GIL's 5 ms switch interval reached interpreter
    finalization first; the waiting thread was then exited from inside a C++ destructor, and the process
    aborted ("terminate called without an active exception") after training had finished: about 1 run in
    20 of the two-process test (a core dump showed it; pytorch/pytorch#190489). DDP keeps the process
    group alive in C++, so destroying it does not stop those threads; sleeping releases the GIL to them.
    """
    if not (d.enabled and dist.is_initialized()):
        return
    if d.joined:
        dist.destroy_process_group()
    else:  # the caller's group, which it goes on using (its barrier failed): only the groups setup made go
        for group in (d.host_group, d.main_group):
            if group is not None:
                dist.destroy_process_group(group)
    time.sleep(0.05)


# What a collective raises when another process of the job is gone (killed, or exited on an error of its
# own): gloo's "Read error ...: Connection reset by peer" and its kin, NCCL's aborted communicator.
_PEER_GONE = re.compile(
    r"Connection (reset|closed) by peer|Broken pipe|gloo/transport|NCCL communicator was aborted"
)
# gloo's "Timed out waiting 1800000ms for recv ...", NCCL's watchdog's "Watchdog caught collective operation
# timeout: WorkNCCL(..., Timeout(ms)=1800000) ran for 1800083 milliseconds before timing out"
_TIMED_OUT = re.compile(r"Timed out waiting (\d+)ms|operation timeout: .*?Timeout\(ms\)=(\d+)")
# gloo's source location ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "), and
# what follows its first sentence ("This is typically caused by a remote worker crashing. ... GLHF!"):
# the line repeated 330 characters of them
_SOURCE = re.compile(r"^\[[^\]\s]+:\d+\]\s*")
_SENTENCE_END = re.compile(r"\.(?:\s|$)")


def peer_lost(e: BaseException, d: Dist, resume: Callable[[], str]) -> UserError | None:
    """A one-line error for a collective that failed because another process stopped, or None: rank 0
    printed gloo's 36-line traceback when a peer was killed, before torchrun stopped it. A stop is said
    once a machine (a `SameOnEveryProcess` on its later processes); a timeout, by every process. `resume()`
    ends it: what --resume would do now ("--resume continues from step_000006"), a listing of the run's
    checkpoints made only for such an error."""
    if not (d.enabled and isinstance(e, RuntimeError) and _PEER_GONE.search(str(e))):
        return None
    line = next((x.strip() for x in str(e).splitlines() if x.strip()), type(e).__name__)
    if located := _SOURCE.match(line):  # gloo's: its first sentence (NCCL's second says why it aborted)
        line = _SENTENCE_END.split(line[located.end() :], maxsplit=1)[0] or line
    if waited := _TIMED_OUT.search(str(e)):  # gloo's timeout runs through gloo/transport too: nobody stopped
        within = _duration(int(waited[1] or waited[2]) / 1000)
        return UserError(f"process {d.rank}: the other processes did not answer within {within} ({line}); "
                         f"one of them is stuck or far slower, and {resume()}")
    # Said by each machine's first process alone: the others' lines repeated it, and followed a process 0's
    # own one-line error (metrics.jsonl on a full disk) with a misleading second, gloo's "closed by peer"
    lost = SameOnEveryProcess if d.local_rank else UserError
    return lost(f"process {d.rank}: another process of this job stopped ({line}); its own error or "
                f"torchrun's log says why, and {resume()}")


class SameOnEveryProcess(UserError):
    """A refusal that every process of a machine reaches from the same inputs (a resumed run's settings
    against its checkpoint, the machine's config file): the command line prints it on each machine's first
    process (LOCAL_RANK 0) alone, one line a machine, since each machine's torchrun shows its own processes'
    output. Also a lost process as a machine's later processes find it (`peer_lost`)."""


class FailedOnMain(UserError):
    """Process 0's failure in `on_main`, raised on the other processes; process 0 reports it itself, and
    the command line prints it on each other machine's first process alone (see `SameOnEveryProcess`)."""


def on_main(d: Dist, work: Callable[[], T], long: bool = False) -> T:
    """Run `work` on process 0 while the others wait, and give every process its result (plain data:
    it is pickled across); if it fails, every process fails with its message. `long`: the others wait up
    to MAIN_WORK_TIMEOUT (data preparation, validation BLEU), else GROUP_TIMEOUT.

    A bare barrier left the others waiting for a process that had exited with a one-line error: gloo
    then failed them with "Connection reset by peer", some 70 lines of traceback around that line.
    """
    outcome: list = [None, None]  # [failure message, result]
    group = (d.main_group if long else d.host_group) if d.enabled else None
    if d.is_main:
        try:
            outcome[1] = work()
        except Exception as e:
            outcome[0] = str(e) or type(e).__name__
            if d.enabled:
                dist.broadcast_object_list(outcome, src=0, group=group)
            raise
    if d.enabled:
        dist.broadcast_object_list(outcome, src=0, group=group)  # 0 sends, the others receive
    if outcome[0] is not None:
        raise FailedOnMain(f"process 0 failed: {outcome[0]}")
    return outcome[1]


def on_every(d: Dist, work: Callable[[], T]) -> T:
    """Run `work` on every process (reading the same files: a resumed checkpoint); if it fails anywhere,
    every process fails, and the command line prints the error once a machine: process 0's, or that of the
    first process that failed alone, named. A damaged checkpoint was one line per process, 16 on two
    machines of eight GPUs."""
    failure, error = None, None
    try:
        result = work()
    except Exception as e:  # any: a process that skipped the gather left the others waiting in it
        failure, error = str(e) or type(e).__name__, e
    failures = [failure]
    if d.enabled:
        failures = [None] * d.world_size
        dist.all_gather_object(failures, failure, group=d.host_group)
    if failures[0] is not None:  # process 0 prints its own; the others, where theirs is the same, not
        if d.is_main or failure != failures[0]:  # (another machine, where it did not fail, names process 0)
            raise error if error is not None else SameOnEveryProcess(f"process 0: {failures[0]}")
        raise SameOnEveryProcess(failure)
    if (rank := next((r for r, f in enumerate(failures) if f is not None), None)) is not None:
        if d.is_main:
            raise UserError(f"process {rank}: {failures[rank]}")
        raise SameOnEveryProcess(f"process {rank}: {failures[rank]}")  # named, on every machine that says it
    return result


def check_same(d: Dist, settings: dict[str, str], fix: str) -> None:
    """Refuse, on every process, a job whose processes hold other `settings` (name -> value as a message
    shows it): one line naming each that differs, with process 0's value and the first other, by process
    and, where the job spans machines, by machine; `fix` ends it. Every process gathers the same, so the
    command line says it once a machine."""
    if not d.enabled:
        return
    gathered: list = [None] * d.world_size
    dist.all_gather_object(gathered, (settings, socket.gethostname()), group=d.host_group)
    several = len({host for _, host in gathered}) > 1
    differ = []
    for name in dict.fromkeys(name for held, _ in gathered for name in held):  # each once, in order
        values = [held.get(name, "unset") for held, _ in gathered]
        others = [rank for rank, value in enumerate(values) if value != values[0]]
        if others:
            rank, more = others[0], len(others) - 1
            where = f"process {rank}{f' on {gathered[rank][1]}' if several else ''}"
            differ.append(f"{name}={values[0]} in process 0, {values[rank]} in {where}"
                          + (f" (and {more} more)" if more else ""))
    if differ:
        said = SameOnEveryProcess if d.rank else UserError
        raise said(f"the job's processes were given different settings: {'; '.join(differ)}; {fix}")


def all_reduce_sum(values: list[float], d: Dist) -> list[float]:
    """Sum a few numbers over all processes (loss sums, token counts, a stop flag), on the host: through
    `d.host_group` (gloo), never waiting for a GPU's queue."""
    if not d.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)  # on the CPU
    dist.all_reduce(t, group=d.host_group)
    return t.tolist()

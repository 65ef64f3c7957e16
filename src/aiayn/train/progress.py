"""How a run's progress reaches a person: log lines through the caller's logging, above the progress bar.

The bar (a terminal only) shows tokens/s, loss, perplexity, learning rate and time left; the log lines
(updates, validations, saves) go through the `aiayn` logger, so that a program's own logging set-up
decides where they go. Neither may change that set-up for good, or behind the caller's back.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator

from tqdm import tqdm


class LineFormatter(logging.Formatter):
    """Training's log lines (the command line's, `aiayn.cli._log_to_stderr`, and a script's): the time,
    `tag` (a process under torchrun), then the message; a warning says it is one ("warning: "), where it
    looked like any progress line (a corpus mostly dropped as too long, a validation file that is the
    training one)."""

    def __init__(self, tag: str = ""):
        super().__init__(f"%(asctime)s {tag}%(message)s", datefmt="%H:%M:%S")
        self.warning = logging.Formatter(f"%(asctime)s {tag}warning: %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        return self.warning.format(record) if record.levelno >= logging.WARNING else super().format(record)


_shown_lock = threading.Lock()
_shown: list[tuple[logging.Handler, int]] = []  # the handler added and the level before, while held
_holders = 0  # blocks that hold it: two train() calls in two threads share one, the last removes it


@contextlib.contextmanager
def shown_if_unconfigured(main: bool) -> Iterator[None]:
    """With no logging set up for `aiayn` (a plain script or a notebook calling `train()`), its lines on
    stderr for the block, as the command line shows them; the run was silent until it returned (the bar
    needs a terminal, and Python drops INFO lines by default). Under torchrun, process 0 speaks. A level
    the caller set on the `aiayn` logger (`setLevel(logging.INFO)` with no handler) is kept; propagation
    turned off is a set-up, left as it is."""
    global _holders
    logger = logging.getLogger("aiayn")
    with _shown_lock:
        # the caller's set-up (the CLI's, a notebook's basicConfig), or propagation turned off to quiet it
        if (logger.hasHandlers() or not logger.propagate) and not _shown:
            hold = False
        else:
            hold = True
            _holders += 1
            if not _shown:
                handler = logging.StreamHandler(sys.stderr)
                handler.setFormatter(LineFormatter())
                handler.setLevel(logging.NOTSET if main else logging.WARNING)  # whatever the logger's level
                logger.addHandler(handler)
                _shown.append((handler, logger.level))
                if logger.level == logging.NOTSET:
                    logger.setLevel(logging.INFO if main else logging.WARNING)
    try:
        yield
    finally:
        if hold:
            with _shown_lock:
                _holders -= 1
                if _holders == 0:
                    handler, level = _shown.pop()
                    logger.removeHandler(handler)
                    logger.setLevel(level)


class _AboveBars:
    """A stream whose writes go through `tqdm.write`, which lifts the bars off the terminal first; the
    rest (isatty, encoding) is the stream's."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        tqdm.write(text, file=self.stream, end="")

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def lines_above(bar: tqdm) -> Iterator[None]:
    """Log lines written above the bar, not glued onto it: the console handlers of the `aiayn` logger and
    its ancestors write through `tqdm.write` for the block, and are otherwise left as they are. tqdm's
    `logging_redirect_tqdm` swapped them for handlers of its own with the formatter but not the level (a
    console set to WARNING showed every INFO line) and added one where the caller had none."""
    if bar.disable:
        yield
        return
    swapped = []
    logger: logging.Logger | None = logging.getLogger("aiayn")
    while logger is not None:
        for handler in logger.handlers:  # a subclass too (colorlog's); a FileHandler's stream is no console
            if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.stdout):
                above = _AboveBars(handler.stream)
                swapped.append((handler, handler.setStream(above), above))
        logger = logger.parent if logger.propagate else None
    try:
        yield
    finally:
        for handler, stream, above in swapped:
            if handler.stream is above:  # else the caller gave it another stream meanwhile: theirs
                handler.setStream(stream)


def throttled_progress(total: int, every: float, say: Callable[[int, float, float], None]
                       ) -> Callable[[int], None]:
    """A `progress(n)` that counts n more of `total` things done and, at most every `every` s, calls
    `say(done, percent, per_second)`: the progress lines of a long encode or translation where stderr is
    no terminal for a bar (none for a quick one: the first comes `every` s after this call)."""
    start = last = time.monotonic()
    done = 0

    def progress(n: int) -> None:
        nonlocal done, last
        done, now = done + n, time.monotonic()
        if now - last >= every:
            say(done, 100 * done / total, done / max(now - start, 1e-9))
            last = now

    return progress

"""Errors that the user can fix; the CLI prints them as one line and exits non-zero."""

from __future__ import annotations

import os
from collections.abc import Iterable


class Stopped(Exception):
    """A run that stopped on a signal after saving what it had; the CLI prints the message and exits
    with the shell's status for that signal (128 + its number)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_status = 128 + signum


class UserError(Exception):
    """Bad input: a message naming the file, the line and the problem, e.g. `train.de:12: invalid UTF-8`."""


class CorruptFile(UserError):
    """A file that is there but cannot be read as what it should be: truncated, garbage, half a write
    from a failing disk (the project's own writes are atomic, so a kill never makes one)."""


class SettingError(UserError):
    """A value a library function's setting cannot take, said `NAME=VALUE` and the problem
    (`confidence=1: give ...`); a command says it as the flag the user typed (`as_flag`)."""

    def __init__(self, name: str, value: object, problem: str):
        self.name, self.value, self.problem = name, value, problem  # problem: ": give ...", " is not ..."
        super().__init__(f"{name}={value!r}{problem}")

    def as_flag(self) -> str:
        """The message with `--NAME VALUE` (quoted as a shell would need it) for `NAME=VALUE`."""
        import shlex

        return f"--{self.name.replace('_', '-')} {shlex.quote(str(self.value))}{self.problem}"


class TextError(UserError):
    """A problem with one text of a list: `index` counts texts from 0, and the message names it as
    `where` (default "text N"), or as FILE:LINE once a stream has `located` it. `others`: the indices of
    the list's further texts with the problem, the first few named after it ("; and 3 more: texts 12, 40,
    77"), so that k bad lines take one run to find, not k."""

    SHOWN = 5  # the others named by number; the rest counted

    def __init__(self, index: int, problem: str, where: str | None = None, others: Iterable[int] = ()):
        self.index, self.problem, self.others = index, problem, list(others)
        self.name: str | None = None  # the stream's, once `located`
        self.read: int | None = None  # a stream's lines read, where the others are of those alone
        super().__init__(f"{where or f'text {index + 1}'}: {problem}{self._others_said('text')}")

    def located(self, name: str, first: int, read: int | None = None) -> TextError:
        """This error, named by line of the stream `name` whose batch began at line `first` (from 0); `read`:
        the lines read of a stream read no further, whose others are then said as of those."""
        self.index += first
        self.others = [i + first for i in self.others]
        self.name, self.read = name, read
        return self._relabelled()

    def with_others(self, others: Iterable[int]) -> TextError:
        """This `located` error with more `others` (lines, from 0): those of a file's later chunks."""
        self.others += others
        return self._relabelled()

    def _relabelled(self) -> TextError:
        self.args = (f"{self.name}:{self.index + 1}: {self.problem}{self._others_said('line')}",)
        return self

    def _others_said(self, kind: str) -> str:
        if not self.others:
            return ""
        named = ", ".join(str(i + 1) for i in self.others[: self.SHOWN])
        among = "" if self.read is None else f" in the {self.read:,} {kind}s read"
        kinds = kind if len(self.others) == 1 else f"{kind}s"
        rest = ", ..." if len(self.others) > self.SHOWN else ""
        return f"; and {len(self.others)} more{among}: {kinds} {named}{rest}"


class SentenceTooLong(TextError):
    """A sentence with more tokens than the model has positions."""

    def __init__(self, index: int, tokens: int, limit: int, where: str | None = None,
                 model: str = "this model", side: str = "source", others: Iterable[int] = ()):
        self.tokens, self.limit, self.side = tokens, limit, side  # side: which text of a pair (scoring)
        # a translation cut at the model's positions fills them: the EOS scoring appends is the one too many
        eos = "EOS" if side == "source" else "the EOS scoring appends, which needs a position too"
        super().__init__(index, f"{tokens} tokens (with {eos}), more than the {limit} positions of {model}",
                         where, others)


class OutOfMemory(TextError):
    """Decoding a batch ran out of memory; `index` is its first text in input order."""

    def __init__(self, index: int, sentences: int, beam: int, where: str | None = None, samples: int = 0,
                 scoring: bool = False):
        self.sentences, self.beam = sentences, beam
        # a batch of one sentence is as few tokens as a batch can hold: --max-tokens cannot help it
        tokens = " or fewer tokens per batch (--max-tokens)" if sentences > 1 else ""
        if scoring:  # forced decoding has no beam
            alone = "the pair alone needs more memory"
            advice = "use fewer tokens per batch (--max-tokens)" if tokens else alone
            super().__init__(index, f"out of memory scoring a batch of {sentences} pair(s); {advice}", where)
            return
        rows = f"{samples} samples each (--n-best)" if samples else f"beam {beam}"  # sampling's rows: n_best
        fewer = [("fewer samples" if samples else "a smaller beam")] if max(samples, beam) > 1 else []
        fewer += [tokens.removeprefix(" or ")] if tokens else []
        advice = f"use {' or '.join(fewer)}" if fewer else "the sentence alone needs more memory"
        super().__init__(index, f"out of memory decoding a batch of {sentences} sentence(s) at {rows}; "
                                f"{advice}", where)


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation that failed: CUDA's OutOfMemoryError, the CPU allocator's RuntimeError, C++'s
    std::bad_alloc as torch passes it on (a CPU kernel's own buffers: beam search's topk under `ulimit -v`
    was a traceback), or Python's MemoryError."""
    import torch

    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(
        words in str(error) for words in ("can't allocate memory", "std::bad_alloc"))


def check_path(value: object, name: str, what: str) -> None:
    """`value` is a path (str, bytes or os.PathLike): None or a dict failed inside pathlib ("expected str,
    bytes or os.PathLike object, not dict"), naming no argument. `what` says what the path names."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise TypeError(f"{name} is {type(value).__name__}: {what}")


def str_list(items: Iterable[str], name: str, plural: str, singular: str) -> list[str]:
    """`items` as a list (a generator is read once), each checked to be a str. A lone str or bytes is
    iterable too, and was taken character by character: refused, naming `name` ("texts") and what it
    holds (`plural` "strings", `singular` "text")."""
    if isinstance(items, (str, bytes)):
        kind = type(items).__name__
        raise TypeError(f"{name} must be a list of {plural}, not one {kind}: pass [{singular}]")
    if not isinstance(items, Iterable):  # None: "'NoneType' object is not iterable"
        raise TypeError(f"{name} must be a list of {plural}, not {type(items).__name__}")
    items = list(items)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise TypeError(f"{name}[{i}] is {type(item).__name__}, not str")
    return items


def check_unicode(text: str, where: str) -> None:
    """A str that UTF-8 cannot encode (a lone surrogate, e.g. from `surrogateescape`d command-line bytes)
    is a UserError naming `where`; SentencePiece would fail on it with an unreadable binding error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{where}: not valid Unicode (a lone surrogate, {text[e.start]!r}, at character "
                        f"{e.start + 1}; undecodable bytes?)") from None


def non_utf8_name(name: str) -> str | None:
    """`name` as a message shows it if UTF-8 cannot hold it, else None: its bytes as the command line gave
    them (`surrogateescape`: \\xff), or a lone surrogate that no byte is (from Python: \\ud800) as its code
    (encoding it for the message was a UnicodeEncodeError of its own)."""
    try:
        name.encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


# The control characters a TOML basic string ("...") makes of a backslash escape, as a message names them
ESCAPED_CONTROLS = {"\b": "a backspace (\\b)", "\t": "a tab (\\t)", "\n": "a line feed (\\n)",
                    "\f": "a form feed (\\f)", "\r": "a carriage return (\\r)"}


def control_character(name: str) -> str | None:
    """The first control character (C0 or DEL) in `name` as a message names it ("a line feed (\\n)",
    "the control character U+0001"), else None: a path holding one split the log's and the result's lines."""
    found = next((c for c in name if ord(c) < 32 or ord(c) == 127), None)
    if found is None:
        return None
    return ESCAPED_CONTROLS.get(found, f"the control character U+{ord(found):04X}")


class Terminated(BaseException):
    """SIGTERM or SIGHUP (`timeout`, a closed terminal, a job scheduler) outside training's updates (its
    data's preparation included), raised as Ctrl-C raises KeyboardInterrupt: an output being written is
    removed on the way out (`atomic_output`), not left behind as a hidden temporary file. A BaseException,
    as KeyboardInterrupt, so that no `except Exception` takes it for an error. Training handles these
    signals itself during its updates: it saves, then stops (`aiayn.train.loop.StopSignal`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def on_an_errors_way_out(stop: BaseException) -> bool:
    """Whether `stop` (a SIGTERM's or SIGHUP's `Terminated`) came as an error the user can fix was raised (in
    a `finally` or an `__exit__` on its way out: torchrun SIGTERMs a job's other processes once one stops),
    so that the error, not the signal, is what to say. Not a stop Python dropped and
    `files.raise_dropped_stop` raised later (`from None`), wherever that was."""
    from aiayn.config import ConfigError  # torch-free, as this module

    return isinstance(stop.__context__, (UserError, ConfigError)) and not stop.__suppress_context__

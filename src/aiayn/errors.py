"""Errors that the user can fix; the CLI prints them as one line and exits non-zero."""


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


class SentenceTooLong(UserError):
    """A sentence with more tokens than the model has positions; `index` counts texts from 0."""

    def __init__(self, index: int, tokens: int, limit: int, where: str | None = None):
        self.index, self.tokens, self.limit = index, tokens, limit
        where = where or f"text {index + 1}"
        super().__init__(f"{where}: {tokens} tokens (with EOS), more than the {limit} positions of this model")


class OutOfMemory(UserError):
    """Decoding a batch ran out of memory; `index` is its first text in input order, counted from 0."""

    def __init__(self, index: int, sentences: int, beam: int, where: str | None = None):
        self.index, self.sentences, self.beam = index, sentences, beam
        where = where or f"text {index + 1}"
        super().__init__(f"{where}: out of memory decoding a batch of {sentences} sentence(s) at beam {beam}; "
                         "use a smaller beam or fewer tokens per batch (--max-tokens)")


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation that failed: CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError."""
    import torch

    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


def check_unicode(text: str, where: str) -> None:
    """A str that UTF-8 cannot encode (a lone surrogate, e.g. from `surrogateescape`d command-line bytes)
    is a UserError naming `where`; SentencePiece would fail on it with an unreadable binding error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{where}: not valid Unicode (a lone surrogate, {text[e.start]!r}, at character "
                        f"{e.start + 1}; undecodable bytes?)") from None

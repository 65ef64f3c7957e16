"""Errors that the user can fix; the CLI prints them as one line and exits non-zero."""


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

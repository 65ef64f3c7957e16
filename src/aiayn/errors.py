"""Errors that the user can fix; the CLI prints them as one line and exits non-zero."""


class UserError(Exception):
    """Bad input: a message naming the file, the line and the problem, e.g. `train.de:12: invalid UTF-8`."""

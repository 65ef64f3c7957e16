"""SentencePiece's training in a process of its own, which `aiayn.data.tokenizer.sentencepiece_model` starts
(`python -I spm_child.py`) and kills when interrupted: SentencePieceTrainer.train is C++ that returns to
Python only once done, so in the caller's process a Ctrl-C, even a second one, waited for the end of it
(seconds on Multi30k, minutes on WMT).

stdin, pickles: (the parent's sys.path, its pid, SentencePieceTrainer.train's options), then lists of
lines, then None. stdout, one pickle: ("model", the model file's bytes) or ("refused", the message of
SentencePiece's RuntimeError). Only SentencePiece is imported, neither aiayn nor torch: the process starts
in a twentieth of a second.
"""

import io
import os
import pickle
import signal
import sys


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    path, parent, options = _read(stdin)
    _die_with(parent)
    sys.path[:] = path  # the SentencePiece the parent imported, wherever it found it
    import sentencepiece as spm

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=_lines(stdin), model_writer=model, **options)
    except RuntimeError as e:  # a vocabulary it cannot build: the parent says which setting to change
        reply = ("refused", str(e))
    else:
        reply = ("model", model.getvalue())
    pickle.dump(reply, stdout)
    stdout.flush()


def _lines(stdin: io.BufferedReader):
    while (chunk := _read(stdin)) is not None:
        yield from chunk


def _read(stdin: io.BufferedReader):
    """The next pickle; an end without the final None is a parent that stopped sending (killed, or what it
    read from raised): nothing is trained on part of the text, and there is no one to reply to."""
    try:
        return pickle.load(stdin)
    except (EOFError, pickle.UnpicklingError):
        os._exit(1)  # from inside SentencePiece's reading too, which would wrap an exception and train on


def _die_with(parent: int) -> None:
    """Be killed with the parent (Linux: PR_SET_PDEATHSIG): a parent that SIGTERM or SIGKILL ended waits
    for no model, which could take minutes of two cores to make. Elsewhere the training runs to its end,
    then finds no reader."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that: no signal will come
        os._exit(1)


if __name__ == "__main__":
    main()

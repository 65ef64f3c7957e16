import os
import signal
from pathlib import Path

import pytest
import torch

from aiayn import files
from aiayn.config import ModelConfig, model_config
from aiayn.model import Transformer


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_dropped_stop_left():
    """A stop recorded as Python dropped it (`aiayn.files.record_dropped_stop`) that a failing test left
    behind was raised at the next atomic write of another test: a KeyboardInterrupt that ended the session."""
    yield
    files.forget_dropped_stops()


def record_disk_events(monkeypatch) -> list[tuple]:
    """From now on in the test, every os.fsync as ("fsync", path) and every os.rename / os.replace as
    ("rename" / "replace", src, dst), in the order they happen: what tests of "on disk before its name"
    read."""
    events: list[tuple] = []
    fsync, rename, replace = os.fsync, os.rename, os.replace

    def noted_fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    def noted(kind, move):
        def call(src, dst):
            events.append((kind, Path(src), Path(dst)))
            move(src, dst)
        return call

    monkeypatch.setattr(os, "fsync", noted_fsync)
    monkeypatch.setattr(os, "rename", noted("rename", rename))
    monkeypatch.setattr(os, "replace", noted("replace", replace))
    return events


def record_checkpointed_layers(monkeypatch) -> list:
    """From now on in the test, every layer the model runs through torch.utils.checkpoint
    (`Transformer.checkpoint_activations`), in the order it runs them: whether recomputing was on."""
    from aiayn.model import transformer

    layers: list = []
    run = torch.utils.checkpoint.checkpoint

    def noted(layer, *args, **kwargs):
        layers.append(layer)
        return run(layer, *args, **kwargs)

    monkeypatch.setattr(transformer, "checkpoint", noted)
    return layers


@pytest.fixture
def one_thread():
    """Tiny matmuls on a shared 2-core machine are 10x faster on one thread than fighting for two.
    For a whole module: `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def ctrl_c_handled():
    """Python's SIGINT handler (KeyboardInterrupt), for tests of a Ctrl-C: pytest started as a script's
    background job (`pytest ... &`) inherits SIGINT ignored, and the signal those tests send never came."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def hangup_caught():
    """SIGHUP raising an AssertionError where the code under test does not handle it, for tests of a closed
    terminal: its default action killed the whole test session, and pytest started by `nohup` inherits it
    ignored (which training keeps), so the signal those tests send never came."""

    def unhandled(signum, frame):
        raise AssertionError("SIGHUP reached no handler of the code under test")

    if not hasattr(signal, "SIGHUP"):  # Windows: no closed terminal's signal to catch
        yield None
        return
    before = signal.signal(signal.SIGHUP, unhandled)
    yield unhandled
    signal.signal(signal.SIGHUP, before)


def tiny_model(**overrides) -> Transformer:
    """A 2+2-layer model, small enough for exhaustive checks; dropout off unless asked for."""
    config = model_config("tiny", **{"vocab_size": 50, "d_model": 32, "d_ff": 64, "dropout": 0.0, **overrides})
    return Transformer(config).eval()


def numbers_checkpoint(directory: Path, **overrides) -> Path:
    """A random `tiny_model` saved with a 60-piece SentencePiece model of "the number N is even und die
    Zahl N" sentences, in `directory`/ck: for tests of translating and scoring text."""
    from aiayn.checkpoint import save_checkpoint
    from aiayn.data.tokenizer import Tokenizer, train_sentencepiece

    lines = [f"the number {i} is {'even' if i % 2 == 0 else 'odd'} und die Zahl {i}" for i in range(300)]
    tokenizer = Tokenizer(train_sentencepiece(lines, directory / "spm", vocab_size=60))
    torch.manual_seed(0)
    model = tiny_model(vocab_size=tokenizer.src_vocab_size, **overrides)
    return save_checkpoint(directory / "ck", model, tokenizer)


def padded_batch(lengths: list[int], vocab: int, pad_id: int = 0, generator=None) -> torch.Tensor:
    """Right-padded random token ids (B, max(lengths)), real ids in [3, vocab), each row ending with EOS
    (2), as the searches take sources."""
    out = torch.full((len(lengths), max(lengths)), pad_id, dtype=torch.long)
    for i, n in enumerate(lengths):
        out[i, :n] = torch.randint(3, vocab, (n,), generator=generator)
        if n:  # a length of 0: a row of padding alone (column -1 was written)
            out[i, n - 1] = ModelConfig.eos_id
    return out


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1] in "0123456789abcdef" and "-" in line.split()[0]:  # a mapping's first line
            start, end = (int(a, 16) for a in line.split()[0].split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")

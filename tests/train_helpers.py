"""Tiny parallel corpora and configs for the training tests."""

from dataclasses import replace
from pathlib import Path

import pytest

from aiayn.train import distributed
from aiayn.train.config import load_config

DE = ["ein", "Hund", "läuft", "über", "die", "Wiese", "zwei", "Katzen", "schlafen", "im", "Haus"]
EN = ["a", "dog", "runs", "across", "the", "meadow", "two", "cats", "sleep", "in", "house"]


def write_corpus(directory: Path, n: int = 60, prefix: str = "train") -> tuple[Path, Path]:
    """`n` aligned toy sentence pairs of 1 to 7 words (word-for-word 'translations')."""
    src, tgt = [], []
    for i in range(n):
        words = [(i * 7 + 3 * j) % len(DE) for j in range(1 + i % 7)]
        src.append(" ".join(DE[w] for w in words))
        tgt.append(" ".join(EN[w] for w in words))
    s, t = directory / f"{prefix}.de", directory / f"{prefix}.en"
    s.write_text("\n".join(src) + "\n", encoding="utf-8")
    t.write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return s, t


def tiny_config(data_dir: Path, run_dir: Path, *extra: str):
    """A micro model with dropout (so RNG state matters) and small batches (so epochs are short)."""
    train_src, train_tgt = write_corpus(data_dir)
    valid_src, valid_tgt = write_corpus(data_dir, 12, "valid")
    sets = [
        "model.preset=micro",
        "model.dropout=0.1",
        f"data.train_src={train_src}",
        f"data.train_tgt={train_tgt}",
        f"data.valid_src={valid_src}",
        f"data.valid_tgt={valid_tgt}",
        "data.vocab_size=40",
        "data.max_len=32",
        f"train.run_dir={run_dir}",
        "train.max_tokens=64",
        "train.warmup=4",
        "train.valid_every=4",
        "train.log_every=2",
        "train.keep_last=10",
        "train.threads=1",
        # The CPU, also where a GPU is: these tests hold a run to what the README promises on a CPU (bit for
        # bit resumes, equal 1- and 2-process runs); `auto` would train on the GPU, whose atomics add in
        # any order. tests/test_cuda.py passes train.device=cuda, which comes later and wins.
        "train.device=cpu",
    ]
    return load_config(None, sets + list(extra)), sets + list(extra)


def set_args(sets: list[str]) -> list[str]:
    """`sets` as the command line gives them: "--set", item, "--set", item, ..."""
    return [a for s in sets for a in ("--set", s)]


def in_job(monkeypatch, rank: str, local_rank: str | None = None) -> None:
    """The environment torchrun gives process `rank` of 2 (on one machine, or with `local_rank` "0" the first
    of a second machine), and a `setup` that checks and chooses the device as there but joins no job (it
    would wait for the other process): a gather then finds the other process holding what this one does."""
    alone, local_rank = distributed.setup, rank if local_rank is None else local_rank

    def setup(*args):
        with pytest.MonkeyPatch.context() as m:
            for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):  # raising=False: in_job twice wraps this setup
                m.delenv(name, raising=False)  # in another
            return replace(alone(*args), rank=int(rank), world_size=2, local_rank=int(local_rank))

    def gather_alike(gathered: list, mine: object, group: object = None) -> None:
        gathered[:] = [mine] * len(gathered)

    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank),
                        ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed, "setup", setup)
    monkeypatch.setattr(distributed.dist, "all_gather_object", gather_alike)

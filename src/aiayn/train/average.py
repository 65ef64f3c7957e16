"""Checkpoint averaging (paper section 6.1: the last 5 checkpoints for base, the last 20 for big)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from aiayn.checkpoint import load_checkpoint, load_into, load_weights, read_meta, save_checkpoint
from aiayn.errors import UserError
from aiayn.train.state import checkpoint_dirs

log = logging.getLogger(__name__)


def average_state_dicts(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of several state dicts with the same names and shapes (in float64)."""
    if not states:
        raise ValueError("nothing to average")
    out = {}
    for name, first in states[0].items():
        total = torch.zeros(first.shape, dtype=torch.float64)
        for s in states:
            total += s[name].double()
        out[name] = (total / len(states)).to(first.dtype)
    return out


def average_checkpoints(paths: list[Path], out: str | Path) -> Path:
    """Average the weights of `paths` (checkpoints of one model) into a new checkpoint `out`."""
    if not paths:
        raise UserError("no checkpoints to average")
    models = [read_meta(p)["model"] for p in paths]
    for p, m in zip(paths, models):
        if m != models[-1]:
            raise UserError(f"{p}: a different model from {paths[-1]}; cannot average them")
    last = load_checkpoint(paths[-1])
    states = [load_weights(p) for p in paths]
    if any(set(s) != set(states[-1]) for s in states):
        raise UserError(f"{paths[0]}: weight names differ between checkpoints")
    load_into(last.model, average_state_dicts(states), paths[-1])
    meta = {k: v for k, v in last.meta.items() if k not in ("format", "model", "tokenizer")}
    meta["averaged"] = [str(p) for p in paths]
    log.info("averaged %d checkpoints into %s", len(paths), out)
    return save_checkpoint(out, last.model, last.tokenizer, meta)


def average_last(run_dir: str | Path, k: int, out: str | Path | None = None) -> Path:
    """Average a run's last `k` checkpoints into `run_dir/checkpoints/average_last_k` (or `out`)."""
    found = checkpoint_dirs(run_dir)
    if not found:
        raise UserError(f"{run_dir}: no checkpoints found")
    if len(found) < k:
        log.warning("%s: only %d checkpoints, averaging those", run_dir, len(found))
    out = Path(out) if out is not None else Path(run_dir) / f"average_last_{k}"
    return average_checkpoints(found[-k:], out)

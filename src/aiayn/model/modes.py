"""`evaluating(model)`: a model in eval mode for a while, then back in the mode it was in."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """`model.eval()` inside, `model.train(was)` after, an error included: a validation or an inspection
    in the middle of training must leave dropout on (a model left in eval mode trained on without it)."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)

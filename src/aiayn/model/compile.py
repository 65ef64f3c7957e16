"""`torch.compile` for training, applied at the edge (STYLE.md habit 14).

The model stays an ordinary `nn.Module` whose state dict has no `_orig_mod.` prefixes: compilation wraps
a function that calls it, never the module that is saved.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

LossFn = Callable[[Tensor, Tensor], Tensor]  # (logits (B, T, V), tgt_out (B, T)) -> scalar loss


def compile_for_training(model: nn.Module, loss_fn: LossFn) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """A compiled `(src, tgt_in, tgt_out) -> loss(model(src, tgt_in), tgt_out)` for the training step.

    Forward, output projection and loss are one graph, so inductor fuses the element-wise work
    (dropout, residual adds, LayerNorm, ReLU, the log-softmax of the loss) into a few loops instead of
    one memory pass per operation: on a CPU those passes, not the matmuls, dominate an eager step.
    The first call compiles (a minute or more on a small CPU); shapes are marked static because
    training batches come in few shapes, and a new shape only triggers one more compilation.
    """

    def step_loss(src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        return loss_fn(model(src, tgt_in), tgt_out)

    return torch.compile(step_loss, dynamic=False)

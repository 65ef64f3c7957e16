"""The benchmarks' compiled training step: model and loss as one `torch.compile` graph.

Used by benchmarks/train_step.py and profile_step.py (and tests/test_compile.py), not by `aiayn train`:
`train.compile` runs `torch.compile(model)`, the model alone, and keeps the project's own loss
(`label_smoothed_nll` over the real target positions) outside the graph; so the benchmarks' compiled
rows are not training's step (README, "Results and benchmarks"). Either way compilation is applied at the
edge (STYLE.md habit 14): the model stays an ordinary `nn.Module` whose state dict has no `_orig_mod.`
prefixes, since this wraps a function that calls it, never the module that is saved.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

LossFn = Callable[[Tensor, Tensor], Any]  # (logits (B, T, V), tgt_out (B, T)) -> loss (or a tuple with it)


def compile_for_training(model: nn.Module, loss_fn: LossFn) -> Callable[[Tensor, Tensor, Tensor], Any]:
    """A compiled `(src, tgt_in, tgt_out) -> loss(model(src, tgt_in), tgt_out)`: the benchmarks' training
    step (`aiayn train`'s `train.compile` compiles the model alone; see the module's docstring).

    Forward, output projection and loss are one graph, so inductor fuses the element-wise work
    (dropout, residual adds, LayerNorm, ReLU, the log-softmax of the loss) into a few loops instead of
    one memory pass per operation (a torch.profiler trace of an eager bf16 `small` step on this project's
    CPU: dtype casts and element-wise ops take about 3x the time of the matmuls).
    The first call compiles (one to four minutes for `small` on a busy 2-core CPU: see
    benchmarks/results/train_step_small.md). The first shape is compiled static; when a second shape
    comes (token-bounded batches vary in B, S, T), dynamo recompiles once with dynamic sizes instead of
    once per shape, which would hit its recompile limit and fall back to eager.
    """

    def step_loss(src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        return loss_fn(model(src, tgt_in), tgt_out)

    return torch.compile(step_loss)

"""CPU inference: every Linear through oneDNN with its weight reordered once into oneDNN's blocked layout.

Measured on this project's AMD EPYC machine (one thread, `benchmarks/decode.py`): PyTorch's default CPU
matmul (MKL sgemm) runs the decoder's small-batch products 2-7x slower than oneDNN with a prepacked
weight, which is what CTranslate2 uses on non-Intel CPUs. `pack_for_cpu` swaps each `nn.Linear` for a
`PackedLinear` in a copy of the model: the same function, the weights reordered, nothing saved.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)


# A product with one row (greedy search of a single sentence) streams the weight once: for a weight up
# to this many elements MKL's matrix-vector kernel beats oneDNN's per-call overhead here, while oneDNN
# stays faster on the vocabulary projection (benchmarks/results/decode_cpu_idle_v4.md).
ONE_ROW_MKL_MAX_WEIGHT = 1 << 21


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """y = x W^T + b (an `nn.Linear`) through oneDNN's `_linear_pointwise` with a prepacked W."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An attribute, not a parameter or buffer: an opaque oneDNN tensor that no state_dict should hold.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())  # no batch hint:
        # a hint of 1 row made 4- to 64-row products up to 2x slower here
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        w = linear.weight.detach()  # kept for one-row products: the memory of this layer twice
        self.weight = w if w.numel() <= ONE_ROW_MKL_MAX_WEIGHT else None

    def forward(self, x: Tensor) -> Tensor:
        if self.weight is not None and x.numel() == self.in_features:  # one row
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_for_cpu(model: nn.Module) -> nn.Module:
    """A copy of `model` (float32, on the CPU, for inference) with every `nn.Linear` packed for oneDNN;
    the model itself when packing is unavailable in this PyTorch build."""
    if not packing_available():
        log.info("oneDNN linear packing unavailable in this PyTorch build; using the model as it is")
        return model
    packed = copy.deepcopy(model).eval()
    for parent in list(packed.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
    bias = getattr(packed, "final_logits_bias", None)  # Marian's bias on the logits
    if bias is not None and isinstance(packed.generator, PackedLinear) and packed.generator.bias is None:
        packed.generator.bias, packed.final_logits_bias = bias, None  # added inside the product: one pass less
    return packed

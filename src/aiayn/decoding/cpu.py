"""CPU inference: every Linear with its weight reordered once into the layout its matmul library wants.

The layout follows the CPU and the process' thread count when the model is packed (`aiayn translate
--threads` and `Translator.load` after `torch.set_num_threads`).

Measured with one thread (`benchmarks/decode.py`, benchmarks/RESULTS.md): on an AMD EPYC machine,
PyTorch's default CPU matmul (MKL sgemm) runs the decoder's small-batch products 2-7x slower than oneDNN
with a prepacked weight, which is what CTranslate2 uses on non-Intel CPUs. On an Intel Xeon (Sapphire
Rapids class), oneDNN's prepacked weights still beat plain MKL from 4 rows up, but for one row (greedy
search of one sentence) plain MKL on the weight stored transposed, (in, out) contiguous, is fastest: the
37 products of a `base` decoder step take 9.5 ms, against 10.0 with MKL's packed GEMM (whose packed copy
is 1.4-8.8x the weight), 11.1 with MKL on the (out, in) weight and 11.7 with oneDNN. `pack_for_cpu` swaps
each `nn.Linear` for a `PackedLinear` in a copy of the model: the same function, the weights reordered,
nothing saved.

int8 (`aiayn translate --int8`): PyTorch's dynamic quantization packs each weight for fbgemm, which has
no AMX kernels. On CPUs with AMX, `pack_int8_for_amx` also packs it for oneDNN, whose int8 matmul runs
on AMX tiles, and `Int8Linear` takes that packing from 8 rows up (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import copy
import functools
import logging
import platform
from typing import Callable

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)

PACKED_ROWS = 64  # the row count oneDNN lays the weights out for; any count runs
# From this many rows up oneDNN's AMX int8 products beat fbgemm's: the 37 products of a `base` decoder
# step, one thread, ms: 1 row 2.0 (fbgemm) against 2.7 (oneDNN), 4 rows 2.3 against 3.5, 8 rows 3.5
# against 3.1, 16 rows 4.5 against 4.2, 64 rows 10.5 against 6.2 (this project's Intel CPU).
INT8_AMX_ROWS = 8


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def one_row_mkl_available() -> bool:
    """MKL for one-row products: on Intel CPUs, where MKL is tuned (as CTranslate2 does) and splits a row's
    product between threads; elsewhere only for a process that computes on one thread. On an AMD EPYC
    (Zen 4), the 37 products of a `base` decoder step (benchmarks/RESULTS.md, thirteenth run): one thread,
    MKL on W^T 8.7 ms against oneDNN's 10.4; two threads, 9.0 (MKL leaves the second thread idle there)
    against oneDNN's 6.3."""
    if not torch.backends.mkl.is_available():
        return False
    return _cpu_vendor() == "GenuineIntel" or torch.get_num_threads() == 1


@functools.cache  # read once, not once per Linear
def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":")[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return "GenuineIntel" if "Intel" in platform.processor() else ""


class PackedLinear(nn.Module):
    """y = x W^T + b (an `nn.Linear`): oneDNN's `_linear_pointwise` with a prepacked W, or for one row on
    an Intel CPU plain MKL on W^T."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An attribute, not a parameter or buffer: an opaque oneDNN tensor that no state_dict should hold.
        # Packed for 64 rows (beam 4 x 16 sentences): against no hint, a `base` decoder's Linears ran 8%
        # faster at 64 rows and 11% at 128, and no slower at 4, 16 or 384 (an encoder batch), on this
        # project's Intel CPU; a hint of 1 row made 4- to 64-row products up to 2x slower.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKED_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # One-row products through plain MKL on W^T, (in, out) contiguous: the row times W^T reads W^T
        # row by row, in memory order. Whole greedy decoding of one sentence ran 4% faster than with MKL's
        # packed GEMM (A/B in one process), and W^T is one copy of the weight where MKL's packed one was
        # 1.4x (the vocabulary) to 8.8x (512 x 512) (benchmarks/RESULTS.md).
        self.weight_t = linear.weight.detach().t().contiguous() if one_row_mkl_available() else None

    def forward(self, x: Tensor) -> Tensor:
        if self.weight_t is not None and x.numel() == self.in_features:  # one row
            row, w_t = x.reshape(1, self.in_features), self.weight_t
            y = torch.mm(row, w_t) if self.bias is None else torch.addmm(self.bias, row, w_t)  # (1, out)
            return y.view(*x.shape[:-1], self.out_features)  # (..., out)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def amx_int8_available() -> bool:
    """oneDNN's int8 kernels have AMX tiles to run on (Intel Xeon from Sapphire Rapids on)."""
    is_amx = getattr(torch.cpu, "_is_amx_tile_supported", None)  # private, hence the care
    return bool(is_amx is not None and is_amx()) and "onednn" in torch.backends.quantized.supported_engines


class Int8Linear(nn.Module):
    """A dynamically quantized Linear (from `torch.ao.quantization.quantize_dynamic`, int8 weight, input
    quantized per call) with its weight packed twice: fbgemm's packing for fewer than `INT8_AMX_ROWS`
    rows, oneDNN's (AMX) from there up. The same int8 weight and activation quantization either way."""

    def __init__(self, quantized: nn.Module):
        super().__init__()
        self.in_features, self.out_features = quantized.in_features, quantized.out_features
        self.few_rows = quantized._packed_params._packed_params  # packed by the engine of the time
        weight, bias = quantized._packed_params._weight_bias()  # the int8 weight, the float bias
        engine = torch.backends.quantized.engine
        torch.backends.quantized.engine = "onednn"  # packing picks the engine; calling does not
        try:
            self.many_rows = torch.ops.quantized.linear_prepack(weight, bias)
        finally:
            torch.backends.quantized.engine = engine

    def forward(self, x: Tensor) -> Tensor:
        packed = self.many_rows if x.numel() >= INT8_AMX_ROWS * self.in_features else self.few_rows
        return torch.ops.quantized.linear_dynamic(x, packed, reduce_range=True)  # as quantize_dynamic's


def pack_int8_for_amx(model: nn.Module) -> nn.Module:
    """`model` (dynamically quantized) with every quantized Linear an `Int8Linear`, where AMX is there."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    if not amx_int8_available():
        return model

    def int8(m: nn.Module) -> bool:
        return type(m) is DynamicQuantizedLinear and m._packed_params.dtype == torch.qint8

    replace_modules(model, int8, Int8Linear)
    return model


def pack_for_cpu(model: nn.Module) -> nn.Module:
    """A copy of `model` (float32, on the CPU, for inference) with every `nn.Linear` packed for oneDNN;
    the model itself when packing is unavailable in this PyTorch build."""
    if not packing_available():
        log.info("oneDNN linear packing unavailable in this PyTorch build; using the model as it is")
        return model
    packed = copy.deepcopy(model).eval()
    replace_modules(packed, lambda m: type(m) is nn.Linear, PackedLinear)
    fold_logits_bias(packed)
    return packed


def replace_modules(
    model: nn.Module, match: Callable[[nn.Module], bool], make: Callable[[nn.Module], nn.Module]
) -> None:
    """Swap every submodule `m` of `model` for which `match(m)` holds for `make(m)`, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if match(child):
                setattr(parent, name, make(child))


def fold_logits_bias(model: nn.Module) -> None:
    """Move Marian's bias on the logits (`final_logits_bias`) into the vocabulary product of a packed or
    quantized model, whose `generator` has no bias of its own: added inside the product, it saves a pass
    over the (R, V) logits every step (2.5% of an int8 greedy step at batch 16, `base` shape)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    bias, generator = getattr(model, "final_logits_bias", None), getattr(model, "generator", None)
    if bias is None:
        return
    if isinstance(generator, PackedLinear) and generator.bias is None:
        generator.bias = bias
    elif type(generator) is DynamicQuantizedLinear and generator.bias() is None:
        generator.set_weight_bias(generator.weight(), bias)
    else:
        return
    model.final_logits_bias = None

"""CPU inference: every Linear with its weight reordered once into the layout its matmul library wants.

The layout follows the CPU and the process' thread count when the model is packed (`aiayn translate
--threads` and `Translator.load` after `torch.set_num_threads`).

Measured with one thread (`benchmarks/decode.py`, benchmarks/RESULTS.md): on an AMD EPYC machine,
PyTorch's default CPU matmul (MKL sgemm) runs the decoder's small-batch products 2-7x slower than oneDNN
with a prepacked weight, which is what CTranslate2 uses on non-Intel CPUs. On an Intel Xeon (Sapphire
Rapids class), oneDNN's prepacked weights still beat plain MKL from 4 rows up, but for one row (greedy
search of one sentence) plain MKL on the weight stored transposed, (in, out) contiguous, is fastest: the
37 products of a `base` decoder step take 9.5 ms, against 10.0 with MKL's packed GEMM (whose packed copy
is 1.4-8.8x the weight), 11.1 with MKL on the (out, in) weight and 11.7 with oneDNN. Where MKL does not
split a one-row product between threads (an AMD EPYC), `OneRowProduct` cuts W^T into a block per thread.
`pack_for_cpu` swaps each `nn.Linear` for a `PackedLinear` in a copy of the model: the same function, the
weights reordered, nothing saved.

int8 (`aiayn translate --int8`): PyTorch's dynamic quantization packs each weight for fbgemm, which has
no AMX kernels. On CPUs with AMX, `pack_int8_for_amx` also packs it for oneDNN, whose int8 matmul runs
on AMX tiles, and `Int8Linear` takes that packing from 8 rows up (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import copy
import functools
import logging
import platform
from collections.abc import Sequence
from typing import Callable

import torch
from torch import Tensor, nn

from aiayn.memory import on_huge_pages

log = logging.getLogger(__name__)

PACKED_ROWS = 64  # the row count oneDNN lays the weights out for; any count runs
# From this many rows up oneDNN's AMX int8 products beat fbgemm's: the 37 products of a `base` decoder
# step, one thread, ms: 1 row 2.0 (fbgemm) against 2.7 (oneDNN), 4 rows 2.3 against 3.5, 8 rows 3.5
# against 3.1, 16 rows 4.5 against 4.2, 64 rows 10.5 against 6.2 (this project's Intel CPU).
INT8_AMX_ROWS = 8


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def one_row_blocks() -> int:
    """How many blocks a one-row product's weight is cut into for MKL, one per thread; 0 for none (oneDNN
    makes one-row products too).

    MKL on W^T is the fastest one-row kernel here, but it splits a row's product between threads on Intel
    CPUs only. On an AMD EPYC (Zen 4) it leaves the second thread idle, so there each thread gets a block
    of the weight of its own, and MKL's batched product runs the blocks side by side. The 37 products of
    a `base` decoder step, two threads, MKL on two blocks against oneDNN packed for 64 rows, per shape
    (us, cold caches, benchmarks/RESULTS.md): (512, 1536) 122 against 167, (512, 512) 64 against 75,
    (512, 2048) 129 against 220, (2048, 512) 211 against 231, the vocabulary (512, 32000) 1,459 against
    2,435. From four rows up oneDNN is faster than any of these. Measured on AMD at one and two threads
    (benchmarks/one_row.py); other vendors keep oneDNN on several threads."""
    if not torch.backends.mkl.is_available():
        return 0
    threads = torch.get_num_threads()
    if _cpu_vendor() == "GenuineIntel" or threads == 1:
        return 1
    return threads if _cpu_vendor() == "AuthenticAMD" else 0  # elsewhere unmeasured: oneDNN, as before


@functools.cache  # read once, not once per Linear
def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":")[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return "GenuineIntel" if "Intel" in platform.processor() else ""


class OneRowProduct:
    """x W^T + b for one row x (1, in) through plain MKL on W^T, (in, out) contiguous, cut into `blocks`
    blocks that MKL's batched product runs one per thread.

    A wide weight (out > in) is cut by output columns, each block a (in, out / blocks) W^T, padded with
    zero columns to equal widths: the blocks' outputs side by side are the row's. A square or narrow one
    (the FFN's second product) is cut by input rows, each block a (in / blocks, out) W^T, and the blocks'
    partial sums are added: 211 against 280 us for (2048, 512), 64 against 77 for (512, 512), two threads.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, blocks: int):
        out_features, in_features = weight.shape
        w_t, bias = weight.detach().t(), None if bias is None else bias.detach()  # (in, out), (out,)
        zero = torch.zeros(out_features, dtype=weight.dtype)
        self.blocks, self.out_features = blocks, out_features
        self.by_rows = blocks > 1 and out_features <= in_features and in_features % blocks == 0
        if blocks == 1:
            self.weight, self.bias = w_t.contiguous(), bias
        elif self.by_rows:
            # (blocks, in/blocks, out)
            self.weight = w_t.reshape(blocks, in_features // blocks, out_features).contiguous()
            # The bias in the first block's sum only: (blocks, 1, out).
            self.bias = torch.stack([zero if bias is None else bias] + [zero] * (blocks - 1))[:, None, :]
        else:
            width = -(-out_features // blocks)  # ceil
            padded = nn.functional.pad(w_t, (0, width * blocks - out_features))  # (in, blocks * width)
            # (blocks, in, width)
            self.weight = padded.view(in_features, blocks, width).transpose(0, 1).contiguous()
            bias = nn.functional.pad(zero if bias is None else bias, (0, width * blocks - out_features))
            self.bias = bias.view(blocks, 1, width)  # (blocks, 1, width)

    def __call__(self, row: Tensor) -> Tensor:  # (1, in) -> (1, out)
        if self.blocks == 1:
            return torch.mm(row, self.weight) if self.bias is None else torch.addmm(self.bias, row, self.weight)
        if self.by_rows:
            parts = torch.baddbmm(self.bias, row.view(self.blocks, 1, -1), self.weight)  # (blocks, 1, out)
            return parts.sum(0)  # (1, out)
        rows = row.expand(self.blocks, 1, row.shape[-1])  # (blocks, 1, in), no copy
        cols = torch.baddbmm(self.bias, rows, self.weight)  # (blocks, 1, width)
        return cols.view(1, -1)[:, : self.out_features]  # (1, out)


# What a packed model (`PackedLinear`) says of the uses it cannot serve: it is made for decoding alone.
PACKED = "this model is packed for CPU decoding (Translator.load)"
NO_GRADIENTS = (f"{PACKED}: it has no gradients; decode under torch.inference_mode(), or train, fine-tune or "
                "take gradients of load_checkpoint(path).model")
NO_CAST = (f"{PACKED}: its weights stay float32 on the CPU; load it in the dtype and on the device wanted: "
           "Translator.load(path, device, dtype=...) or load_checkpoint(path, device, dtype)")
NO_COPY = (f"{PACKED}: its oneDNN weights cannot be copied or pickled; load it again "
           "(Translator.load(path)), or copy load_checkpoint(path).model")


class PackedLinear(nn.Module):
    """y = x W^T + b (an `nn.Linear`): oneDNN's `_linear_pointwise` with a prepacked W, or for one row
    plain MKL on W^T (`OneRowProduct`). For decoding only: a forward that would need gradients, a cast or
    move (`.to`, `.bfloat16()`, `.cuda()`), a copy or a pickle is a RuntimeError (`NO_GRADIENTS`, ...),
    where oneDNN's kernels took no gradients silently, failed on another dtype with "could not create a
    primitive descriptor", and its tensors could not be copied ("OpaqueTensorImpl")."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An attribute, not a parameter or buffer: an opaque oneDNN tensor that no state_dict should hold.
        # Packed for 64 rows (beam 4 x 16 sentences): against no hint, a `base` decoder's Linears ran 8%
        # faster at 64 rows and 11% at 128, and no slower at 4, 16 or 384 (an encoder batch), on this
        # project's Intel CPU; a hint of 1 row made 4- to 64-row products up to 2x slower.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKED_ROWS)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # One-row products (greedy search of one sentence) through plain MKL on W^T: the row times W^T
        # reads W^T row by row, in memory order. On Intel, whole greedy decoding of one sentence ran 4%
        # faster than with MKL's packed GEMM (A/B in one process), and W^T is one copy of the weight where
        # MKL's packed one was 1.4x (the vocabulary) to 8.8x (512 x 512) (benchmarks/RESULTS.md).
        blocks = one_row_blocks()
        self.one_row = OneRowProduct(linear.weight, self.bias, blocks) if blocks else None

    def forward(self, x: Tensor) -> Tensor:
        if x.requires_grad:  # a flag read: oneDNN's kernel has no backward, and warned only of "silently
            raise RuntimeError(NO_GRADIENTS)  # incorrect behavior", every parameter's grad left None
        if self.one_row is not None and x.numel() == self.in_features:  # one row
            y = self.one_row(x.reshape(1, self.in_features))  # (1, out)
            return y.view(*x.shape[:-1], self.out_features)  # (..., out)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def check_apply(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Refuse `fn` (what `.to`, `.bfloat16()`, `.cuda()` apply to every tensor) where it would change
        a float32 CPU tensor's dtype or device: the packed weights are neither. `Transformer._apply` asks
        before it casts anything, so that a refused cast leaves no model half cast."""
        probe = fn(torch.empty(0, dtype=torch.float32, device="cpu"))  # not the caller's default dtype
        if probe.dtype != torch.float32 or probe.device.type != "cpu":
            raise RuntimeError(NO_CAST)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> PackedLinear:
        self.check_apply(fn)  # no-op moves (.float(), .cpu(), .to("cpu")) go on; nothing here to apply
        return self

    def __reduce_ex__(self, protocol: object) -> object:  # pickle and copy.deepcopy
        raise RuntimeError(NO_COPY)


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


def pack_for_cpu(model: nn.Module, in_place: bool = False) -> nn.Module:
    """A copy of `model` (float32, on the CPU, for inference) with every `nn.Linear` packed for oneDNN, or
    with `in_place` `model` itself so packed (a caller that gives it away holds no second copy at once);
    the model itself, unpacked, when packing is unavailable in this PyTorch build."""
    if not packing_available():
        log.info("oneDNN linear packing unavailable in this PyTorch build; using the model as it is")
        return model
    packed = (model if in_place else copy.deepcopy(model)).eval()
    counts = linear_parameters(packed)  # before the logits bias, a buffer, is folded into a Linear
    fold_logits_bias(packed)  # before packing: the one-row layouts hold the bias
    replace_modules(packed, lambda m: type(m) is nn.Linear, PackedLinear)
    count_packed(packed, counts)
    # The encoder reads whole sources, and the cross-attention's K/V projection reads the encoder's
    # output: their one-row layouts would be copies that a one-token source alone uses (87 MB of 238
    # for `base` with blocks); those products go to oneDNN.
    for m in [*packed.encoder.modules(), *(layer.src_attn.kv_proj for layer in packed.decoder)]:
        if type(m) is PackedLinear:
            m.one_row = None
    huge_page_weights([m.one_row for m in packed.modules() if type(m) is PackedLinear and m.one_row])
    return packed


def linear_parameters(model: nn.Module) -> dict[str, int]:
    """For each `nn.Linear` of `model`, by name, how many of the model's parameters it alone holds: its
    weight and bias, less a weight tied to a module that is not a Linear (the output projection, which
    is the target embedding). Taken before the Linears are packed or quantized (`count_packed`)."""
    kept = {id(p) for m in model.modules() if type(m) is not nn.Linear for p in m.parameters(recurse=False)}
    return {name: sum(p.numel() for p in m.parameters(recurse=False) if id(p) not in kept)
            for name, m in model.named_modules() if type(m) is nn.Linear}


def count_packed(model: nn.Module, counts: dict[str, int]) -> None:
    """Give each module that took the place of a Linear named in `counts` (`linear_parameters`) its count
    as `packed_parameters`, which `Transformer.num_parameters` adds: packed and int8 weights are no
    parameters, and a model packed for decoding counted its embeddings and norms alone."""
    for name, m in model.named_modules():
        if name in counts and type(m) is not nn.Linear:
            m.packed_parameters = counts[name]


def huge_page_weights(products: Sequence[OneRowProduct]) -> None:
    """Move the weights of `products` into one mapping on huge pages (`aiayn.memory.on_huge_pages`):
    a one-row product streams its whole weight from memory every step."""
    for product, weight in zip(products, on_huge_pages([p.weight for p in products])):
        product.weight = weight


def replace_modules(
    model: nn.Module, match: Callable[[nn.Module], bool], make: Callable[[nn.Module], nn.Module]
) -> None:
    """Swap every submodule `m` of `model` for which `match(m)` holds for `make(m)`, in place, in `m`'s mode
    (a new module is in training mode: a packed model read as training to `Translator`'s check)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if match(child):
                setattr(parent, name, make(child).train(child.training))


def fold_logits_bias(model: nn.Module) -> None:
    """Move Marian's bias on the logits (`final_logits_bias`) into the vocabulary product of a model copy
    about to be packed, or of a quantized one, whose `generator` has no bias of its own: added inside the
    product, it saves a pass over the (R, V) logits every step (2.5% of an int8 greedy step at batch 16,
    `base` shape)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    bias, generator = getattr(model, "final_logits_bias", None), getattr(model, "generator", None)
    if bias is None:
        return
    if type(generator) is nn.Linear and generator.bias is None:
        generator.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    elif type(generator) is DynamicQuantizedLinear and generator.bias() is None:
        generator.set_weight_bias(generator.weight(), bias)
    else:
        return
    model.final_logits_bias = None

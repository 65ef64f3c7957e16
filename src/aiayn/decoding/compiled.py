"""The decoder step of one row through `torch.compile` (`aiayn translate --compile`,
`Translator.load(compile=True)`): greedy search or sampling of one sentence, a service's latency case.

Decoding one sentence feeds the decoder one row a step. The step's 37 Linear products (`base`) then read
every weight once, 154 MB, at the memory's rate (`aiayn.decoding.cpu`); besides them the step is about
150 small operations (the cache writes, attention over one query, residual adds, LayerNorm), each a
dispatch through PyTorch and the Python around it, run from caches that the weights have just flushed.
Compiled, those become a dozen fused loops around the products: a greedy step of one sentence on two
threads of this project's AMD EPYC took 6.10 against 6.71 ms (median of 30 sentences of 32 steps, eager
and compiled interleaved in one process; benchmarks/RESULTS.md, "A compiled one-row step").

Only steps of one row, after the first, of an unpadded source, at the thread count of the loading, take
the compiled path. The first step also projects the source's cross-attention keys and values (a product
of S rows) into the cache, and from two rows up the products go to oneDNN's packed weights: opaque
tensors that torch.compile cannot trace, and products that outweigh the rest of the step more. Inside
the compiled step attention goes through SDPA's math backend, which inductor fuses into the step's loops;
the CPU flash kernel would stay a call of its own (about 28 us per call there, 12 calls a step).

Everything compiles while loading (`warm_up`), nothing afterwards: sizes are marked dynamic, so the two
graphs made then serve every source length and length limit, and a step they do not cover (a thread
count changed since, say) runs eagerly instead of compiling in the middle of a translation.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import types

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from aiayn.model import KVCache, Transformer

log = logging.getLogger(__name__)


def cxx_compiler() -> str:
    """The C++ compiler torch.compile's CPU backend (inductor) runs: $CXX, else g++ (clang++ on macOS), as
    its `cpp.cxx` setting says; it tries no other (c++ on PATH passed a check for any of three, then the
    first update failed with inductor's "No working C++ compiler found"). An empty $CXX is "", as inductor
    reads it (it ran "": Permission denied), not the default."""
    return os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")


def has_cxx_compiler() -> bool:
    """Whether the compiler inductor runs (`cxx_compiler`) is there."""
    return bool(cxx_compiler()) and shutil.which(cxx_compiler()) is not None


def missing_compiler(setting: str) -> str:
    """What to say when `has_cxx_compiler` is false: `setting` needs it."""
    if not cxx_compiler():
        return (f"{setting} needs a C++ compiler, and CXX is set but empty: unset it (g++ is then used) or "
                "name one")
    return (f"{setting} needs the C++ compiler torch.compile's CPU code is built with, {cxx_compiler()} "
            "($CXX, else g++; clang++ on macOS), on PATH: install it or set CXX")


def check_compile_works(setting: str) -> None:
    """torch.compile of a two-operation function, run once (seconds; cached by inductor after): a UserError
    where it fails. A compiler that is there but cannot build inductor's code (no Python headers, a broken
    $CXX, an unwritable cache) failed training's first update, after the tokenizer and the encoding, in a
    190-line traceback."""
    from aiayn.errors import UserError

    if not has_cxx_compiler():
        raise UserError(missing_compiler(setting))
    try:
        torch.compile(_twice_plus_one)(torch.ones(2))
    except Exception as e:  # noqa: BLE001  dynamo and inductor raise many kinds, with pages of detail
        raise UserError(f"{setting}: torch.compile failed here: {_first_words(e)[:300]}") from None


def _twice_plus_one(x: Tensor) -> Tensor:
    return x * 2 + 1


def check_cxx_compiler() -> None:
    """A UserError without one: inductor said "backend='inductor' raised:", its reason pages below."""
    from aiayn.errors import UserError

    if not has_cxx_compiler():
        raise UserError(missing_compiler("compile (--compile)") + ", or decode without compiling")


def _decode(
    model: Transformer, tgt_in: Tensor, memory: Tensor, src_mask: Tensor | None, cache: KVCache
) -> Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        return model.decode(tgt_in, memory, src_mask, cache)


class OneRowStep:
    """`model.decode(tgt_in, memory, src_mask, cache)` compiled, for a cached step of one row.

    Made by `compile_one_row_step`, which compiles it (10-40 s for `base` on a 2-core CPU);
    `aiayn.decoding.search.step_log_probs` calls it where `applies`.
    """

    def __init__(self, model: Transformer):
        self.model = model
        self.threads = torch.get_num_threads()  # the graphs' OpenMP loops are made for this many
        # A function of its own, with a code object of its own: dynamo keeps compiled graphs, and its limit
        # of 8, per code object, and with one shared by every model the fifth would decode eagerly.
        decode = types.FunctionType(_decode.__code__.replace(), _decode.__globals__, "_decode")
        self.compiled = torch.compile(decode)
        self.run_only = torch._dynamo.run(self.compiled)  # the graphs compiled so far, never a new one
        self.marked: KVCache | None = None  # the cache whose sizes were last marked dynamic

    def applies(self, tgt_in: Tensor, src_mask: Tensor | None, cache: KVCache) -> bool:
        """One row, one new token, an unpadded source whose cross-attention keys and values are in the
        cache already, and the thread count the step was compiled for."""
        return (tgt_in.shape == (1, 1) and src_mask is None and cache.length > 0
                and torch.get_num_threads() == self.threads)

    def __call__(self, tgt_in: Tensor, memory: Tensor, src_mask: Tensor | None, cache: KVCache) -> Tensor:
        return self._step(self.run_only, tgt_in, memory, src_mask, cache)  # (1, 1, V)

    def _step(self, run, tgt_in: Tensor, memory: Tensor, src_mask: Tensor | None, cache: KVCache) -> Tensor:
        if cache is not self.marked:  # a new sentence: its source length and length limit are sizes
            self.mark_dynamic(memory, cache)
        # view: strides (1, 1) whatever the caller's, as the compiled graph's guards expect
        return run(self.model, tgt_in.view(1, 1), memory, src_mask, cache)  # (1, 1, V)

    def mark_dynamic(self, memory: Tensor, cache: KVCache) -> None:
        """Compile the source length S and the cache's length limit as symbols, not constants (the
        weights' sizes stay constants); the number of positions already cached becomes one when it
        first changes."""
        sized = [(memory, 1), (cache.k, 2), (cache.v, 2)]  # (1, S, d); (L, 1, max_len, H, D)
        sized += [(kv, 1) for kv in (*cache.k_layers, *cache.v_layers)]  # their (1, max_len, H, D) views
        sized += [(kv, 2) for pair in cache.cross if pair is not None for kv in pair]  # (1, H, S, D)
        for tensor, dim in sized:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        self.marked = cache

    def warm_up(self) -> None:
        """Compile now: decode two tokens of a two-token source (the sizes stay dynamic)."""
        c = self.model.config
        src = torch.tensor([[c.eos_id, c.eos_id]], device=self.model.tgt_embed.pe.device)  # (1, 2)
        with torch.inference_mode():
            memory, cache = self.model.encode(src), self.model.new_cache(1, 3)
            tgt_in = torch.full((1, 1), c.decoder_start_id, device=src.device)
            self.model.decode(tgt_in, memory, None, cache)  # the first step: eager, fills the cross K/V
            self._step(self.compiled, tgt_in, memory, None, cache)
            self._step(self.compiled, tgt_in, memory, None, cache)  # a second cached length: a symbol


def compile_one_row_step(model: Transformer) -> Transformer:
    """`model` with its one-row decoder steps compiled (`OneRowStep`, attribute `one_row_step`),
    compiled now, said first on this module's logger (INFO); a `UserError` if torch.compile cannot run
    here (it needs a C++ compiler)."""
    from aiayn.errors import UserError

    if next(model.parameters()).device.type == "cpu":
        check_cxx_compiler()
    # else silence for as long: `translate --compile -i FILE` showed its progress bar only after 26 s
    log.info("torch.compile: compiling the decoder step of one sentence before translating (10-40 s)")
    try:
        step = OneRowStep(model)
        step.warm_up()
    except Exception as e:  # noqa: BLE001  dynamo and inductor raise many kinds, with pages of detail
        raise UserError(f"compile (--compile): torch.compile failed here: {_first_words(e)[:300]}") from None
    model.one_row_step = step
    return model


def _first_words(error: Exception) -> str:
    """The first line of `error` that says something: "backend='inductor' raised:" is followed by its
    reason, on the next line; a compiler's own first "error:" line after it ("C++ compile error" kept
    back "fatal error: Python.h: No such file or directory")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    words = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    reason = next((line for line in lines[1:] if "error:" in line and line not in words), None)
    return f"{words} ({reason})" if reason else words

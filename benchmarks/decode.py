"""Decoding speed: generated tokens per second of aiayn against HuggingFace and CTranslate2, same weights.

The `base` shape (d_model 512, 8 heads, d_ff 2048, 6+6 layers, vocabulary 32,000) with random weights,
built once as a HuggingFace `MarianMTModel` and carried into aiayn through `aiayn.interop.marian` and
into CTranslate2 through CTranslate2's own `TransformersConverter` (float32 and int8): three runtimes,
one set of weights. aiayn's logits are checked against HuggingFace's (within 1e-3, the largest
difference recorded) before anything is timed; CTranslate2's are not (its workers return ids), its
outputs are compared instead. Every source has 24 tokens (its EOS included) and every output exactly 32
new tokens (EOS forbidden until then: aiayn's `min_len`, HuggingFace's `min_new_tokens`, CTranslate2's
`min_decoding_length`; each output's length is checked), and the record says on what share of
sentences each float32 engine's output equals aiayn fp32's. Cells: greedy and beam 4, batch 1 and 16.
Tokens/s counts output tokens of the returned hypotheses (batch x 32), the encoder included.

The engines of one cell run interleaved, repeat after repeat, with the same thread count, and the
median is reported: on a shared machine the ratios between engines of one run are what carries over.
Each engine runs in a process of its own: in one process, CTranslate2's wheel binds to PyTorch's GNU
OpenMP runtime, and once CTranslate2 has run with two threads, PyTorch's parallel regions wait for
their workers the slow way (libgomp throttles its spinning when it manages more threads than there
are cores): an aiayn greedy step on two threads went from 7.0 to 13.9 ms after one CTranslate2 call.
After the timing each worker reports its resident memory, freed heap returned to the system first:
the engine's weights in whatever copies and layouts it keeps, plus the libraries every worker loads.

On a CPU one more worker, "Linear floor", runs beside the engines: only the Linear products of the 32
decoder steps of each cell (`step_linear_shapes`, float32 weights of the `base` shape, each product with
the fastest of the matmul kernels PyTorch ships here: MKL's sgemm on W or on W^T, MKL's packed GEMM,
oneDNN's packed weights; W^T and its blocks on huge pages, as aiayn keeps them). Nothing else: no
encoder, attention, LayerNorm, search or Python model code. Every float32 engine makes these products,
so its tok/s bounds how fast any of them can go here, and its ratio to HuggingFace bounds how far ahead
of HuggingFace any one can get (an engine with its weights on 4 KiB pages may find them slower).

On a CPU with a C++ compiler, "aiayn fp32 compiled" is aiayn as `Translator.load(compile=True)` and
`aiayn translate --compile` prepare it: the same packed model, its decoder steps of one row (greedy
search of one sentence) compiled with torch.compile when the worker starts (`aiayn.decoding.compiled`).
Its other cells decode as "aiayn fp32" does.

With several thread counts (`--threads 1,2`) every engine runs at each, all interleaved in one run,
and a first table takes each engine at its own best count: what each reaches on the whole machine.
CTranslate2 can be slower on two threads than on one: its MKL splits the one-row products between the
threads (on this project's 2-core VM, greedy batch 1 fell from 100 to 72 tok/s; `MKL_NUM_THREADS=1`
restored it).

    python benchmarks/decode.py                       # CPU, 1 thread, 3 repeats
    python benchmarks/decode.py --threads 2 --repeats 5
    python benchmarks/decode.py --threads 1,2         # each engine also at its best thread count
    python benchmarks/decode.py --device cuda         # on a GPU (CT2 too if its wheel has CUDA)
    python benchmarks/decode.py --cells greedy-1 --engines "CT2 float32" --repeats 1   # a quick look

Writes benchmarks/results/local/decode_{cpu,cuda}.{json,md} (ignored by git) unless --out names a prefix
(over a file git tracks, a committed result, only with --force), and rewrites them after every cell. An
engine whose worker fails (a CTranslate2 wheel whose CUDA libraries do not load: cuBLAS loads at the first
translation, so no check beforehand sees it) is left out, at every thread count, from then on and from the
cells before, with one line on stderr and its error in the results ("failed_engines"); the others run on.
CTranslate2's conversion of the model failing leaves its engines out the same way. If aiayn fp32 or HF
Marian fp32 fails, the engines the ratios are taken against, the run ends in one line naming it and its
error, and the cells measured before it stay.
Without ctranslate2 (pip install -e '.[bench]') the CTranslate2 engines are skipped; transformers is
needed, as the source of the weights.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    LOCAL_RESULTS,
    at_least,
    command_line,
    environment,
    load_average,
    peer_available,
    check_out,
    require_device,
    status_kib,
    sync,
    thread_counts,
    with_suffix_added,
)

from aiayn.checkpoint import load_into  # noqa: E402
from aiayn.decoding import DecodeConfig, generate  # noqa: E402
from aiayn.decoding.compiled import has_cxx_compiler  # noqa: E402
from aiayn.decoding.cpu import PACKED_ROWS, OneRowProduct, huge_page_weights  # noqa: E402
from aiayn.interop.marian import convert_weights, model_config_from_marian  # noqa: E402
from aiayn.memory import keep_freed_memory, release_freed_memory  # noqa: E402
from aiayn.translate import prepare_for_inference  # noqa: E402

SRC_LEN, NEW_TOKENS, VOCAB = 24, 32, 32_000
FLOOR = "Linear floor"
COMPILED = "aiayn fp32 compiled"  # `Translator.load(compile=True)`: one-row steps compiled, the rest as fp32
EOS, UNK, PAD = 0, 1, VOCAB - 1  # Marian's layout: </s> 0, <unk> 1, <pad> last (CTranslate2 drops its row)
CELLS = [("greedy", 1, 1), ("greedy", 1, 16), ("beam 4", 4, 1), ("beam 4", 4, 16)]
# every engine `engine_names` may time, for --engines to be checked before any work
ENGINES = ("aiayn fp32", COMPILED, "HF Marian fp32", "aiayn int8", FLOOR, "CT2 float32", "CT2 int8")


def marian_config():
    from transformers import MarianConfig

    return MarianConfig(
        vocab_size=VOCAB, d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048, activation_function="relu",
        max_position_embeddings=512, scale_embedding=True, share_encoder_decoder_embeddings=True,
        pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD, forced_eos_token_id=None,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
    )


def build_hf(seed: int):
    from transformers import MarianMTModel

    torch.manual_seed(seed)
    hf = MarianMTModel(marian_config()).eval()
    with torch.no_grad():
        hf.model.shared.weight.normal_(0.0, 512**-0.5)  # the paper's init: unit variance after sqrt(d)
        hf.model.shared.weight[PAD] = 0.0  # Marian's decoder starts from a zero embedding (pad)
    return hf


def aiayn_config(marian):
    """aiayn's `ModelConfig` of a `MarianConfig`."""
    hf_config = {**marian.to_dict(), "architectures": ["MarianMTModel"]}  # unset in a config built here
    return model_config_from_marian(hf_config, "benchmark MarianConfig")


def build_aiayn(hf):
    from aiayn.model import Transformer

    config = aiayn_config(hf.config)
    model = Transformer(config).eval()
    load_into(model, convert_weights(hf.state_dict(), config, "benchmark"), "benchmark")
    return model


def check_same_logits(hf, model, src: torch.Tensor) -> float:
    tgt = torch.randint(2, PAD, (src.shape[0], 9))
    tgt[:, 0] = PAD
    with torch.no_grad():
        theirs = hf(input_ids=src, decoder_input_ids=tgt).logits
        ours = model(src, tgt)
    diff = (theirs - ours).abs().max().item()
    if diff > 1e-3:
        raise SystemExit(f"aiayn and HuggingFace logits differ by {diff}: not the same model, not timing")
    return diff


class _Vocabulary:
    """What CTranslate2's Marian loader reads from a tokenizer: the vocabulary and two token names."""

    eos_token, unk_token = "</s>", "<unk>"

    def get_vocab(self) -> dict[str, int]:
        names = {EOS: "</s>", UNK: "<unk>", PAD: "<pad>"}
        return {names.get(i, f"t{i}"): i for i in range(VOCAB)}


def convert_ct2(hf, workdir: Path) -> dict[str, str]:
    """CTranslate2 float32 and int8 models converted by CTranslate2's own Transformers converter:
    compute type -> model directory."""
    from ctranslate2.converters import TransformersConverter

    class OfflineConverter(TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return _Vocabulary()  # random weights have no SentencePiece model; the ids are all it needs

    hf.save_pretrained(workdir / "hf")
    out = {}
    for compute, quantization in (("float32", None), ("int8", "int8")):
        path = workdir / f"ct2_{compute}"
        OfflineConverter(str(workdir / "hf")).convert(str(path), quantization=quantization, force=True)
        out[compute] = str(path)
    return out


def run_aiayn(model, src, beam: int) -> list[list[int]]:
    """Each sentence's best output ids (each engine's run_* returns these)."""
    config = DecodeConfig(beam=beam, min_len=NEW_TOKENS, max_len_a=0.0, max_len_b=NEW_TOKENS, lenpen=1.0,
                          lenpen_kind="power")
    return [h[0].tokens for h in generate(model, src, config)]


def run_hf(hf, src, beam: int) -> list[list[int]]:
    with torch.inference_mode():
        out = hf.generate(input_ids=src, attention_mask=torch.ones_like(src), num_beams=beam, do_sample=False,
                          use_cache=True, min_new_tokens=NEW_TOKENS, max_new_tokens=NEW_TOKENS)
    return out[:, 1:].tolist()  # without the decoder start token


def run_ct2(translator, tokens, beam: int, ids: dict[str, int]) -> list[list[int]]:
    """`ids`: token name -> id, built once (a 32,000-entry dict, 18 ms: not inside the timing)."""
    results = translator.translate_batch(tokens, beam_size=beam, min_decoding_length=NEW_TOKENS,
                                         max_decoding_length=NEW_TOKENS)
    return [[ids[t] for t in r.hypotheses[0]] for r in results]


def sources(seed: int) -> torch.Tensor:
    """The 16 source sentences (ids, EOS last), the same in every process."""
    src = torch.randint(2, PAD, (16, SRC_LEN), generator=torch.Generator().manual_seed(seed + 1))
    src[:, -1] = EOS
    return src


def make_engine(name: str, seed: int, device: str, ct2_paths: dict[str, str], threads: int):
    """Engine `name`, built in this process: a function (batch, beam) -> each sentence's output ids."""
    torch.set_num_threads(threads)
    src = sources(seed)
    if name == "HF Marian fp32":
        hf = build_hf(seed).to(device)
        src = src.to(device)
        return lambda b, k: run_hf(hf, src[:b], k)
    if name in ("aiayn fp32", COMPILED):  # as `Translator.load`: oneDNN-packed on a CPU
        model = prepare_for_inference(build_aiayn(build_hf(seed)).to(device), compile=name == COMPILED)
        src = src.to(device)
        return lambda b, k: run_aiayn(model, src[:b], k)
    if name == FLOOR:
        return LinearFloor(aiayn_config(marian_config()))
    if name == "aiayn int8":
        model = prepare_for_inference(build_aiayn(build_hf(seed)), int8=True)
        return lambda b, k: run_aiayn(model, src[:b], k)
    import ctranslate2

    compute, where = name.removeprefix("CT2 "), torch.device(device)
    translator = ctranslate2.Translator(ct2_paths[compute], device=where.type, device_index=where.index or 0,
                                        compute_type=compute, intra_threads=threads, inter_threads=1)
    tokens = [[f"t{i}" for i in row[:-1].tolist()] + ["</s>"] for row in src]
    ids = _Vocabulary().get_vocab()
    return lambda b, k: run_ct2(translator, tokens[:b], k, ids)


def step_linear_shapes(c) -> list[tuple[int, int]]:
    """(in, out) of every Linear product of one cached decoder step, each made for all its rows
    (sentences x beams) at once: per layer the self-attention's packed Q, K, V and its W^O, the
    cross-attention's W^Q and W^O (its K and V were projected from the source once, at the first
    step), the FFN; then the vocabulary."""
    d, f, v = c.d_model, c.d_ff, c.target_vocab_size
    return [(d, 3 * d), (d, d), (d, d), (d, d), (d, f), (f, d)] * c.decoder_layers + [(d, v)]


def floor_kernels(rows: int) -> dict[str, Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]]:
    """Matmul kernel name -> a function that lays out one (out, in) weight for it once and returns
    x (rows, in) -> x W^T (rows, out). Only those this PyTorch build has."""

    def mkl_on_w(w):
        return lambda x: torch.mm(x, w.t())

    def mkl_on_w_t(w):  # W^T (in, out) contiguous, x W^T by torch.mm at any row count
        return OneRowProduct(w, None, 1)

    def mkl_packed(w):
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)  # packed for exactly `rows` rows
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, rows)

    def onednn_packed(hint):
        def layout(w):
            packed = torch.ops.mkldnn._reorder_linear_weight(w, hint)
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return layout

    def mkl_blocks(w):  # W^T cut into one block per thread, as aiayn's one-row products (OneRowProduct)
        return OneRowProduct(w, None, torch.get_num_threads())

    kernels = {"MKL sgemm on W": mkl_on_w, "MKL sgemm on W^T": mkl_on_w_t}
    if rows == 1 and torch.get_num_threads() > 1:
        kernels["MKL batched on W^T, a block per thread"] = mkl_blocks
    if torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"):
        kernels["MKL packed GEMM"] = mkl_packed
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        for hint in sorted({rows, PACKED_ROWS}):  # and the row count aiayn packs for
            kernels[f"oneDNN packed for {hint} rows"] = onednn_packed(hint)
    return kernels


class LinearFloor:
    """The "Linear floor" worker: `floor(batch, beam)` runs the Linear products of 32 decoder steps of
    batch x beam rows, nothing else, with the kernel that was fastest for that row count here."""

    def __init__(self, config):
        self.config = config
        self.rows = 0
        self.products: list[tuple[Callable, torch.Tensor]] = []
        self.chosen: dict[int, str] = {}  # rows -> the fastest kernel

    def __call__(self, batch: int, beam: int) -> None:
        """The products of `batch` sentences' steps; no output (None, where engines return their ids)."""
        if batch * beam != self.rows:
            self.products = []  # one row count's weights at a time
            self.rows = batch * beam
            self.chosen[self.rows], self.products = self.fastest(self.rows)
            print(f"{FLOOR}, {self.rows} rows: {self.chosen[self.rows]}", file=sys.stderr, flush=True)
        with torch.inference_mode():
            for _ in range(NEW_TOKENS):
                for product, x in self.products:
                    product(x)

    def fastest(self, rows: int, rounds: int = 11) -> tuple[str, list[tuple[Callable, torch.Tensor]]]:
        """The kernel whose products of one step take the least time (median of `rounds`, the kernels
        interleaved in each), with its laid-out weights. Distinct random weights per product, as in a
        model, so that a step streams all of them through the caches."""
        torch.manual_seed(0)
        shapes = step_linear_shapes(self.config)
        weights = [torch.randn(o, i) * i**-0.5 for i, o in shapes]  # (out, in), as nn.Linear
        inputs = [torch.randn(rows, i) for i, _ in shapes]
        kernels = {name: [(layout(w), x) for w, x in zip(weights, inputs)]
                   for name, layout in floor_kernels(rows).items()}
        for products in kernels.values():  # aiayn's layouts on huge pages, as `pack_for_cpu` puts them
            huge_page_weights([p for p, _ in products if isinstance(p, OneRowProduct)])
        seconds: dict[str, list[float]] = {name: [] for name in kernels}
        order = list(kernels)
        for r in range(rounds):
            for name in order if r % 2 == 0 else reversed(order):  # A B C C B A: none always first
                products = kernels[name]
                start = time.perf_counter()
                for product, x in products:
                    product(x)
                seconds[name].append(time.perf_counter() - start)
        best = min(kernels, key=lambda name: statistics.median(seconds[name]))
        return best, kernels[best]


FAILED = "failed"  # a worker's answer when its engine raised: (FAILED, the error's last line)
KEPT = "keeps freed memory"  # the request a worker answers with what its keep_freed_memory() returned


def serve(conn, name: str, seed: int, device: str, ct2_paths: dict[str, str], threads: int) -> None:
    """A worker process: build engine `name`, then answer requests (`answer`) until None. An engine that
    raises is answered as (FAILED, its error's last line) and ends the worker with exit code 1: the parent
    names the engine and that line (with the traceback, this process and the parent's EOFError each printed
    one, and the parent stopped before its own line)."""
    try:
        # as `aiayn translate` does, unless AIAYN_SYSTEM_MALLOC=1; HF's decoding gets it too. Its answer
        # goes in the results (KEPT): the timings differ with it
        kept = keep_freed_memory()
        run = make_engine(name, seed, device, ct2_paths, threads)
        conn.send("ready")
        while (request := conn.recv()) is not None:
            conn.send(kept if request == KEPT else answer(run, request, device))
    except Exception as e:  # noqa: BLE001  whatever the engine raises (a library not loaded, a bad request)
        with contextlib.suppress(OSError):  # the parent may be gone already
            conn.send((FAILED, last_line(e)))
        raise SystemExit(1) from None


def answer(run, request, device: str):
    """A worker's answer: "memory" -> resident MB, "kernels" -> the Linear floor's kernel per row count,
    (batch, beam) -> (seconds, output ids)."""
    if request == "memory":
        return resident_mb()
    if request == "kernels":
        return getattr(run, "chosen", {})
    batch, beam = request
    sync(device)
    start = time.perf_counter()
    ids = run(batch, beam)
    sync(device)
    return time.perf_counter() - start, ids


def last_line(error: BaseException) -> str:
    """`error` as the last line of its traceback says it ("RuntimeError: Library libcublas.so.12 is not
    found or cannot be loaded"); a message of several lines by its last."""
    return "".join(traceback.format_exception_only(type(error), error)).strip().splitlines()[-1]


def resident_mb() -> float:
    """This process' resident memory in MB once freed heap blocks are handed back (glibc's malloc_trim):
    what it holds, not what it once allocated."""
    gc.collect()
    release_freed_memory()
    return status_kib("VmRSS") * 1024 / 1e6


class WorkerFailed(Exception):
    """A worker's engine failed or its process ended: "ENGINE (T threads) failed: why". `engine` is the
    `Engine` whose worker it was."""

    def __init__(self, engine: Engine, message: str):
        super().__init__(message)
        self.engine = engine


class Engine:
    """Parent side of one worker process: `engine(batch, beam)` -> (seconds, output ids). Each call raises
    `WorkerFailed` if the worker answers FAILED or ends without an answer."""

    def __init__(self, name: str, seed: int, device: str, ct2_paths: dict[str, str], threads: int):
        self.label = f"{name} ({threads} thread{'s' if threads > 1 else ''})"
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no OpenMP state shared
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, name, seed, device, ct2_paths, threads),
                                   daemon=True)
        self.process.start()
        child.close()  # the worker's end held here too would keep its death from reading as EOF

    def receive(self):
        try:
            reply = self.conn.recv()
        except EOFError:  # ended without a word: killed (for memory?), or a crash inside native code
            self.process.join(timeout=10)
            raise WorkerFailed(self, f"{self.label} failed: its worker ended without an answer "
                                     f"(exit code {self.process.exitcode})") from None
        if isinstance(reply, tuple) and reply[:1] == (FAILED,):
            raise WorkerFailed(self, f"{self.label} failed: {reply[1]}")
        return reply

    def ask(self, request):
        try:
            self.conn.send(request)
        except OSError:  # a worker that died since its last answer: EOF is what says how
            pass
        return self.receive()

    def wait_ready(self) -> None:
        if (reply := self.receive()) != "ready":
            raise WorkerFailed(self, f"{self.label} failed: its worker answered {reply!r}, not 'ready'")

    def __call__(self, batch: int, beam: int) -> tuple[float, list[list[int]] | None]:
        return self.ask((batch, beam))

    def memory_mb(self) -> float:
        return self.ask("memory")

    def keeps_freed_memory(self) -> bool:
        return self.ask(KEPT)

    def kernels(self) -> dict[int, str]:
        """The "Linear floor" worker's kernel per row count."""
        return self.ask("kernels")

    def close(self) -> None:
        """End the worker: asked to stop if it still runs, terminated if it has not within 30 s."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.process.join(timeout=30)
        if self.process.is_alive():  # stuck: the run ends, not waits on it
            self.process.terminate()
            self.process.join()


# The engines that compute what aiayn fp32 does in float32: their outputs are compared with its own.
EXACT = ("aiayn fp32", COMPILED, "HF Marian fp32", "CT2 float32")


def agreement(outputs: dict[str, list[list[int]] | None]) -> dict[str, float]:
    """`outputs`: "engine@threads" -> each sentence's ids. The share of sentences on which each float32
    engine's output equals aiayn fp32's at the same thread count: the engines timed do the same work."""
    shares = {}
    for key, ids in outputs.items():
        name, threads = key.rsplit("@", 1)
        reference = outputs.get(f"aiayn fp32@{threads}")
        if name in EXACT and name != "aiayn fp32" and ids is not None and reference is not None:
            shares[key] = sum(a == b for a, b in zip(ids, reference)) / len(reference)
    return shares


def engine_list(text: str) -> list[str]:
    """argparse type: "CT2 float32, CT2 int8" -> those of ENGINES. An empty name, of `--engines ""` or a
    stray comma, is refused here: it was "--engines:  not among those here", after the model was built."""
    chosen = [e.strip() for e in text.split(",")]
    if unknown := [repr(e) for e in chosen if e not in ENGINES]:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not among {', '.join(ENGINES)}")
    return chosen


def cell_names(text: str) -> list[tuple[str, int, int]]:
    """argparse type: "greedy-1,beam4-16" -> those of CELLS (the search without its space, then the batch)."""
    known = {f"{name.replace(' ', '')}-{batch}": cell for cell in CELLS for name, _, batch in [cell]}
    chosen = [c.strip() for c in text.split(",")]
    unknown = [c for c in chosen if c not in known]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or repr(text)}: not among {', '.join(known)}")
    return [cell for key, cell in known.items() if key in chosen]  # in CELLS' order


def measure(runs: dict, repeats: int, settle: float = 0.0,
            cells: list[tuple[str, int, int]] = CELLS) -> tuple[dict, dict]:
    """tokens/s per (cell, engine): engines interleaved within each repeat, median over repeats; and per
    cell, the share of sentences each float32 engine translated as aiayn fp32 did (`agreement`).

    `runs`: name -> `Engine`. Each timed run starts after `settle` idle seconds, so that the OpenMP
    workers of the engine before it, which spin for a while after a call returns, are asleep.
    """
    results, agreed = {}, {}
    for name, beam, batch in cells:
        cell = f"{name}, batch {batch}"
        times: dict[str, list[float]] = {e: [] for e in runs}
        outputs = {}
        for e, fn in runs.items():  # warm-up; the forced length and the outputs checked once per engine, cell
            time.sleep(settle)  # the Linear floor picks its kernel here: not against spinning threads
            _, outputs[e] = fn(batch, beam)
            lengths = None if outputs[e] is None else [len(ids) for ids in outputs[e]]
            if lengths is not None and lengths != [NEW_TOKENS] * batch:
                raise SystemExit(f"{e} produced lengths {lengths} in {cell}, not {NEW_TOKENS}")
        agreed[cell] = agreement(outputs)
        for _ in range(repeats):
            for e, fn in runs.items():
                time.sleep(settle)
                times[e].append(fn(batch, beam)[0])
        results[cell] = {e: batch * NEW_TOKENS / statistics.median(t) for e, t in times.items()}
        print(cell, {e: round(v, 1) for e, v in results[cell].items()}, "outputs as aiayn fp32's:",
              agreed[cell], file=sys.stderr, flush=True)
    return results, agreed


def by_threads(results: dict, threads: list[int]) -> dict[int, dict]:
    """Split `measure`'s results over engines "NAME@T" into one {cell: {NAME: tok/s}} per thread count T."""
    return {t: {cell: {e.rsplit("@", 1)[0]: v for e, v in r.items() if e.endswith(f"@{t}")}
                for cell, r in results.items()} for t in threads}


def at_best(per_threads: dict[int, dict]) -> tuple[dict, dict]:
    """Each engine at its fastest thread count, cell by cell: ({cell: {NAME: tok/s}}, {cell: {NAME: T}})."""
    first = next(iter(per_threads.values()))
    best = {cell: {e: max(r[cell][e] for r in per_threads.values()) for e in engines}
            for cell, engines in first.items()}
    count = {cell: {e: max(per_threads, key=lambda t: per_threads[t][cell][e]) for e in engines}
             for cell, engines in first.items()}
    return best, count


def table(results: dict, threads: dict | None = None) -> str:
    """Markdown table of tok/s and ratios; with `threads` ({cell: {engine: T}}), each figure's count."""
    engines_ = list(next(iter(results.values())))
    head = "| cell | " + " | ".join(f"{e} tok/s" for e in engines_) + " | aiayn / CT2 fp32 | aiayn / HF |"
    if "aiayn int8" in engines_ and "CT2 int8" in engines_:
        head += " aiayn int8 / CT2 int8 |"
    if COMPILED in engines_ and "CT2 float32" in engines_:
        head += " compiled / CT2 fp32 |"
    if FLOOR in engines_:
        head += " floor / HF |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for cell, r in results.items():
        row = f"| {cell} | " + " | ".join(
            f"{r[e]:.1f}" + (f" ({threads[cell][e]}t)" if threads else "") for e in engines_)
        row += f" | {r['aiayn fp32'] / r['CT2 float32']:.2f}x" if "CT2 float32" in r else " | -"
        row += f" | {r['aiayn fp32'] / r['HF Marian fp32']:.2f}x |"
        if "aiayn int8" in r and "CT2 int8" in r:
            row += f" {r['aiayn int8'] / r['CT2 int8']:.2f}x |"
        if COMPILED in r and "CT2 float32" in r:
            row += f" {r[COMPILED] / r['CT2 float32']:.2f}x |"
        if FLOOR in r:
            row += f" {r[FLOOR] / r['HF Marian fp32']:.2f}x |"
        lines.append(row)
    return "\n".join(lines)


def engine_names(device: str) -> list[str]:
    """The engines to time on `device`: CTranslate2's only where its package (and, on a GPU, its CUDA)
    is there, with one line on stderr when they are skipped."""
    where = torch.device(device)
    on_cpu = where.type == "cpu"
    names = ["aiayn fp32", "HF Marian fp32"] + (["aiayn int8", FLOOR] if on_cpu else [])
    if on_cpu:
        if has_cxx_compiler():
            names.insert(1, COMPILED)
        else:
            print(f"no C++ compiler for torch.compile: {COMPILED} not timed", file=sys.stderr)
    if not peer_available("ctranslate2", "the CTranslate2 engines"):
        return names
    import ctranslate2

    if on_cpu or ctranslate2.get_cuda_device_count() > (where.index or 0):
        names += ["CT2 float32", "CT2 int8"]
    else:
        print(f"CTranslate2 {ctranslate2.__version__} has no CUDA device {where.index or 0} here: not timed",
              file=sys.stderr)
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=thread_counts, default=[1],
                        help="CPU threads for every engine (default 1); a comma list such as 1,2 times every "
                             "engine at each count and also compares each engine at its best count")
    parser.add_argument("--repeats", type=at_least(1), default=3,
                        help="timed runs of every cell by every engine, interleaved; the median is reported "
                             "(default 3)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N); default cpu")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random weights and source sentences (default 0)")
    parser.add_argument("--settle", type=at_least(0.0, float), default=0.5,
                        help="idle seconds before each timed run, so that the previous engine's spinning "
                             "OpenMP threads have stopped (default 0.5)")
    parser.add_argument("--cells", type=cell_names, default=CELLS,
                        help="a comma list of greedy-1, greedy-16, beam4-1, beam4-16 (default all)")
    parser.add_argument("--engines", type=engine_list,
                        help="a comma list of engines to time besides aiayn fp32 and HF Marian fp32, which "
                             "the ratios are taken against (default every one available here): "
                             + ", ".join(ENGINES))
    parser.add_argument("--out", help="results prefix (default benchmarks/results/local/decode_cpu or "
                                      "decode_cuda, ignored by git)")
    parser.add_argument("--force", action="store_true",
                        help="write over files git tracks (committed results)")
    args = parser.parse_args(argv)
    args.device = str(require_device(args.device))
    args.out = Path(args.out) if args.out else LOCAL_RESULTS / f"decode_{torch.device(args.device).type}"
    if not -(2**63) <= args.seed < 2**63:  # torch.manual_seed's range
        parser.error(f"--seed {args.seed}: must be within [-2**63, 2**63)")
    return args  # --out is checked, and its folders made, in `main` once nothing else can refuse the run


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import transformers  # noqa: F401  HuggingFace's model is where every engine's weights come from
    except ImportError:
        raise SystemExit("decode.py needs transformers: pip install -e '.[bench]'") from None
    names = chosen_engines(args)  # an engine not here (CT2 without ctranslate2): said before any work
    # last of the checks, as it makes --out's folders (a refused run left them), and before the timing
    check_out(args.out, [with_suffix_added(args.out, s) for s in (".json", ".md")], args.force)
    torch.set_num_threads(args.threads[0])  # the workers set theirs; this keeps the recorded environment true
    env = environment(args.device)  # before the timing: the load average is the machine's, not this run's
    hf = build_hf(args.seed)
    diff = check_same_logits(hf, build_aiayn(hf), sources(args.seed)[:4])
    weights_mb = sum(p.numel() * p.element_size() for p in hf.parameters()) / 1e6  # float32, tied once
    ct2 = sys.modules.get("ctranslate2")  # imported by `engine_names` if it is installed
    env.update(ctranslate2=ct2.__version__ if ct2 else None, threads=args.threads, device=args.device,
               repeats=args.repeats, settle_s=args.settle, max_abs_logit_diff_vs_hf=diff,
               processes="one per engine and thread count", float32_weights_mb=round(weights_mb),
               command=command_line(__file__, argv))
    record = Record(env, weights_mb)
    with tempfile.TemporaryDirectory() as tmp:
        names, ct2_paths = converted(hf, Path(tmp), names, record)
        del hf
        runs = {f"{n}@{t}": Engine(n, args.seed, args.device, ct2_paths, t)
                for t in args.threads for n in names}
        try:
            run_cells(runs, args, record)
        except WorkerFailed as e:
            raise SystemExit(stopped(args, record, e)) from None
        finally:
            for engine in runs.values():
                engine.close()
    print(write_results(args, record))
    print(f"resident MB after the runs: {record.memory} (float32 weights: {weights_mb:.0f} MB)")


REFERENCES = ("aiayn fp32", "HF Marian fp32")  # the engines the ratios are taken against: always run


def converted(hf, workdir: Path, names: list[str], record: Record) -> tuple[list[str], dict[str, str]]:
    """`names`, and the CTranslate2 models (`convert_ct2`) for those of them that are CTranslate2's. A
    conversion that fails leaves them out as a failing worker leaves its engine (`left_out`): in one line,
    its error in the results, the others timed (it was a traceback, and no figure at all)."""
    ct2 = [name for name in names if name.startswith("CT2 ")]  # "CT2 int8" alone was not converted
    if not ct2:
        return names, {}
    try:
        return names, convert_ct2(hf, workdir)
    except Exception as e:  # noqa: BLE001  whatever the converter raises (a transformers it does not know)
        why = f"CTranslate2's model conversion failed: {last_line(e)}"
    record.failed.update({name: f"{name}: {why}" for name in ct2})
    print(f"decode.py: {why}; {' and '.join(ct2)} {'are' if len(ct2) > 1 else 'is'} left out of this run",
          file=sys.stderr, flush=True)
    return [name for name in names if name not in ct2], {}


def chosen_engines(args: argparse.Namespace) -> list[str]:
    """`engine_names` here, cut to --engines (and the two the ratios are taken against)."""
    names = engine_names(args.device)
    if args.engines:
        unknown = sorted(set(args.engines) - set(names))
        if unknown:
            raise SystemExit(f"--engines: {', '.join(unknown)} not among those here: {', '.join(names)}")
        names = [n for n in names if n in args.engines or n in REFERENCES]
    return names


@dataclass
class Record:
    """What a run has measured so far, written after every cell."""

    env: dict  # `environment()` and the run's settings
    weights_mb: float  # the float32 weights, tied embedding counted once
    speeds: dict = field(default_factory=dict)  # {cell: {"engine@threads": tok/s}}
    agreed: dict = field(default_factory=dict)  # {cell: {"engine@threads": share}}, `agreement`
    memory: dict | None = None  # {"engine@threads": resident MB}, taken after the last cell
    floor_kernel: dict = field(default_factory=dict)  # {threads: {rows: kernel}}
    failed: dict = field(default_factory=dict)  # {engine: its WorkerFailed's line}, those `left_out`
    stopped: str | None = None  # why the run ended before every cell, if it did


def run_cells(runs: dict[str, Engine], args: argparse.Namespace, record: Record) -> None:
    """Every cell of --cells, the results written after each (as train_step.py does after each config):
    a worker failing in a later cell leaves the earlier ones on disk. Then each worker's memory. An engine
    other than `REFERENCES` that fails is left out (`left_out`) and the cell it failed in is run again
    without it; a failure of one of `REFERENCES` is raised."""
    kept = set()
    for key, engine in list(runs.items()):
        try:
            if key in runs:  # not left out already, having failed at another thread count
                engine.wait_ready()
                kept.add(engine.keeps_freed_memory())
        except WorkerFailed as e:
            left_out(runs, record, e)
    if kept:  # each worker's keep_freed_memory(): one answer, as they share the platform and variables
        record.env["keeps_freed_memory"] = kept.pop() if len(kept) == 1 else "in some workers only"
    for cell in args.cells:
        while True:
            try:
                speeds, agreed = measure(runs, args.repeats, args.settle, [cell])
                break
            except WorkerFailed as e:
                left_out(runs, record, e)
        record.speeds.update(speeds)
        record.agreed.update(agreed)
        write_results(args, record)
    record.memory = {key: round(e.memory_mb()) for key, e in runs.items() if not key.startswith(FLOOR)}
    record.floor_kernel = {t: runs[f"{FLOOR}@{t}"].kernels() for t in args.threads if f"{FLOOR}@{t}" in runs}


def left_out(runs: dict[str, Engine], record: Record, error: WorkerFailed) -> None:
    """The engine whose worker raised `error` out of the run: its workers at every thread count closed and
    taken from `runs`, its figures from the cells before dropped (every table then has the same columns),
    its error recorded and said on stderr. Raises `error` if the engine is one of `REFERENCES`."""
    name = next(key for key, engine in runs.items() if engine is error.engine).rsplit("@", 1)[0]
    if name in REFERENCES:
        raise error
    for key in [key for key in runs if key.rsplit("@", 1)[0] == name]:  # "NAME@THREADS"
        runs.pop(key).close()
        for figures in (*record.speeds.values(), *record.agreed.values()):
            figures.pop(key, None)
    record.failed[name] = str(error)
    print(f"decode.py: {error}; {name} is left out of this run", file=sys.stderr, flush=True)


def stopped(args: argparse.Namespace, record: Record, error: WorkerFailed) -> str:
    """The one line a failed worker ends the run with; the cells measured before it are written again,
    saying where the run stopped."""
    record.stopped = str(error)
    if not record.speeds:
        return f"decode.py: {record.stopped}; no cell was measured, nothing written"
    write_results(args, record)
    return (f"decode.py: {record.stopped}; the {len(record.speeds)} cell(s) measured before it are in "
            f"{with_suffix_added(args.out, '.{json,md}')}")


def write_results(args: argparse.Namespace, record: Record) -> str:
    """Write OUT.json and OUT.md from what `record` holds; returns the tables and verdicts."""
    per_threads = by_threads(record.speeds, args.threads)
    sections = []
    if len(args.threads) > 1:
        best, count = at_best(per_threads)
        sections.append(("Each engine at its best thread count (in brackets)", table(best, count), best))
    sections += [(f"{t} thread{'s' if t > 1 else ''}", table(r), r) for t, r in per_threads.items()]
    text = "\n\n".join(f"## {title}\n\n{tab}\n\n{verdict(r)}" for title, tab, r in sections)
    env = {**record.env, "outputs_as_aiayn_fp32": record.agreed,
           "linear_floor_kernel_by_threads_and_rows": record.floor_kernel,
           "load_average_after": load_average()}
    if record.failed:
        env["failed_engines"] = record.failed
    if record.stopped:
        env["stopped"] = record.stopped
    memory = "not measured (taken after the last cell)" if record.memory is None else record.memory
    saved = {"environment": env, "tokens_per_second_by_threads": per_threads,
             "resident_mb_after_runs": memory}
    with_suffix_added(args.out, ".json").write_text(json.dumps(saved, indent=2) + "\n")
    stop = f"**Stopped: {record.stopped}.** Only the cells below were measured.\n\n" if record.stopped else ""
    stop += "".join(f"**Left out: {why}.**\n\n" for why in record.failed.values())
    with_suffix_added(args.out, ".md").write_text(
        f"# Decoding speed, {args.device}\n\n`{env['command']}`\n\n{stop}{text}\n\n"
        f"Share of sentences each float32 engine translated as aiayn fp32 did (per cell): {record.agreed}\n\n"
        f"Resident memory of each engine's process (@ thread count) after the runs, MB (freed heap returned "
        f"first; every process also holds the libraries it loaded; the float32 weights are "
        f"{record.weights_mb:.0f} MB): {memory}\n\n"
        f"Environment: `{json.dumps(env)}`\n")
    return text


def verdict(results: dict) -> str:
    """The issue's bar, cell by cell: aiayn fp32 >= CTranslate2 float32 everywhere, >= 2x HF at batch 1;
    the same for aiayn with its one-row steps compiled, where it was timed."""
    lines = []
    for cell, r in results.items():
        checks = []
        for engine in ("aiayn fp32", COMPILED):
            if engine not in r:
                continue
            name = "" if engine == "aiayn fp32" else "compiled "
            if "CT2 float32" in r:
                checks.append((f"{name}vs CT2 float32 >= 1", r[engine] / r["CT2 float32"], 1.0))
            if cell.endswith("batch 1"):
                checks.append((f"{name}vs HF >= 2", r[engine] / r["HF Marian fp32"], 2.0))
        lines += [f"- {cell}: {name}: {ratio:.2f}x, {'met' if ratio >= bar else 'NOT met'}"
                  for name, ratio, bar in checks]
        if FLOOR in r and cell.endswith("batch 1"):
            lines.append(f"  - the Linear products alone run at {r[FLOOR] / r['HF Marian fp32']:.2f}x HF here: "
                         f"no float32 engine calling these kernels can be faster than that")
            faster = [e for e in ("aiayn fp32", COMPILED) if r.get(e, 0.0) > r[FLOOR]]
            if faster:  # the bound cannot be beaten: the machine's speed changed between the runs
                lines.append(f"  - but {' and '.join(faster)} read faster than the floor in this run: its "
                             "timings are noisy, and this bound did not hold in it")
    return "Bar:\n" + "\n".join(lines)


if __name__ == "__main__":
    main()

"""Translating text with a checkpoint, from Python in two lines:

    from aiayn.translate import Translator
    Translator.load("runs/base/average_last_5").translate(["A man rides a bike."], beam=4)

Sentences are sorted by length and cut into batches of about `max_tokens` source tokens (times the
beam), so that little padding is computed; the results come back in input order. Empty (or blank)
lines translate to empty strings without touching the model.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import itertools
import logging
import math
import numbers
import os
import select
import stat
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterable, Iterator, Sequence, TextIO

import torch

from aiayn.checkpoint import inference_device, vocabulary_problem
from aiayn.config import DEFAULT_MAX_TOKENS, ConfigError, from_dict
from aiayn.data.batching import right_pad
from aiayn.data.dataset import has_text
from aiayn.data.lines import (
    HEAD_BYTES,
    InnerCRs,
    cr_only,
    cr_only_error,
    invalid_utf8,
    lone_cr_count,
    nul_byte,
    require_same_count,
    whole_characters,
)
from aiayn.data.tokenizer import Tokenizer
from aiayn.decoding import DecodeConfig, Ensemble, generate
from aiayn.decoding.compiled import check_cxx_compiler, compile_one_row_step
from aiayn.decoding.cpu import (
    count_packed, fold_logits_bias, linear_parameters, pack_for_cpu, pack_int8_for_amx,
)
from aiayn.decoding.ensemble import SHARED_FIELDS, vocabularies
from aiayn.decoding.options import SAMPLING_ONLY, check_decode_config
from aiayn.decoding.score import force_decode
from aiayn.decoding.search import sampling_generator
from aiayn.errors import (
    OutOfMemory, SentenceTooLong, TextError, UserError, check_unicode, is_out_of_memory, str_list,
)
from aiayn.files import raise_dropped_stop
from aiayn.memory import cap_kernel_caches
from aiayn.model import Transformer
from aiayn.train.progress import throttled_progress

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from aiayn.checkpoint import Checkpoint


@dataclass(frozen=True)
class Translation:
    """One hypothesis for one input line."""

    text: str  # detokenized output
    score: float  # log_prob / lp(|Y|): what beam search ranked by (samples come in the order drawn)
    tokens: list[int]  # output ids (EOS included when the search produced it)
    # log P(tokens | source), the sum of the tokens' log-probabilities as the search saw them: padding
    # excluded, EOS included when produced, an ensemble's mean of its members' probabilities at each step, and with
    # sampling the model's own, before temperature, top-k and top-p
    log_prob: float


@dataclass(frozen=True)
class Scored:
    """log P(target | source) of one given pair (`Translator.score`)."""

    log_prob: float  # the sum of the target's token log-probabilities, its EOS included
    tokens: int  # how many: the target's pieces and its EOS

    @property
    def per_token(self) -> float:
        return self.log_prob / self.tokens


def decode_config(base: DecodeConfig | None = None, **options: Any) -> DecodeConfig:
    """`base` (or the paper's defaults) with `options` replaced; an unknown option raises ConfigError.
    `sample=True` without a `beam` means beam 1, as `--sample` does: sampling has no beam, and the
    default beam 4 would make it a contradiction (an explicit beam other than 1 still is). Likewise a
    sampling `base` and `sample=False`, or a beam above 1 without `sample`, mean a search: the sampling
    fields the call did not give go back to their defaults (a search refuses them). Settings of `base`
    that the call did not give give way to those it did, whichever way it turns: a search's `n_best`
    is capped at the beam (a sampling base's number of samples, a wider base search's hypotheses), and
    `early_stopping` is dropped at beam 1 (greedy search or sampling: no beam to stop). A contradiction
    among the call's own options is still refused."""
    base = base or DecodeConfig()
    if options.get("sample") is True and "beam" not in options:
        options["beam"] = 1
    beam = options.get("beam", base.beam)
    wider = isinstance(beam, int) and beam > 1 and "sample" not in options
    inherited: dict[str, Any] = {}
    if base.sample and (options.get("sample") is False or wider):
        inherited = {"sample": False, **SAMPLING_ONLY}
    if isinstance(beam, int) and not isinstance(beam, bool):  # else from_dict names the wrong type
        if not options.get("sample", inherited.get("sample", base.sample)):  # samples are not bounded by beam
            inherited["n_best"] = max(1, min(base.n_best, beam))
        if beam == 1:
            inherited["early_stopping"] = False
    return from_dict(DecodeConfig, {**dataclasses.asdict(base), **inherited, **options})


def text_list(texts: Iterable[str], name: str = "texts") -> list[str]:
    """`texts` as a list (a generator is read once), each item checked to be a str that UTF-8 can encode;
    errors name the argument `name` ("targets": "targets[0] is int", "target 1: not valid Unicode")."""
    one = name.removesuffix("s")
    texts = str_list(texts, name, "strings", one)
    for i, text in enumerate(texts):
        check_unicode(text, f"{one} {i + 1}")
    return texts


def check_count(name: str, value: Any) -> None:
    """A count the caller gives (`max_tokens`, `chunk`) must be a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a whole number, not {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{name}={value} must be at least 1")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_refused(dtype: str | torch.dtype) -> str:
    """A dtype that int8 or compile cannot take, as the library and `--dtype` name it: "dtype bfloat16
    (--dtype bfloat16)" for "bfloat16" and torch.bfloat16 alike (the int8 refusal said "dtype 'bfloat16'",
    naming no flag, and "torch.bfloat16")."""
    name = next((n for n, d in DTYPES.items() if d == dtype), dtype)
    return f"dtype {name} (--dtype {name})"


def inference_dtype(dtype: str | torch.dtype, device: torch.device, int8: bool = False) -> torch.dtype:
    """The weights' dtype for decoding: float32 (the default), bfloat16, or float16 on a GPU; a name or
    a torch dtype. Anything else, or a combination that cannot run, is a UserError."""
    parsed = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if parsed not in DTYPES.values():
        raise UserError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if int8 and parsed != torch.float32:
        raise UserError(f"int8 (--int8) quantizes float32 weights, not {_dtype_refused(dtype)}: drop one")
    if parsed == torch.float16 and device.type == "cpu":  # most CPUs emulate it, many times slower
        raise UserError("dtype float16 is for GPUs; on a CPU use bfloat16 (fast with AVX-512 BF16 or AMX)")
    return parsed


def length_sorted_batches(
    lengths: Sequence[int], max_tokens: int, rows_per_sentence: int = 1
) -> Iterator[list[int]]:
    """Indices of `lengths`, shortest first, in batches whose padded size (longest x sentences x rows per
    sentence) stays within `max_tokens`; a sentence longer than the budget gets a batch of its own."""
    batch: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if batch and lengths[i] * (len(batch) + 1) * rows_per_sentence > max_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def quantize_int8(model: Transformer, in_place: bool = False) -> Transformer:
    """Dynamic int8 quantization of every Linear layer (weights int8, activations quantized per call):
    a CPU-only speed-up. The embeddings stay in float; the tied output projection gets its own int8 copy.
    A copy of `model`, or with `in_place` `model` itself quantized (no second float copy at once)."""
    quantize = getattr(getattr(torch.ao, "quantization", None), "quantize_dynamic", None)
    if quantize is None:  # deprecated for torchao (its warning names 2.10 for removal): an AttributeError
        raise UserError(f"int8 (--int8) uses torch.ao.quantization.quantize_dynamic, which PyTorch "
                        f"{torch.__version__} no longer has; drop --int8")
    counts = linear_parameters(model)  # the parameters the int8 Linears stand for, which are none
    with warnings.catch_warnings():  # torch.ao's eager quantization is deprecated for torchao, still works
        warnings.simplefilter("ignore", (DeprecationWarning, UserWarning))
        quantized = quantize(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=in_place)
    quantized.eval()  # for decoding only: its new modules start in training mode
    fold_logits_bias(quantized)  # on the copy, unless in place
    quantized = pack_int8_for_amx(quantized)
    count_packed(quantized, counts)
    return quantized


def check_compile(device: torch.device, dtype: str | torch.dtype, int8: bool, models: int = 1) -> None:
    """`compile` compiles one float32 model's decoder step on the CPU; anything else is a UserError that
    names what is not (the dtype as `--dtype` spells it)."""
    if device.type != "cpu":
        raise UserError(f"compile (--compile) compiles the decoder step on the CPU, not on {device}: "
                        "drop one")
    if int8:
        raise UserError("compile (--compile) decodes float32 weights, not int8 (--int8): drop one")
    if dtype not in ("float32", torch.float32):
        raise UserError(f"compile (--compile) decodes float32 weights, not {_dtype_refused(dtype)}: drop one")
    if models > 1:
        raise UserError("compile (--compile) decodes one model: drop it to decode an ensemble")
    check_cxx_compiler()  # before the checkpoint loads, not after


def prepare_for_inference(model: Transformer, int8: bool = False, compile: bool = False,
                          own: bool = False) -> Transformer:
    """The fastest equivalent of `model` for decoding: on a CPU, Linear layers prepacked for oneDNN
    (same float32 function) or, with `int8`, dynamically quantized; elsewhere the model itself. With
    `compile` (a float32 model on the CPU), also the decoder step of one row compiled, now
    (`aiayn.decoding.compiled`); a UserError otherwise. `own`: the caller gives `model` away, which is
    then packed in place rather than copied (a `base`-sized checkpoint loaded at a peak 197 MB lower)."""
    cap_kernel_caches()  # before the first oneDNN kernel: every batch and beam size is a new shape
    weight = model.tgt_embed.embed.weight
    if compile:
        check_compile(weight.device, weight.dtype, int8)
    if int8:
        return quantize_int8(model, in_place=own)
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return model
    packed = pack_for_cpu(model, in_place=own)
    if compile:  # on a copy: without oneDNN packing, `pack_for_cpu` returns the caller's model itself
        return compile_one_row_step(packed if packed is not model or own else copy.deepcopy(model))
    return packed


def check_translator_parts(model: Any, tokenizer: Any, config: Any) -> None:
    """Translator's arguments, of the types it takes: None or a dict config was taken, then failed at the
    first translation, with an AttributeError ("'dict' object has no attribute 'beam'")."""
    if not isinstance(getattr(model, "_orig_mod", model), (Transformer, Ensemble)):  # torch.compile's too
        raise TypeError(f"Translator takes a Transformer (or an Ensemble), not {type(model).__name__}: "
                        "load_checkpoint(path).model, or Translator.load(path) for model and tokenizer")
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"Translator takes the model's Tokenizer, not {type(tokenizer).__name__}: "
                        "load_checkpoint(path).tokenizer, Tokenizer(spm_model_path), or Translator.load(path)")
    if config is not None:
        check_decode_config(config, "Translator")


class Translator:
    """A model and its tokenizer, ready to translate lists of strings.

    Safe to share between threads (each call has its own cache and generator). Loading caps oneDNN's
    kernel caches (`aiayn.memory.cap_kernel_caches`: two environment variables, which subprocesses
    inherit); otherwise it leaves the process as it found it: `aiayn translate` also makes glibc keep
    freed memory for reuse (`aiayn.memory.keep_freed_memory`), which changes malloc for the whole
    process, so a program that wants that calls it itself."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, config: DecodeConfig | None = None):
        """Translate with `model` itself (no copy), in eval mode: a model in training mode is switched,
        and said to be, since a training loop that goes on with it would go on without dropout. A
        `tokenizer` whose ids do not fit the model (`aiayn.checkpoint.vocabulary_problem`) is a UserError."""
        check_translator_parts(model, tokenizer, config)
        problem = vocabulary_problem(model.config, tokenizer)
        if problem:  # more pieces than embeddings failed in their lookup (an IndexError); another pad or EOS
            # id padded and stopped with ids the model does not mask or stop at, silently
            raise UserError(f"Translator: {problem}")
        members = model.members if isinstance(model, Ensemble) else [model]  # a new Ensemble is in training
        # mode, its members not; Monte Carlo dropout (the model in eval mode, its Dropout on) is no training
        if any(m.training for m in members):  # a check in the middle of the caller's training: switched
            # silently
            log.warning("Translator: the model was in training mode and is now in eval mode (no dropout); "
                        "call model.train() before training it further")
            model.eval()
        model.training = False  # an Ensemble's own flag; dropout switched on by hand stays (as in generate)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or DecodeConfig()  # defaults for every call; options override per call
        self.device = next(model.parameters()).device

    def __repr__(self) -> str:
        members = self.model.members if isinstance(self.model, Ensemble) else [self.model]
        c = members[0].config
        model = (f"{len(members)} models" if len(members) > 1
                 else f"d_model={c.d_model}, layers={c.n_layers}+{c.decoder_layers}")
        dtype = next(self.model.parameters()).dtype
        return f"Translator({model}, {self.tokenizer}, {self.device}, {dtype}, beam={self.config.beam})"

    @classmethod
    def load(
        cls, checkpoint: str | Path | Sequence[str | Path], device: str | torch.device = "cpu", int8: bool = False,
        dtype: str | torch.dtype = "float32", compile: bool = False,
    ) -> "Translator":
        """A checkpoint directory (a training checkpoint, an averaged or an imported one), or several
        with the same tokenizer, decoded as an ensemble (their probabilities averaged).

        `compile` (one float32 model on the CPU) compiles the decoder step of one sentence with
        torch.compile while loading (10-40 s, said first on the `aiayn.decoding.compiled` logger, INFO):
        greedy search or sampling of one text at a time, a service's requests, measured from 4% slower
        to 22% faster on a 2-core CPU (the README; `aiayn.decoding.compiled`). Batches of several
        texts, and beam search, decode as without it, and so does everything after a
        `torch.set_num_threads` to another count than the loading's (nothing compiles after loading).

        `dtype` "bfloat16" (or "float16" on a GPU) casts the weights, and with them the activations and
        the decoding cache: faster, and a few translations in a hundred come out otherwise (Multi30k
        val, a `small` en-de model, beam 4: 969 of 1,014 lines the same, BLEU 39.61 against 39.77), and
        a text's translation can depend on the texts batched with it (`hypotheses`). Scores and search run
        in float32 either way.

        The translator's `model` is made for decoding: on the CPU in float32 its Linear weights are packed
        for oneDNN (`aiayn.decoding.cpu.PackedLinear`), with `int8` quantized. It decodes, scores and
        counts its parameters as the checkpoint's model does, but neither saves (`save_checkpoint`), and of
        a float32 one packed for oneDNN a forward that would take gradients, a cast to another dtype or
        device, a copy or a pickle is a RuntimeError (an int8 one takes no gradients either, and fails in
        its next translation after a cast): train, fine-tune, cast or save `load_checkpoint(path).model`."""
        from aiayn.checkpoint import load_checkpoint

        for name, flag in (("int8", int8), ("compile", compile)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, not {type(flag).__name__} ({flag!r})")
        device = inference_device(device, int8)  # before the loading, which can take a while
        one = isinstance(checkpoint, (str, bytes, os.PathLike))  # a path, else several
        if not one and not isinstance(checkpoint, Iterable):  # None: "'NoneType' object is not iterable"
            raise TypeError(f"checkpoint is {type(checkpoint).__name__}: a checkpoint directory's path, or "
                            "several for an ensemble")
        paths = [os.fsdecode(checkpoint)] if one else [os.fsdecode(p) for p in checkpoint]
        if not paths:
            raise ValueError("no checkpoint given: pass a checkpoint directory, or several for an ensemble")
        if compile:  # before the dtype's own checks, whose advice (bfloat16 on a CPU) it would refuse
            check_compile(device, dtype, int8, len(paths))
        dtype = inference_dtype(dtype, device, int8)
        ckpts = [load_checkpoint(p, device, dtype) for p in paths]
        check_ensemble(paths, ckpts)
        models = [prepare_for_inference(ck.model, int8, compile, own=True) for ck in ckpts]  # fp32 packing
        return cls(models[0] if len(models) == 1 else Ensemble(models).eval(), ckpts[0].tokenizer)

    def decode_config(self, **options: Any) -> DecodeConfig:
        """This translator's `DecodeConfig` with `options`, checked against the model too: a `min_len` past
        its output positions would cut every output without EOS (whatever max_len_a makes of a source).
        EOS may come after min_len tokens, as token min_len + 1: a min_len equal to the limit, which
        `DecodeConfig` allows for forcing lengths, would give text without its end, and is refused too."""
        config = decode_config(self.config, **options)
        if config.min_len >= self.model.config.max_len:
            raise ConfigError(f"min_len={config.min_len} leaves no room for EOS in the "
                              f"{self.model.config.max_len} output positions of this model")
        if config.max_len_a == 0 and config.min_len >= config.max_len_b:
            raise ConfigError(f"min_len={config.min_len} leaves no room for EOS in the max_len_b="
                              f"{config.max_len_b} tokens that max_len_a={config.max_len_a} allows")
        return config

    def translate(
        self, texts: Iterable[str], max_tokens: int = DEFAULT_MAX_TOKENS, **options: Any
    ) -> list[str]:
        """The best translation of each text, in input order. `options` are `DecodeConfig` fields
        (`sample=True` alone means beam 1); with `sample` and `seed`, one generator seeded once draws the
        whole call, so that the same texts and options give the same output and repeated texts get
        independent samples."""
        return [hyps[0].text if hyps else "" for hyps in self.hypotheses(texts, max_tokens, **options)]

    def hypotheses(
        self, texts: Iterable[str], max_tokens: int = DEFAULT_MAX_TOKENS,
        progress: Callable[[int], None] | None = None, generator: torch.Generator | None = None,
        **options: Any,
    ) -> list[list[Translation]]:
        """The `n_best` translations of each text, best first (samples: in the order drawn); an empty
        list for a text of no pieces (empty, blank, or only zero-width and control characters).
        `progress(n)` is called after each batch with the number of texts it held. With `sample`, the
        tokens are drawn from `generator` (which then takes the place of `seed`), or from one seeded once
        for this call (not once per batch). Batches are length-sorted, so which sample a text gets also
        depends on the other texts and on `max_tokens`; searches do not in float32, but do on int8
        weights, whose activations are quantized with one scale per batch, and in bfloat16 or float16,
        whose attention PyTorch rounds otherwise beside a longer text's padding (a tiny demo model's
        encoder outputs moved by 0.016; greedy, 2 of 80 texts came out otherwise alone)."""
        return self._hypotheses(texts, max_tokens, progress, generator, options)

    def _hypotheses(
        self, texts: Iterable[str], max_tokens: int, progress: Callable[[int], None] | None,
        generator: torch.Generator | None, options: dict[str, Any],
        say_cut: Callable[[DecodeConfig, list[str], list[int]], None] | None = None,
    ) -> list[list[Translation]]:
        """`hypotheses`; `say_cut(config, texts, cut)` is told the indices of the texts that `min_len` cuts
        (`cut_by_min_len`), in place of a warning each call: a stream says it once."""
        config = self.decode_config(**options)
        texts = text_list(texts)
        check_count("max_tokens", max_tokens)
        if generator is not None and not config.sample:
            raise ValueError("generator is used only with sample=True")
        if config.sample and generator is None:
            generator = sampling_generator(config, self.device)
        ids = self.source_ids(texts)  # checked before any batch: a stream's output stays whole up to here
        out: list[list[Translation]] = [[] for _ in texts]
        todo = [i for i, s in enumerate(ids) if s]
        cut = [todo[j] for j in self.cut_by_min_len(config, [len(ids[i]) for i in todo])]
        if cut and say_cut is not None:
            say_cut(config, texts, cut)
        elif cut:
            first = texts[cut[0]][:40]
            log.warning(cut_by_min_len_warning(config), f"{len(cut)} text(s), the first {first!r}")
        rows = config.n_best if config.sample else config.beam
        for batch in length_sorted_batches([len(ids[i]) for i in todo], max_tokens, rows):
            chosen = [todo[j] for j in batch]
            src = right_pad([ids[i] for i in chosen], self.tokenizer.pad_id).to(self.device)  # (B, S)
            with self._batch(chosen, beam=config.beam, samples=config.n_best if config.sample else 0):
                found = generate(self.model, src, config, generator)
            for i, hyps in zip(chosen, found):
                out[i] = [Translation(self.tokenizer.decode_tgt(h.tokens), h.score, h.tokens, h.log_prob)
                          for h in hyps]
            if progress is not None:
                progress(len(chosen))
        if progress is not None and len(todo) < len(texts):
            progress(len(texts) - len(todo))  # the empty lines, done without the model
        return out

    def cut_by_min_len(self, config: DecodeConfig, lengths: list[int]) -> list[int]:
        """Which of these source lengths leave `min_len` no room for EOS. With max_len_a, the length limit is
        each sentence's own: `decode_config` cannot refuse such a min_len, and every such output came out
        cut, without EOS, silently."""
        if not config.min_len or not config.max_len_a:
            return []
        limits = config.max_lengths(lengths, self.model.config.max_len)
        return [i for i, limit in enumerate(limits) if limit <= config.min_len]

    @contextmanager
    def _batch(self, chosen: list[int], **oom: Any) -> Iterator[None]:
        """Decoding one batch of the texts `chosen`: without the caller's autocast (the weights are packed
        fp32 or int8 here), and out of memory as an `OutOfMemory` naming its first text (`oom`: that
        error's beam, samples or scoring), not a C++ traceback (--beam 100000000: a 54 GB tensor)."""
        try:
            with torch.autocast(self.device.type, enabled=False):
                yield
        except (RuntimeError, MemoryError) as e:
            if not is_out_of_memory(e):
                raise
            raise OutOfMemory(min(chosen), len(chosen), **oom) from None

    def source_ids(self, texts: list[str]) -> list[list[int]]:
        """The ids `hypotheses` translates, each checked for length (a `SentenceTooLong` indexed in `texts`,
        with the others too long): `aiayn translate` checks a whole file so before translating any of it."""
        # A text of no pieces (blank, or only characters the tokenizer drops: a zero-width space, a BOM)
        # is EOS alone, from which a model makes up a sentence: it gets no translation, as an empty line
        ids = [self.tokenizer.encode_src(t) if has_text(t) else [] for t in texts]  # as training sees them
        ids = [s if len(s) > 1 else [] for s in ids]
        self._check_lengths(ids)
        return ids

    def side_ids(self, texts: list[str], side: str) -> list[list[int]]:
        """The ids `score` reads for one side of its pairs ("source", or "target" with its EOS), each checked
        for length (a `SentenceTooLong` indexed in `texts`, with the others too long): `aiayn score` checks
        whole files so."""
        if side == "source":
            ids = [self.tokenizer.encode_src(t) for t in texts]
        else:
            ids = [self.tokenizer.encode_tgt(t) + [self.tokenizer.eos_id] for t in texts]
        self._check_lengths(ids, side)
        return ids

    def _check_lengths(self, ids: list[list[int]], side: str | None = None) -> None:
        """Texts of more ids than the model has positions (an ensemble: its shortest member's) are a
        `SentenceTooLong` naming the first and counting the others; `side` names which text of a scored
        pair."""
        limit = self.model.config.max_len
        too_long = [i for i, s in enumerate(ids) if len(s) > limit]
        if too_long:
            first = too_long[0]
            model = "the ensemble's shortest model" if isinstance(self.model, Ensemble) else "this model"
            where = None if side is None else f"text {first + 1} ({side})"
            raise SentenceTooLong(first, len(ids[first]), limit, where, model, side or "source", too_long[1:])

    def score(
        self, sources: Iterable[str], targets: Iterable[str], max_tokens: int = DEFAULT_MAX_TOKENS,
        progress: Callable[[int], None] | None = None,
    ) -> list[Scored]:
        """log P(target | source) of each pair under the model (an ensemble: its members' mean probability at
        each step), the target's EOS included: forced decoding through the searches' own steps
        (`aiayn.decoding.score`), so a translation this translator found scores here its `log_prob` when the
        tokenizer splits its text into the pieces the search chose (when the search ended it with EOS: one cut
        at the limit of `max_len_a` and `max_len_b` has none, and the score adds its log P, but one cut at the
        model's positions, which it fills, cannot be scored, its EOS having no position left (a
        `SentenceTooLong`); without `min_len`, which changes the probabilities the search sees; and not with
        `int8`, whose dynamic quantization scales the rows of each step together: a beam's K rows and a forced
        decoding's one differ, by 0.03 nats a sentence on average and 0.11 at most on a small demo model; nor
        in bfloat16 or float16, which round a text by the padding of the texts batched with it, as
        `hypotheses` says, and `score` batches otherwise than the search: up to 0.049 nats apart on a tiny
        demo model at beam 4, against 4e-6 in float32). Every pair is scored, an empty side too (then EOS
        alone). `progress(n)` as in `hypotheses`."""
        sources, targets = text_list(sources, "sources"), text_list(targets, "targets")
        check_count("max_tokens", max_tokens)
        if len(sources) != len(targets):
            raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
        src_ids = self.side_ids(sources, "source")  # both checked before any batch, as `hypotheses`
        tgt_ids = self.side_ids(targets, "target")
        out: list[Scored] = [Scored(0.0, 0)] * len(sources)
        lengths = [max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)]  # encoder or decoder: the longer
        for chosen in length_sorted_batches(lengths, max_tokens):
            src = right_pad([src_ids[i] for i in chosen], self.tokenizer.pad_id).to(self.device)  # (B, S)
            with self._batch(chosen, beam=1, scoring=True):
                found = force_decode(self.model, src, [tgt_ids[i] for i in chosen])
            for i, log_prob in zip(chosen, found):
                out[i] = Scored(log_prob, len(tgt_ids[i]))
            if progress is not None:
                progress(len(chosen))
        return out


def check_ensemble(paths: Sequence[str | Path], ckpts: Sequence[Checkpoint]) -> None:
    """Every member must share the first's vocabulary and special ids, or their probabilities mix
    different tokens; a UserError names the member that differs."""
    first = ckpts[0].model.config
    for path, ck in zip(paths[1:], ckpts[1:]):
        # shared (tgt_vocab_size None) against separate, of one size or not: "differs in tgt_vocab_size"
        # said nothing of which, and None is no size
        if (ck.model.config.tgt_vocab_size is None) != (first.tgt_vocab_size is None):
            raise UserError(f"{path}: has {vocabularies(ck.model.config)}, {paths[0]} "
                            f"{vocabularies(first)}; an ensemble's models must agree on the vocabulary")
        # the ids first: a tokenizer's comparison includes its BOS, which is a Marian model's decoder start,
        # so two Marian models with one vocabulary and other start ids were said to differ in vocabulary
        differ = [f for f in SHARED_FIELDS if getattr(ck.model.config, f) != getattr(first, f)]
        if differ:
            raise UserError(f"{path}: differs from {paths[0]} in {', '.join(differ)}; an ensemble's "
                            "models must agree on the vocabulary and its special ids")
        if not ck.tokenizer.same_as(ckpts[0].tokenizer):
            raise UserError(f"{path}: its tokenizer differs from {paths[0]}'s; an ensemble needs one vocabulary")


def translate(checkpoint: str | Path, texts: Iterable[str], **options: Any) -> list[str]:
    """One call: load `checkpoint` and translate `texts` (`DecodeConfig` fields as options)."""
    return Translator.load(checkpoint).translate(texts, **options)


def read_utf8_lines(
    stream: BinaryIO, name: str, chunk: int, whole_chunks: bool = False, done: str = "translated"
) -> Iterator[list[str]]:
    """Lines of a binary stream, decoded, without newlines, in lists of up to `chunk` lines; a bad
    byte sequence or a NUL byte is a `UserError` naming NAME:LINE, raised once the lines before it are
    yielded. From a pipe, a list also ends where
    the input stalls, so that a slow writer gets each answer before it sends more; with `whole_chunks`
    it does not (every list but the last holds `chunk` lines), so that the lists do not depend on timing.
    CRs inside lines are warned about at the end of the input, once a file (`InnerCRs.warn`: a file checked
    and then translated, or scored on both sides, is said once), as what is `done` with the lines
    ("translated", "scored"), as training and evaluate warn."""
    lines: list[str] = []
    head = bytearray()  # the first bytes read, which say what input that is no UTF-8 text is (gzip, UTF-16)
    lone = 0  # CRs alone in the first line, while it is all there is
    inner_crs = InnerCRs()
    for n, (raw, more) in enumerate(_raw_lines(stream, name, head), 1):
        text, bad = _decoded(raw, name, n, head)
        if bad is not None:
            # a pipe's lines before it, as a too long line's: translated and written first, so that a rerun
            # from the line named loses none (they were lost with their chunk); a first line held for its CRs
            # too, a second line, bad or not, telling it from a one-line classic Mac file
            for i in range(0, len(lines), chunk):
                yield lines[i : i + chunk]
            raise bad
        if n == 1 and not raw.endswith(b"\n") and cr_only(raw):  # the whole input, and no LF in it
            raise cr_only_error(name)
        if n <= 2:  # a whole input of one line whose CRs alone outnumber its LF: a classic Mac file that
            # ends with an LF, refused as training refuses it. That line is held for the next one only
            # while more input is ready (a file; a pipe that stalled after it is a session awaiting answers)
            lone = lone_cr_count(raw) if n == 1 and raw.endswith(b"\n") and more else 0
        inner_crs.add(raw, n)
        lines.append(text.removeprefix("\ufeff") if n == 1 else text)  # a BOM, as training and evaluate drop it
        if (len(lines) >= chunk or not (more or whole_chunks)) and lone <= 1:
            for i in range(0, len(lines), chunk):  # two when the first line was held, with chunk 1
                yield lines[i : i + chunk]
            lines = []
    if lines and lone > 1:
        raise cr_only_error(name, 1, lone)
    inner_crs.warn(name, stream, done)
    if lines:
        yield lines


def _decoded(raw: bytes, name: str, n: int, head: bytes | bytearray) -> tuple[str, UserError | None]:
    """Line `n` of `name` as text without its line end, or the error of a line that is no UTF-8 text or
    holds a NUL byte (valid UTF-8, but no text has it: a binary file, or a corrupt one)."""
    try:
        text = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        return "", invalid_utf8(f"{name}:{n}", raw[e.start], head)
    if "\0" in text:
        return "", nul_byte(f"{name}:{n}", head)
    return text, None


def _raw_lines(stream: BinaryIO, name: str, head: bytearray) -> Iterator[tuple[bytes, bool]]:
    """(line, whether more input is ready now) for each line of `stream`, with its first HEAD_BYTES put in
    `head` before the first line is yielded: more than that line's (a line of UTF-16 without a byte order
    mark, cut at its first 0x0A, was too little to tell it by), but for a stream that cannot peek (a
    BytesIO), whose lines read so far go there. A regular file is always
    ready. A pipe, FIFO or terminal is read as it arrives (`read1`: what is there, waiting only when
    nothing is): before, 10,000 lines were awaited, so `producer | aiayn translate` answered a slow
    producer only at its end. A line with a NUL byte ends where it was read to, in either (`_file_lines`).
    A read that fails (an I/O error) is a UserError naming `name`, as opening
    it is: `-i /proc/self/mem` was a traceback."""
    try:
        fd = _pipe_fd(stream)
        if fd is None:
            yield from ((raw, True) for raw in _file_lines(stream, head))
            return
        pending: list[bytes] = []  # the line under way, joined once it ends (joined and split again for
        # each block, a 40 MB line took 13 s)
        while block := stream.read1(1 << 16):
            if len(head) < HEAD_BYTES:
                head += block[: HEAD_BYTES - len(head)]
            *complete, tail = block.split(b"\n")
            if complete:
                complete[0], pending = b"".join([*pending, complete[0]]), []
            for i, line in enumerate(complete, 1):
                yield line + b"\n", i < len(complete) or _ready(fd)
            pending.append(tail)
            if b"\0" in tail:  # no text has one; a binary stream (/dev/zero) may never end the line: say so
                yield b"".join(pending), True
                pending = []
        if rest := b"".join(pending):
            yield rest, True
    except OSError as e:
        raise UserError(f"{name}: cannot read ({e.strerror or e})") from None


def _file_lines(stream: BinaryIO, head: bytearray) -> Iterator[bytes]:
    """The lines of a regular file (or a buffer), read up to 64 KiB at a time, as the pipe's are: a line
    with a NUL byte ends with the read that found it, less a character cut at its end (`whole_characters`).
    No text has one, and a file of zeros with no line end was read whole first: twice its size. Its first
    HEAD_BYTES go to `head` (from where the stream stands: stdin may be a file read part way)."""
    peeked = hasattr(stream, "peek")
    if peeked:  # read ahead, not consumed: a short file's all
        head += stream.peek(HEAD_BYTES)[:HEAD_BYTES]
    pending: list[bytes] = []  # the line under way, joined once it ends
    while piece := stream.readline(1 << 16):
        if not peeked and len(head) < HEAD_BYTES:  # a stream that cannot peek (BytesIO)
            head += piece[: HEAD_BYTES - len(head)]
        pending.append(piece)
        if piece.endswith(b"\n"):
            yield b"".join(pending)
            pending = []
        elif b"\0" in piece:
            line = b"".join(pending)
            whole = whole_characters(line)
            yield whole
            pending = [line[len(whole) :]]
    if rest := b"".join(pending):
        yield rest


def is_regular_file(stream: BinaryIO) -> bool:
    """Whether `stream` reads a regular file (of known length, readable again), not a pipe, a FIFO, a
    socket, a terminal or an in-memory buffer."""
    try:
        return stat.S_ISREG(os.fstat(stream.fileno()).st_mode)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False


def _pipe_fd(stream: BinaryIO) -> int | None:
    """The descriptor of a buffered pipe, FIFO, socket or terminal that `select` can watch; else None."""
    if is_regular_file(stream) or not hasattr(stream, "read1"):
        return None
    try:
        fd = stream.fileno()
        select.select([fd], [], [], 0)  # pipes only on Windows: find out now
    except (OSError, ValueError, io.UnsupportedOperation):
        return None
    return fd


def _ready(fd: int) -> bool:
    """Whether reading `fd` would return at once: more data, or the end of the input."""
    return bool(select.select([fd], [], [], 0)[0])


@dataclass(frozen=True)
class ScoredStream:
    """What `score_stream` scored: pairs, target tokens (EOS included) and the sum of their log P."""

    pairs: int
    tokens: int
    log_prob: float

    @property
    def perplexity(self) -> float:
        return math.exp(min(-self.log_prob / self.tokens, 700.0)) if self.tokens else math.nan


def score_stream(
    translator: Translator, src: BinaryIO, tgt: BinaryIO, dst: TextIO, names: tuple[str, str],
    chunk: int = 10_000, max_tokens: int = DEFAULT_MAX_TOKENS, normalize: bool = False,
    progress: Callable[[int], None] | None = None,
) -> ScoredStream:
    """Write log P(target | source) of each line pair of two binary streams to `dst`, one number per
    line (`normalize`: per target token), `chunk` pairs at a time: memory stays one chunk's, whatever the
    corpus (read whole, a 400,000-pair file took 670 MB). Streams of different lengths are a UserError
    naming the longer at the first line the other lacks, and both counts, and empty ones one naming the
    source (no pair to score); a line past the model's positions is a `SentenceTooLong` naming its file and
    line, and the others of the lines read (`TextError.others`), the pairs before it written."""
    check_count("chunk", chunk)
    for stream, name in zip((src, tgt), names):
        _require_binary(stream, name, "score_stream")
    pieces = [read_utf8_lines(stream, name, chunk, whole_chunks=True, done="scored")
              for stream, name in zip((src, tgt), names)]
    pairs = tokens = 0
    total = 0.0

    def scored(sources: list[str], targets: list[str], read: int | None = None) -> list[Scored]:
        try:
            return translator.score(sources, targets, max_tokens, progress)
        except TextError as e:  # a sentence too long, a batch out of memory: named by its file and line
            side = getattr(e, "side", "source")  # an OutOfMemory names the batch's first source line
            raise e.located(names[1] if side == "target" else names[0], pairs, read) from None

    def write(results: list[Scored]) -> None:
        nonlocal tokens, total
        raise_dropped_stop()  # a stop Python dropped: here, as translate_stream's, not after the last chunk
        for one in results:
            dst.write(f"{one.per_token if normalize else one.log_prob:.6f}\n")
        dst.flush()
        tokens += sum(one.tokens for one in results)
        total += sum(one.log_prob for one in results)

    def write_pairs(sources: list[str], targets: list[str]) -> None:
        try:
            write(scored(sources, targets, pairs + len(sources)))
        except SentenceTooLong as e:
            # a pipe's line (`aiayn score` checks a file whole first): the pairs before it are written first,
            # as `translate_stream` writes its lines; with two pipes, a too long line of the other side among
            # them is then the one named, and the pairs before that one written (they were lost: its error
            # left the handler)
            error = e
            while error.index > pairs:
                try:
                    write(scored(sources[: error.index - pairs], targets[: error.index - pairs]))
                    break
                except SentenceTooLong as earlier:  # within the pairs retried: each retry is shorter
                    error = earlier
            raise error from None

    for sources, targets in itertools.zip_longest(*pieces, fillvalue=[]):
        if len(sources) != len(targets):  # one stream ended first: count both to the end
            both, short = min(len(sources), len(targets)), int(len(targets) < len(sources))
            rest = [0, 0]
            try:  # the shorter side first: a bad line (invalid UTF-8, a NUL) that ended its list early
                # is the earliest problem, said before the other side is read on (to its end, or its own)
                for side in (short, 1 - short):
                    rest[side] = sum(map(len, pieces[side]))
            except UserError:  # the pairs before it are scored and written first, as a too long line's
                write_pairs(sources[:both], targets[:both])
                raise
            counts = [pairs + len(part) + more for part, more in zip((sources, targets), rest)]
            require_same_count(names[0], counts[0], names[1], counts[1])
        write_pairs(sources, targets)
        pairs += len(sources)
    if not pairs:  # as evaluate refuses an empty file: exit 0 with no output said nothing was wrong
        raise UserError(f"{names[0]}: empty, nothing to score")
    return ScoredStream(pairs, tokens, total)


def _require_binary(stream: Any, name: str, reader: str) -> None:
    """A TypeError for a text stream (io.StringIO, sys.stdin), which failed at its first line: 'str'
    object has no attribute 'decode'."""
    if isinstance(stream, io.TextIOBase):
        raise TypeError(f"{name}: {reader} reads bytes (its UTF-8 is checked line by line); give a "
                        "binary stream, e.g. open(path, 'rb') or sys.stdin.buffer")


def cut_by_min_len_warning(config: DecodeConfig) -> str:
    """What to say of the texts that `config.min_len` leaves no room for EOS: a logging format whose one
    `%s` says which, an argument that the CLI's flag names (`min_len=3` as `--min-len 3`) leave as it is
    (a line holding "beam=5" was shown as "--beam 5")."""
    return (f"min_len={config.min_len} leaves no room for EOS in the length limit ({config.max_len_a:g} x "
            f"source length + {config.max_len_b}) of %s: they end cut, without EOS")


def translate_stream(
    translator: Translator, src: BinaryIO, dst: TextIO, name: str, chunk: int = 10_000,
    max_tokens: int = DEFAULT_MAX_TOKENS, progress: Callable[[int], None] | None = None, **options: Any,
) -> int:
    """Translate `src` line by line into `dst`, in input order, `chunk` lines at a time (1 for an
    interactive filter: each line is answered as soon as it is read); from a pipe, also what arrived
    before the input stalled, except with `sample` and a `seed`.

    With `n_best` > 1 every line gets `n_best` rows (fewer only where fewer outputs fit its length limit:
    a vocabulary of a few pieces under a limit of a token or two, e.g. 3 outputs for 4 ids, padding and
    EOS among them, and 1 token) in Marian's n-best format (Moses' four fields),
    `LINE ||| TEXT ||| F0= LOG_PROB ||| SCORE`: LINE counts from 0, LOG_PROB is the raw log
    P(TEXT | line) (`Translation.log_prob`), SCORE is LOG_PROB / lp(|Y|), what beam search ranked by.
    A line of no pieces (`Translator.source_ids`) gets `n_best` empty rows scored 0. With `sample`, one
    generator seeded once draws the whole stream; with a `seed` too, a pipe is read in whole `chunk`-line
    blocks like a file, since which line gets which draw depends on the batches (`Translator.hypotheses`).
    A line past the model's positions is a `SentenceTooLong` naming it and the others of the lines read
    (`TextError.others`), the lines before it written. Returns the number of lines read."""
    config = translator.decode_config(**options)
    check_count("chunk", chunk)
    check_count("max_tokens", max_tokens)
    _require_binary(src, name, "translate_stream")
    generator = sampling_generator(config, translator.device) if config.sample else None
    reproducible = config.sample and config.seed is not None  # batches must not follow a pipe's timing
    done = 0
    said = False

    def say_cut(config: DecodeConfig, lines: list[str], cut: list[int]) -> None:
        nonlocal said  # once for the stream: every chunk of 6 lines in 2s had said it again
        if not said:
            first = f"{name} line {done + cut[0] + 1} ({lines[cut[0]][:40]!r})"
            log.warning(cut_by_min_len_warning(config), f"{first} and any line as short")
        said = True

    def translated(lines: list[str], read: int | None = None) -> list[list[Translation]]:
        try:
            return translator._hypotheses(lines, max_tokens, progress, generator, options, say_cut)
        except TextError as e:  # a sentence too long, a batch out of memory: named by its line
            raise e.located(name, done, read) from None

    def write(translated: list[list[Translation]]) -> None:
        # a Ctrl-C or SIGTERM that Python dropped (the CLI records it) stops the stream here, not after every
        # chunk is translated (hours of a test set with -o, then exit 130 and the work thrown away)
        raise_dropped_stop()
        for i, hyps in enumerate(translated):
            if config.n_best == 1:
                dst.write((hyps[0].text if hyps else "") + "\n")
                continue
            for h in hyps or [Translation("", 0.0, [], 0.0)] * config.n_best:  # an empty line: n_best rows
                dst.write(f"{done + i} ||| {h.text} ||| F0= {h.log_prob:.4f} ||| {h.score:.4f}\n")
        dst.flush()

    for lines in read_utf8_lines(src, name, chunk, whole_chunks=reproducible):
        try:
            write(translated(lines, done + len(lines)))
        except SentenceTooLong as e:  # a pipe's line (`aiayn translate` checks a file whole first): the
            # lines before it in its chunk are written first, so that the output ends at the line before the
            # one named, and a rerun from there loses none (they were lost: 4 lines out, then line 6 named)
            if e.index > done:
                write(translated(lines[: e.index - done]))
            raise
        done += len(lines)
    return done


def progress_lines(total: int, every: float, what: str) -> Callable[[int], None]:
    """A `progress(n)` for `total` sentences (`what` ones: "held-out") that logs how many are translated, at
    most every `every` s: where stderr is no terminal, tqdm shows no bar (disable=None), and translating a
    large set (the demo's --test-pairs, the recipe's splits) went on for minutes without a word."""

    def say(done: int, percent: float, per_second: float) -> None:
        log.info("translated %d of %d %s sentences (%.0f%%, %.0f sentences/s)", done, total, what, percent,
                 per_second)

    return throttled_progress(total, every, say)

"""Ensemble decoding: several models that share a vocabulary search as one, their probabilities averaged.

P(y_t | y_<t, x) = (1/M) sum_m P_m(y_t | y_<t, x), where P_m is member m's distribution over the tokens
a step may output: padding removed, and EOS too while fewer than `min_len` tokens were produced, and the
rest renormalized, as a single model's step (`aiayn.decoding.search.step_log_probs`). Removing them from
the mean instead weighted each member by 1 - P_m(pad) - P_m(EOS): a member sure of an early EOS counted
for less, by up to 2.2 nats on a demo sentence with min_len 8, and beams changed. fairseq also averages
probabilities (without renormalizing); Marian adds weighted log-probabilities, and OpenNMT-py averages
log-probabilities by default. Each member keeps its own encoder output and `KVCache`; the searches see
an `Ensemble` through three calls they make of a `Transformer` (`encode`, `src_mask`, `new_cache`), and
`step_log_probs` takes each member's step as it takes a single model's, then `mean`, so greedy, beam
search, sampling and forced decoding work unchanged.

Dimension key: M members, R rows, V target vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from aiayn.model import KVCache, Transformer

if TYPE_CHECKING:
    from aiayn.config import ModelConfig

# What the members must agree on for their token ids and probabilities to mean the same thing.
SHARED_FIELDS = ("vocab_size", "tgt_vocab_size", "pad_id", "decoder_start_id", "eos_id")


class Memories:
    """The members' encoder outputs, (B, S, d_m) each, indexed by sentence as one tensor would be."""

    def __init__(self, tensors: list[Tensor]):
        self.tensors = tensors

    def __getitem__(self, index: Tensor) -> Memories:
        return Memories([m[index] for m in self.tensors])


class EnsembleCache:
    """One `KVCache` per member, selected and shrunk together."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches

    @property
    def length(self) -> int:
        return self.caches[0].length

    def select(self, index: Tensor) -> None:
        for c in self.caches:
            c.select(index)

    def expand_beams(self, index: Tensor, beam_size: int) -> None:
        for c in self.caches:
            c.expand_beams(index, beam_size)

    def keep_sentences(self, index: Tensor) -> None:
        for c in self.caches:
            c.keep_sentences(index)


def vocabularies(config: ModelConfig) -> str:
    """How a model of `config` holds its vocabulary, as an ensemble's refusal says it."""
    if config.tgt_vocab_size is None:
        return "one vocabulary shared by source and target"
    return "separate source and target vocabularies"


class Ensemble(nn.Module):
    """M models with one target vocabulary, decoded as one."""

    def __init__(self, models: Sequence[nn.Module]):
        super().__init__()
        # One model was "'Transformer' object is not subscriptable", a generator likewise, a list of ints
        # "'int' object has no attribute 'config'". An nn.ModuleList or nn.Sequential of Transformers
        # (`ensemble.members`) is a list of them, and a torch.compile'd member (`_orig_mod`) one.
        lone = getattr(models, "_orig_mod", models)
        if isinstance(lone, (Transformer, Ensemble)) or not isinstance(models, Iterable):
            raise TypeError(f"Ensemble takes a list of Transformers, not one {type(lone).__name__}: pass "
                            "[model_1, model_2, ...]")
        models = list(models)
        if not models:
            raise ValueError("an ensemble needs at least one model")
        if wrong := next(((i, m) for i, m in enumerate(models, 1)
                          if not isinstance(getattr(m, "_orig_mod", m), Transformer)), None):
            raise TypeError(f"ensemble member {wrong[0]} is {type(wrong[1]).__name__}: an Ensemble takes a list "
                            "of Transformers")
        first = models[0].config
        for i, m in enumerate(models[1:], 2):
            if (m.config.tgt_vocab_size is None) != (first.tgt_vocab_size is None):  # None is no size
                raise ValueError(f"ensemble member {i} has {vocabularies(m.config)}, member 1 "
                                 f"{vocabularies(first)}; an ensemble's models must agree on the vocabulary")
            differ = [f for f in SHARED_FIELDS if getattr(m.config, f) != getattr(first, f)]
            if differ:
                raise ValueError(f"ensemble member {i} differs from member 1 in {', '.join(differ)}")
        self.members = nn.ModuleList(models)
        # The searches read the ids and the length limit here; the shortest position table bounds all.
        self.config = dataclasses.replace(first, max_len=min(m.config.max_len for m in models))

    def forward(self, *inputs: Any) -> Tensor:
        """None: an ensemble decodes only (torch's "missing the required forward function" said not why)."""
        raise TypeError("an Ensemble has no forward: it decodes only, through aiayn.decoding.generate(ensemble, "
                        "src, config), force_decode or a Translator (each member is a Transformer with its own)")

    def src_mask(self, src: Tensor) -> Tensor:
        return self.members[0].src_mask(src)  # (B, 1, 1, S): built from pad_id alone, the same for all

    def encode(self, src: Tensor) -> Memories:
        return Memories([m.encode(src) for m in self.members])

    def new_cache(self, batch_size: int, max_len: int, *, beam_size: int = 1) -> EnsembleCache:
        return EnsembleCache([m.new_cache(batch_size, max_len, beam_size=beam_size) for m in self.members])

    def mean(self, log_probs_M: list[Tensor]) -> Tensor:
        """The members' (R, V) log-probabilities of a step -> the log of the mean of their probabilities."""
        return torch.logsumexp(torch.stack(log_probs_M), dim=0) - math.log(len(self.members))  # (R, V)

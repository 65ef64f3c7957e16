"""Forced decoding: log P(target | source) of given translations, through the searches' own steps.

Dimension key: B sentences, S source length, T target length (EOS included), V target vocabulary.

What reranking, corpus filtering and a test set's perplexity need (fairseq's --score-reference,
marian-scorer). Each target token is fed to the decoder as a search feeds the token it chose, through
`step_log_probs` over a `KVCache`, and its log-probability summed in float32 as the searches sum them:
a hypothesis a search found scores here what the search scored it.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

from aiayn.data.batching import right_pad
from aiayn.decoding.options import DecodeConfig
from aiayn.decoding.search import check_inference, source_lengths, source_mask, step_log_probs
from aiayn.model import Transformer


def _is_index(value: object) -> bool:
    """An int, or what stands for one (numpy's integers, a 0-d integer tensor): `operator.index` takes it."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


@torch.inference_mode()
def force_decode(model: Transformer, src: Tensor, targets: list[list[int]]) -> list[float]:
    """log P(targets[i] | src[i]) for a (B, S) right-padded source batch, each source ending with EOS as
    the searches take it, and B lists of target ids (end each with EOS to score a whole translation): the
    sum of its tokens' log-probabilities. Rows whose target ended stay in the batch, fed EOS, and add
    nothing more."""
    check_inference(model, src)
    source_lengths(model, src)  # as the searches: a row of padding alone was blamed on src_mask's row
    # a (B, T) tensor's rows failed in `all` ("Boolean value of Tensor ... is ambiguous"); converted, its
    # padding would be scored as tokens: only lists say where each target ends
    odd = next((t for t in targets if not isinstance(t, (list, tuple))), None)
    if odd is not None:
        raise TypeError(f"targets holds a {type(odd).__name__}: force_decode takes one list of token ids per "
                        "source, each ending with EOS (a tensor's rows: row[:length].tolist())")
    b = src.shape[0]
    if len(targets) != b:
        raise ValueError(f"{len(targets)} targets for {b} sources: one for each, ending with EOS")
    if (empty := next((i for i, target in enumerate(targets) if not target), None)) is not None:
        raise ValueError(f"targets[{empty}] is empty: end each target with EOS ({model.config.eos_id})")
    vocab = model.config.target_vocab_size
    for i, target in enumerate(targets):  # an id past the vocabulary failed in a gather, "index 500 is out
        # of bounds for dimension 1 with size 200", naming neither the id nor its target; 7.9 was scored as 7
        if (bad := next((t for t in target if not _is_index(t) or not 0 <= t < vocab), None)) is None:
            continue
        if not _is_index(bad):
            raise TypeError(f"targets[{i}] holds {bad!r}, a {type(bad).__name__}: token ids are integers")
        raise ValueError(f"targets[{i}] holds id {bad}, outside the target vocabulary of {vocab} (ids 0 to "
                         f"{vocab - 1})")
    steps = max(map(len, targets))
    memory, src_mask = model.encode(src), source_mask(model, src)  # (B, S, d), (B, 1, 1, S) or None
    cache = model.new_cache(b, steps)
    tokens_BT = right_pad(targets, model.config.eos_id).to(src.device)  # (B, T): ended rows fed EOS
    lengths_B = torch.tensor([len(t) for t in targets], device=src.device)
    log_prob_B = torch.zeros(b, device=src.device, dtype=torch.float32)  # as the searches accumulate
    last_B = torch.full((b,), model.config.decoder_start_id, dtype=torch.long, device=src.device)
    scoring = DecodeConfig(min_len=0)  # EOS is never masked: a target's end is scored where it is
    for t in range(steps):
        log_probs_BV = step_log_probs(model, last_B, memory, src_mask, cache, t, scoring)  # (B, V)
        last_B = tokens_BT[:, t]
        token_B = log_probs_BV.gather(1, last_B[:, None])[:, 0]  # (B,)
        log_prob_B += torch.where(lengths_B > t, token_B, torch.zeros_like(token_B))
    return log_prob_B.tolist()

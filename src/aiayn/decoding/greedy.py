"""Greedy search and sampling: one row per sentence, the chosen token fed back each step."""

from __future__ import annotations

import torch
from torch import Tensor

from aiayn.decoding.options import DecodeConfig
from aiayn.decoding.sampling import sample_next
from aiayn.decoding.search import (
    Hypothesis, check_inference, hypotheses, source_lengths, source_mask, step_log_probs,
)
from aiayn.decoding.topk import argmax_rows
from aiayn.model import Transformer


@torch.inference_mode()
def greedy_search(
    model: Transformer, src: Tensor, config: DecodeConfig, generator: torch.Generator | None = None
) -> list[list[Hypothesis]]:
    """The most likely next token at every step (or a sampled one, with a `generator`); per sentence
    a one-element list. A row that produced EOS or reached its maximum length leaves the batch."""
    check_inference(model, src)
    if config.beam != 1:  # a greedy search was run for it, silently
        raise ValueError(f"greedy_search keeps one hypothesis a sentence, not beam={config.beam}: call "
                         "beam_search, or generate, which picks the search")
    eos = model.config.eos_id
    max_len_R = config.max_lengths(source_lengths(model, src), model.config.max_len)
    memory, src_mask = model.encode(src), source_mask(model, src)  # (R, S, d), (R, 1, 1, S) or None
    b = src.shape[0]
    cache = model.new_cache(b, max(max_len_R))
    tokens_RT = torch.empty(b, max(max_len_R), dtype=torch.long, device=src.device)
    log_prob_R = torch.zeros(b, device=src.device, dtype=torch.float32)  # not the caller's default dtype
    limit_R = torch.tensor(max_len_R, device=src.device)  # (R,) output tokens allowed per row
    last_R = torch.full((b,), model.config.decoder_start_id, dtype=torch.long, device=src.device)
    alive = list(range(b))  # sentence index of each row still decoding
    done: list[list[Hypothesis]] = [[] for _ in range(b)]
    for t in range(max(max_len_R)):
        log_probs_RV = step_log_probs(model, last_R, memory, src_mask, cache, t, config)
        if generator is None:
            last_R = argmax_rows(log_probs_RV)  # (R,), as argmax(-1)
        else:
            last_R = sample_next(log_probs_RV, config.temperature, config.top_k, config.top_p, generator)
        log_prob_R += log_probs_RV.gather(1, last_R[:, None])[:, 0]
        tokens_RT[:, t] = last_R
        finished_R = (last_R == eos) | (limit_R <= t + 1)
        if finished_R.any():  # record them, then shrink every per-row tensor and the cache
            ended_E = finished_R.nonzero()[:, 0]  # (E,)
            ended = ended_E.tolist()
            for r, hyp in zip(ended, hypotheses(tokens_RT[ended_E, : t + 1], log_prob_R[ended_E], config)):
                done[alive[r]] = [hyp]
            if len(ended) == len(alive):
                break
            gone = set(ended)
            alive = [s for r, s in enumerate(alive) if r not in gone]
            keep_R = (~finished_R).nonzero()[:, 0]  # (R',)
            cache.select(keep_R)
            memory = memory[keep_R]
            src_mask = None if src_mask is None else src_mask[keep_R]
            tokens_RT, log_prob_R, last_R = tokens_RT[keep_R], log_prob_R[keep_R], last_R[keep_R]
            limit_R = limit_R[keep_R]
    return done

"""Beam search (paper section 6.1: beam 4, length penalty alpha 0.6), batched over sentences.

Each sentence keeps K live hypotheses as K rows of the decoder batch. A step scores every extension,
takes the best 2K per sentence (at most K of them end in EOS, one per beam, so K live ones always
remain: fairseq's scheme), moves the EOS ones ranked in the top K to the sentence's finished list,
and continues with the best K others. A sentence stops when K hypotheses have finished (early
stopping) or when nothing alive can beat them any more, or at its maximum length; it then leaves the
batch and its cache rows with it. Finished hypotheses are ranked by log P / lp(|Y|).

Dimension key: B sentences still decoding, K beam size, R = B*K rows, T output positions, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aiayn.decoding.length_penalty import length_penalty
from aiayn.decoding.options import DecodeConfig
from aiayn.decoding.search import (
    Hypothesis, check_inference, hypotheses, source_lengths, source_mask, step_log_probs,
)
from aiayn.decoding.topk import topk_rows
from aiayn.model import KVCache, Transformer


@dataclass
class Beams:
    """The live hypotheses of the sentences still being decoded."""

    sentence: list[int]  # (B,) index in the input batch of each live sentence
    tokens_RT: Tensor  # (B*K, max T) output ids so far; row b*K + k is beam k of sentence b
    scores_BK: Tensor  # (B, K) log P of each live hypothesis; -inf for empty slots
    limit_B: list[int]  # (B,) maximum output length of each sentence, on the host: checked every step
    memory: Tensor  # (B, S, d) encoder output, one per sentence (the beams share it)
    src_mask: Tensor | None  # (B, 1, 1, S); None when no source has padding
    cache: KVCache  # B*K self-attention rows, B cross-attention rows


@torch.inference_mode()
def beam_search(model: Transformer, src: Tensor, config: DecodeConfig) -> list[list[Hypothesis]]:
    """Per sentence of the (B, S) batch, its `n_best` hypotheses, best first."""
    check_inference(model, src)
    beams = start(model, src, config)
    finished: list[list[Hypothesis]] = [[] for _ in range(src.shape[0])]
    rows = src.shape[0] * first_rows(model, config.beam)
    last_R = torch.full((rows,), model.config.decoder_start_id, device=src.device)
    n = min(2 * config.beam, model.config.target_vocab_size)
    for t in range(beams.tokens_RT.shape[1]):
        # The best 2K extensions of a sentence are among the best 2K of each of its beams: rank those
        # K x 2K, not all K x V (a row can hold at most 2K of the sentence's best 2K). (Normalizing only
        # those by `logsumexp` instead of whole rows by `log_softmax` was 1 ms a step slower at beam 4 x
        # 16 rows, A/B in one process: `logsumexp` writes two row-sized temporaries.)
        log_probs_RV = step_log_probs(model, last_R, beams.memory, beams.src_mask, beams.cache, t, config)
        top_RN, token_RN = topk_rows(log_probs_RV, n)  # (R, N) each
        last_R = step(beams, top_RN, token_RN, t, model.config.eos_id, finished, config)
        keep_B = still_searching(beams, finished, t, config)
        if not keep_B:
            break
        if len(keep_B) < len(beams.sentence):
            last_R = last_R.view(len(beams.sentence), -1)[keep_B].view(-1)  # (B'*K,)
            shrink(beams, keep_B, config.beam)
    return [finalize(hyps, config) for hyps in finished]


def start(model: Transformer, src: Tensor, config: DecodeConfig) -> Beams:
    """Encode the batch once; only beam 0 of each sentence alive (the others would duplicate it).

    The first step decodes that one row per sentence and `step` grows it into K (as CTranslate2
    does): the first step of beam 4 costs a quarter. With a vocabulary smaller than K (tests only),
    K rows from the start, the K-1 copies scored -inf.
    """
    b, k = src.shape[0], config.beam
    j = first_rows(model, k)
    limit = config.max_lengths(source_lengths(model, src), model.config.max_len)
    scores_BK = torch.full((b, k), float("-inf"), device=src.device, dtype=torch.float32)  # whatever the default
    scores_BK[:, 0] = 0.0
    return Beams(
        sentence=list(range(b)),
        tokens_RT=torch.zeros(b * k, max(limit), dtype=torch.long, device=src.device),
        scores_BK=scores_BK,
        limit_B=limit,
        memory=model.encode(src),
        src_mask=source_mask(model, src),
        cache=model.new_cache(b * j, max(limit), beam_size=j),
    )


def first_rows(model: Transformer, k: int) -> int:
    """Decoder rows per sentence in the first step: 1, or K when the vocabulary is smaller than K."""
    return 1 if model.config.target_vocab_size >= k else k


def step(
    beams: Beams, top_RN: Tensor, token_RN: Tensor, t: int, eos: int, finished: list[list[Hypothesis]],
    config: DecodeConfig,
) -> Tensor:
    """Extend every beam by one token (position t); record finished hypotheses; return the new tokens (R,).

    `top_RN`, `token_RN`: the N best next tokens of each row and their log-probabilities, best first;
    K rows per sentence, or one (J = 1) in the first step, whose rows then grow to K.
    """
    b, k = beams.scores_BK.shape
    j, n = top_RN.shape[0] // b, top_RN.shape[1]  # rows per sentence in this step: K, or 1 at first
    cand_BJN = beams.scores_BK[:, :j, None] + top_RN.view(b, j, n)  # (B, J, N)
    top_B2K, index_B2K = cand_BJN.view(b, j * n).topk(min(2 * k, j * n), dim=1)  # sorted, best first
    beam_B2K, token_B2K = index_B2K // n, token_RN.view(b, j * n).gather(1, index_B2K)
    eos_B2K = token_B2K == eos
    ended_BK = eos_B2K[:, :k] & top_B2K[:, :k].isfinite()  # EOS ranked in the top K: a finished hypothesis
    if ended_BK.any():
        i_E, c_E = ended_BK.nonzero().unbind(1)  # (E,) sentence and rank of each
        rows_E = i_E * k + beam_B2K[i_E, c_E]  # tokens_RT has K rows per sentence even when J = 1
        record(beams, finished, i_E, beams.tokens_RT[rows_E, :t], top_B2K[i_E, c_E], config, eos)
    scores_BK, pick_BK = top_B2K.masked_fill(eos_B2K, float("-inf")).topk(k, dim=1)  # best K to go on
    beam_BK = beam_B2K.gather(1, pick_BK)  # (B, K) the beam each new hypothesis extends
    new_R = token_B2K.gather(1, pick_BK).view(-1)  # (R,)
    arange_B1 = torch.arange(b, device=pick_BK.device)[:, None]
    beams.tokens_RT[:, :t] = beams.tokens_RT[(arange_B1 * k + beam_BK).view(-1), :t]  # (R, t) follow beams
    beams.tokens_RT[:, t] = new_R
    beams.scores_BK = scores_BK
    rows_R = (arange_B1 * j + beam_BK).view(-1)  # (R,) the decoder row each new hypothesis extends
    if j < k:  # the first step: one row per sentence becomes K
        beams.cache.expand_beams(rows_R, k)
    else:  # self-attention rows only: the beams of a sentence share cross K/V
        beams.cache.select(rows_R)
    at_limit = [limit <= t + 1 for limit in beams.limit_B]
    if any(at_limit):  # cut at the maximum length: the live hypotheses are finished as they are
        at_limit_B1 = torch.tensor(at_limit, device=scores_BK.device)[:, None]
        i_E, c_E = (at_limit_B1 & scores_BK.isfinite()).nonzero().unbind(1)  # (E,) sentence and beam
        record(beams, finished, i_E, beams.tokens_RT[i_E * k + c_E, : t + 1], scores_BK[i_E, c_E], config)
    return new_R


def record(
    beams: Beams, finished: list[list[Hypothesis]], i_E: Tensor, tokens_ET: Tensor, log_prob_E: Tensor,
    config: DecodeConfig, eos: int | None = None,
) -> None:
    """Add E hypotheses to the finished lists of their live sentences i_E (E,): `tokens_ET` (E, T),
    then `eos` if given, with log P `log_prob_E` (E,).

    Three device reads for all E: on a GPU each `.item()` or `.tolist()` waits for the device. Reading
    each hypothesis on its own made a 4-best beam 4 search of Multi30k's 1,014 validation lines read
    25,133 times; with its other reads it now reads 1,825 times.
    """
    for i, hyp in zip(i_E.tolist(), hypotheses(tokens_ET, log_prob_E, config, eos)):
        finished[beams.sentence[i]].append(hyp)


def still_searching(
    beams: Beams, finished: list[list[Hypothesis]], t: int, config: DecodeConfig
) -> list[int]:
    """Positions (in the live batch) of the sentences whose search goes on after step t."""
    keep, best_live_B, limit_B = [], None, beams.limit_B
    for i, s in enumerate(beams.sentence):
        if limit_B[i] <= t + 1:
            continue
        if len(finished[s]) >= config.beam:
            if config.early_stopping:
                continue
            if best_live_B is None:
                best_live_B = beams.scores_BK[:, 0].tolist()
            # log P only falls as a hypothesis grows, so its best possible score divides today's log P
            # by the largest penalty it could still reach.
            lp = max(length_penalty(n, config.lenpen, config.lenpen_kind) for n in (t + 2, limit_B[i]))
            kth = sorted((h.score for h in finished[s]), reverse=True)[config.beam - 1]
            if kth >= best_live_B[i] / lp:
                continue
        keep.append(i)
    return keep


def shrink(beams: Beams, keep_B: list[int], k: int) -> None:
    """Drop the sentences that are done: their rows, their cache and their encoder output."""
    index_B = torch.tensor(keep_B, device=beams.scores_BK.device)
    rows_R = (index_B[:, None] * k + torch.arange(k, device=index_B.device)).view(-1)  # (B'*K,)
    beams.sentence = [beams.sentence[i] for i in keep_B]
    beams.tokens_RT = beams.tokens_RT[rows_R]
    beams.scores_BK, beams.limit_B = beams.scores_BK[index_B], [beams.limit_B[i] for i in keep_B]
    beams.memory = beams.memory[index_B]
    beams.src_mask = None if beams.src_mask is None else beams.src_mask[index_B]
    beams.cache.keep_sentences(index_B)


def finalize(hypotheses: list[Hypothesis], config: DecodeConfig) -> list[Hypothesis]:
    """The `n_best` best of a sentence's finished hypotheses, by length-normalized score."""
    return sorted(hypotheses, key=lambda h: h.score, reverse=True)[: config.n_best]

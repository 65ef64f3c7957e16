"""What every search shares: the hypothesis type, one decoder step, and `generate`, which picks the search.

Dimension key: B sentences, K beams per sentence, R rows being decoded (B or B*K), S source length,
T output length so far, V target vocabulary.

Every search runs the decoder one token per step against a `KVCache`: the source is encoded once, the
cross-attention keys and values are projected once per sentence, and rows (or sentences) that finished
leave the batch, so they cost nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aiayn.decoding.ensemble import Ensemble
from aiayn.decoding.length_penalty import length_penalty
from aiayn.decoding.options import DecodeConfig, check_decode_config
from aiayn.model import KVCache, Transformer
from aiayn.model.transformer import check_ids


@dataclass(frozen=True)
class Hypothesis:
    """One output of a search."""

    tokens: list[int]  # output ids, without the decoder start token, ending with EOS unless cut at max length
    score: float  # log_prob / lp(len(tokens)): what beam search ranks by
    log_prob: float  # log P(tokens | source), the sum of the per-token log-probabilities


def make_hypothesis(tokens: list[int], log_prob: float, config: DecodeConfig) -> Hypothesis:
    score = log_prob / length_penalty(len(tokens), config.lenpen, config.lenpen_kind)
    return Hypothesis(tokens, score, log_prob)


def hypotheses(
    tokens_ET: Tensor, log_prob_E: Tensor, config: DecodeConfig, eos: int | None = None
) -> list[Hypothesis]:
    """One hypothesis per row of `tokens_ET` (E, T), followed by `eos` if given, with log P `log_prob_E`
    (E,): two device reads for all of them (on a GPU each `.tolist()` or `.item()` waits for the device)."""
    tail = [] if eos is None else [eos]
    return [make_hypothesis(tokens + tail, log_prob, config)
            for tokens, log_prob in zip(tokens_ET.tolist(), log_prob_E.tolist())]


def source_lengths(model: Transformer, src: Tensor) -> list[int]:
    """(B, S) right-padded ids, each source ending with EOS -> the real length of each, its EOS included.

    Read from the device once (the lengths are needed on the host) and checked there: a source padded on
    the left (or inside) was searched with its tokens at other positions, and one without EOS as no
    training source was, both silently. A row of padding alone is refused too: it has no EOS."""
    c = model.config
    ids = src.cpu()  # (B, S)
    real = ids != c.pad_id  # (B, S)
    lengths = real.sum(1)  # (B,)
    inside = real != (torch.arange(ids.shape[1]) < lengths[:, None])  # (B, S): a pad before a token
    last = ids.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]  # (B,) each source's last token
    for problem, rows in (("is padded before a token: sources are right-padded", inside.any(1)),
                          (f"does not end with EOS ({c.eos_id}): every source does (Tokenizer.encode_src)",
                           (last != c.eos_id) | (lengths == 0))):
        if rows.any():
            raise ValueError(f"src row {int(rows.nonzero()[0, 0])} {problem}")
    return lengths.tolist()


def source_mask(model: Transformer, src: Tensor) -> Tensor | None:
    """The (B, 1, 1, S) padding mask of a source batch, or None when no source has padding (one sentence,
    or all of a length): attention then has no mask to convert on each of its calls."""
    mask = model.src_mask(src)
    return None if bool(mask.all()) else mask


def step_log_probs(
    model: Transformer, last_R: Tensor, memory: Tensor, src_mask: Tensor | None, cache: KVCache,
    produced: int, config: DecodeConfig,
) -> Tensor:
    """Feed the newest token of each row (R,) and return log P(next token) (R, V), in float32.

    The decoder returns the logits of the one new position only, so the vocabulary projection (the
    largest matmul of a step) is done once per row. Padding is never an output (Marian's models ship
    `bad_words_ids=[[pad]]` for the same reason), and EOS is not one while fewer than `min_len` tokens
    were produced: both are masked before the softmax, so the other tokens' probabilities are
    renormalized, as CTranslate2's `min_decoding_length` does (and HuggingFace's `min_new_tokens` with
    `renormalize_logits=True`). Masked after it, beam search kept each such step's log(1 - P(EOS)) in
    its scores and ranked beams otherwise than CTranslate2 and HuggingFace.
    """
    tgt_in = last_R[:, None]  # (R, 1)
    if isinstance(model, Ensemble):  # each member's step masked as one model's, then the mean (masked after
        # the mean, each member was weighted by 1 - P(pad) - P(EOS))
        return model.mean([step_log_probs(m, last_R, mem, src_mask, c, produced, config)
                           for m, mem, c in zip(model.members, memory.tensors, cache.caches)])
    step = model.one_row_step  # set by `aiayn.decoding.compiled.compile_one_row_step`
    decode = step if step is not None and step.applies(tgt_in, src_mask, cache) else model.decode
    logits_RV = decode(tgt_in, memory, src_mask, cache)[:, -1].float()  # (R, V)
    logits_RV[:, model.config.pad_id] = float("-inf")
    if produced < config.min_len:
        logits_RV[:, model.config.eos_id] = float("-inf")
    # In place: the logits are this step's own. A fresh (R, V) output is 2.7x slower with cold caches
    # (64 x 32,000: 3.5 ms against 1.3); beam 4 x 16 decodes 1-3% faster (benchmarks/RESULTS.md).
    return torch.log_softmax(logits_RV, dim=-1, out=logits_RV)


def check_inference(model: torch.nn.Module, src: Tensor) -> None:
    """Before a search or forced decoding: `src` (B, S) ids, and no model (an ensemble's members too) in
    training mode with dropout. One in training mode (as `Transformer(config)` starts) dropped activations
    at every step, so each call searched or scored another random model; a batch of 0 sentences failed in
    beam search's length limit. Dropout switched on by hand in a model in eval mode (Monte Carlo dropout:
    `model.eval()`, then `.train()` on its `Dropout` modules) is the caller's choice, and is kept."""
    check_ids("src", src)
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()  # or another decoding interface
    if any(isinstance(m, Transformer) and m.training and m.config.dropout > 0 for m in modules):
        raise ValueError("the model is in training mode, so dropout would change every search or score: "
                         "call model.eval() first")


def sampling_generator(config: DecodeConfig, device: torch.device) -> torch.Generator:
    """A generator on `device` seeded with `config.seed`, or randomly when it is None."""
    generator = torch.Generator(device=device)
    if config.seed is None:
        generator.seed()  # its own random seed: torch.seed() would reseed the caller's global generator
    else:
        generator.manual_seed(config.seed)
    return generator


@torch.inference_mode()
def generate(
    model: Transformer, src: Tensor, config: DecodeConfig, generator: torch.Generator | None = None
) -> list[list[Hypothesis]]:
    """Translate a (B, S) right-padded batch of source ids, each ending with EOS; per sentence, its `n_best`
    hypotheses, best first (samples: in the order drawn).

    Greedy search for beam 1, beam search above, sampling when `config.sample` (then `generator`, or a new
    one from `sampling_generator`, draws the tokens). A caller translating in several batches should pass
    one generator for all: a new one per batch, seeded alike, repeats the same draws in every batch.
    """
    from aiayn.decoding.beam import beam_search
    from aiayn.decoding.greedy import greedy_search

    check_decode_config(config, "generate()")
    check_ids("src", src)  # before sampling reads its device: a list's was an AttributeError
    if generator is not None and not config.sample:
        raise ValueError("generator is used only with sample=True")
    if config.sample:
        if generator is None:
            generator = sampling_generator(config, src.device)
        if config.n_best > 1:  # a refused source named as a row of src, not of its repeats below
            check_inference(model, src)  # first: a 1-D src was an IndexError in source_lengths
            source_lengths(model, src)
        rows = src.repeat_interleave(config.n_best, dim=0)  # (B * n, S): n independent samples each
        hyps = greedy_search(model, rows, config, generator)
        return [[h[0] for h in hyps[i : i + config.n_best]] for i in range(0, len(hyps), config.n_best)]
    if config.beam == 1:
        return greedy_search(model, src, config)
    return beam_search(model, src, config)

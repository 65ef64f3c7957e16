"""Drawing the next token: temperature, top-k and top-p (nucleus, Holtzman et al. 2020) sampling."""

from __future__ import annotations

import torch
from torch import Tensor


TOP_P_ROUNDING = 1e-6  # float32 probabilities are exact to about 1e-7


def filter_logits(logits_RV: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set to -inf every token outside the top `k` (k > 0) and outside the smallest set whose probability
    reaches `top_p` (the most likely token always stays)."""
    if 0 < top_k < logits_RV.shape[-1]:
        kth_R1 = logits_RV.topk(top_k, dim=-1).values[:, -1:]  # (R, 1)
        logits_RV = logits_RV.masked_fill(logits_RV < kth_R1, float("-inf"))
    if top_p < 1.0:
        sorted_RV, order_RV = logits_RV.sort(dim=-1, descending=True)
        probs_RV = sorted_RV.softmax(-1, dtype=torch.float64)  # a sum over 32,000 terms stays exact enough
        before_RV = probs_RV.cumsum(-1) - probs_RV  # mass of the better tokens
        # Mass that reaches top_p up to rounding reaches it: [0.5, 0.4, 0.1] with top_p 0.5 keeps one
        # token, where log and softmax put the first mass 3e-8 below 0.5 and a second token was kept.
        drop_sorted_RV = before_RV >= top_p - TOP_P_ROUNDING
        drop_sorted_RV[:, 0] = False  # the most likely token stays, however small top_p is
        drop_RV = torch.zeros_like(drop_sorted_RV).scatter(-1, order_RV, drop_sorted_RV)  # vocab order
        logits_RV = logits_RV.masked_fill(drop_RV, float("-inf"))
    return logits_RV


def sample_next(
    log_probs_RV: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator
) -> Tensor:
    """One token per row (R,) from softmax(log_probs / temperature) restricted by top-k and top-p."""
    logits_RV = filter_logits(log_probs_RV / temperature, top_k, top_p)
    return torch.multinomial(logits_RV.softmax(-1), 1, generator=generator)[:, 0]  # (R,)

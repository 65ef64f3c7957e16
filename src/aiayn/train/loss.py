"""Label-smoothed cross-entropy (paper section 5.4, Szegedy et al. 2016).

The target distribution puts 1 - eps on the reference token and spreads eps uniformly over the V
tokens of the vocabulary: q = (1 - eps) * onehot(y) + eps / V. The loss is the cross-entropy
H(q, p) = (1 - eps) * (-log p_y) + eps * mean_v(-log p_v), the same as
`F.cross_entropy(..., label_smoothing=eps)`. The plain negative log-likelihood is returned beside it:
the smoothed loss depends on eps and V, so only the NLL (and its perplexity) compares across systems.

Dimension key: B batch, T target length, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def label_smoothed_nll(
    logits: Tensor, target: Tensor, eps: float, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """(B, T, V) logits, (B, T) target ids -> (smoothed loss sum, NLL sum) over non-ignored positions.

    Computed in float32 whatever the autocast dtype: a bf16 log-softmax over 37k classes loses the
    small probabilities that the smoothing term sums.
    """
    lprobs = F.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    keep = target != ignore_index  # (B, T)
    safe_target = target.masked_fill(~keep, 0)  # any valid index; these positions are masked out below
    nll = -lprobs.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)  # (B, T)
    uniform = -lprobs.mean(dim=-1)  # (B, T): cross-entropy against the uniform distribution
    smoothed = (1.0 - eps) * nll + eps * uniform  # (B, T)
    zero = torch.zeros((), dtype=nll.dtype, device=nll.device)
    return torch.where(keep, smoothed, zero).sum(), torch.where(keep, nll, zero).sum()

"""The k largest entries (or the first largest) of each row of a wide matrix, exactly as `torch.topk`
(`torch.argmax`), in two cheap passes.

Beam search needs the best 2K extensions of each of its rows over the whole vocabulary every step. On
the CPU `torch.topk` copies every entry of a row into a buffer of (value, index) pairs before selecting,
about 1.5 ns an entry, or 3.3 of a beam 4 x batch 16 `base` step's 60 ms (benchmarks/RESULTS.md).
Instead: the maximum of each chunk of C entries (one vectorized pass), the k chunks with the largest
maxima, and `torch.topk` over only their k*C entries. That is exact: an entry outside those k chunks
has k chunk maxima at least as large as it, so k entries rank before it (ties aside, which `torch.topk`
also breaks arbitrarily). 0.7 ms against 3.3 on those shapes.

Greedy search needs each row's argmax, and `torch.argmax` over a row of floats is slower still: 640 us
for 16 x 32,000, against 44 us for `amax` (one thread, this project's Intel CPU). `argmax_rows` takes the
first chunk holding the row's maximum, then the first maximum inside it: `torch.argmax`'s answer.

Dimension key: R rows, V columns (the vocabulary), N = V // C whole chunks, C chunk width.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK = 128  # columns per chunk: wide enough for a vectorized max, narrow enough that k chunks are few


def topk_rows(x_RV: Tensor, k: int, chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """(R, V) -> values, indices (R, k), each row's k largest entries, largest first (`torch.topk`)."""
    r, v = x_RV.shape
    n = v // chunk
    if n < 4 * k:  # narrow rows: the chunks would not skip much
        return x_RV.topk(k, dim=1)
    whole_RNC = x_RV[:, : n * chunk].view(r, n, chunk)  # a view: rows keep their stride V
    best_Rk = whole_RNC.amax(dim=2).topk(k, dim=1).indices  # (R, k) chunks holding the answer
    cand_RkC = whole_RNC.gather(1, best_Rk[:, :, None].expand(r, k, chunk))  # (R, k, C)
    cols_RkC = best_Rk[:, :, None] * chunk + torch.arange(chunk, device=x_RV.device)  # their columns
    tail = v - n * chunk  # the last, partial chunk: always a candidate
    cand_RM = torch.cat([cand_RkC.view(r, -1), x_RV[:, n * chunk :]], dim=1)  # (R, k*C + tail)
    tail_cols_RM = torch.arange(n * chunk, v, device=x_RV.device).expand(r, tail)
    cols_RM = torch.cat([cols_RkC.view(r, -1), tail_cols_RM], dim=1)
    values_Rk, pick_Rk = cand_RM.topk(k, dim=1)
    return values_Rk, cols_RM.gather(1, pick_Rk)


def argmax_rows(x_RV: Tensor, chunk: int = CHUNK) -> Tensor:
    """(R, V) -> (R,) the index of each row's first largest entry, as `x_RV.argmax(1)` (NaN the largest)."""
    r, v = x_RV.shape
    n = v // chunk
    if n < 2:  # narrow rows: nothing to skip
        return x_RV.argmax(1)
    whole_RNC = x_RV[:, : n * chunk].view(r, n, chunk)  # a view: rows keep their stride V
    maxima_RN = whole_RNC.amax(dim=2)  # (R, N), NaN where a chunk has one
    best_R = maxima_RN.argmax(1)  # the first chunk holding the maximum of the whole chunks
    inside_R = whole_RNC.gather(1, best_R[:, None, None].expand(r, 1, chunk))[:, 0].argmax(1)  # (R,)
    index_R = best_R * chunk + inside_R
    if n * chunk == v:
        return index_R
    tail_R, tail_index_R = x_RV[:, n * chunk :].max(1)  # the last, partial chunk comes after them all
    best_value_R = maxima_RN.gather(1, best_R[:, None])[:, 0]
    later_wins_R = ~(tail_R <= best_value_R) & ~best_value_R.isnan()  # strictly larger, or the first NaN
    return torch.where(later_wins_R, n * chunk + tail_index_R, index_R)

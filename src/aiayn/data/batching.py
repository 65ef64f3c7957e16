"""Batching by tokens (paper section 5.1): pairs grouped by length, batches shuffled each epoch.

A batch holds up to `max_tokens` tokens counting padding, on each side: B * max(S) <= max_tokens and
B * max(T) <= max_tokens (the paper: "approximately 25000 source tokens and 25000 target tokens").
Sorting by length first keeps padding small. The batches are fixed once; each epoch only their order
changes, drawn from a generator seeded by (seed, epoch), so a run and its resumption see the same order.

With several processes (or gradient accumulation) one update consumes `world_size * update_freq`
consecutive batches of that order; process r takes the r-th of every `world_size`, so N processes with
update_freq F see exactly the batches one process with update_freq N*F sees.
"""

from __future__ import annotations

from typing import Sequence

import torch

from aiayn.errors import UserError


def token_batches(src_lengths: list[int], tgt_lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into batches of at most `max_tokens` padded tokens per side.

    Pairs are sorted by (target length, source length, index), which is deterministic, then cut
    greedily: a pair joins the current batch unless the padded size would pass `max_tokens`.
    """
    order = sorted(range(len(src_lengths)), key=lambda i: (tgt_lengths[i], src_lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest_src = longest_tgt = 0
    for i in order:
        s, t = src_lengths[i], tgt_lengths[i]
        if max(s, t) > max_tokens:
            raise UserError(f"pair {i + 1} has {max(s, t)} tokens, more than max_tokens={max_tokens}")
        new_src, new_tgt = max(longest_src, s), max(longest_tgt, t)
        if current and (len(current) + 1) * max(new_src, new_tgt) > max_tokens:
            batches.append(current)
            current, new_src, new_tgt = [], s, t
        current.append(i)
        longest_src, longest_tgt = new_src, new_tgt
    if current:
        batches.append(current)
    return batches


def epoch_order(n_batches: int, seed: int, epoch: int) -> list[int]:
    """The order of the batches in `epoch`: a permutation fixed by (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n_batches, generator=g).tolist()


def updates_in_epoch(n_batches: int, batches_per_update: int) -> int:
    """Whole updates an epoch holds. The few batches past the last whole update are skipped this
    epoch (a different few each epoch, since the order changes), so every process always has work."""
    return n_batches // batches_per_update


def update_batches(
    order: list[int], update: int, batches_per_update: int, rank: int, world_size: int
) -> list[int]:
    """The batch numbers process `rank` runs for update number `update` (0-based) of an epoch."""
    group = order[update * batches_per_update : (update + 1) * batches_per_update]
    return group[rank::world_size]


def right_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """Token-id lists -> (B, max length) long tensor, each row padded with `pad_id` on the right."""
    out = torch.full((len(sequences), max(map(len, sequences))), pad_id, dtype=torch.long)  # (B, S)
    for row, ids in enumerate(sequences):
        out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out

"""Batching by tokens: every pair once per epoch, no batch over max_tokens, a seeded order, exact sharding."""

import random

import pytest

from aiayn.data.batching import epoch_order, token_batches, update_batches, updates_in_epoch
from aiayn.errors import UserError


def lengths(n, seed=0):
    r = random.Random(seed)
    src = [r.randint(1, 60) for _ in range(n)]
    tgt = [max(1, s + r.randint(-10, 10)) for s in src]
    return src, tgt


@pytest.mark.parametrize("max_tokens", [80, 500, 4096])
def test_every_pair_once_and_no_batch_too_big(max_tokens):
    src, tgt = lengths(3000)
    batches = token_batches(src, tgt, max_tokens)
    for epoch in range(3):
        seen = [i for b in epoch_order(len(batches), 7, epoch) for i in batches[b]]
        assert sorted(seen) == list(range(3000))
    for b in batches:
        padded = len(b) * max(max(src[i] for i in b), max(tgt[i] for i in b))
        assert padded <= max_tokens
    # Grouping by length keeps padding small: under 10% of the padded tokens with this spread.
    real = sum(tgt)
    padded_tgt = sum(len(b) * max(tgt[i] for i in b) for b in batches)
    assert padded_tgt < 1.1 * real


def test_order_is_seeded_and_changes_each_epoch():
    assert epoch_order(100, 1, 0) == epoch_order(100, 1, 0)
    assert epoch_order(100, 1, 0) != epoch_order(100, 1, 1)
    assert epoch_order(100, 1, 0) != epoch_order(100, 2, 0)
    src, tgt = lengths(500)
    assert token_batches(src, tgt, 300) == token_batches(src, tgt, 300)


def greedy_batches(src, tgt, max_tokens):
    """The docstring's rule written out: sort by (target, source, index), add while B * longest fits."""
    batches, current, longest = [], [], 0
    for i in sorted(range(len(src)), key=lambda i: (tgt[i], src[i], i)):
        if current and (len(current) + 1) * max(longest, src[i], tgt[i]) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, src[i], tgt[i])
    return batches + [current] * bool(current)


@pytest.mark.parametrize("max_tokens", [70, 71, 97, 300, 4096, 10**6])  # lengths reach 70
def test_batches_are_the_greedy_rule_on_the_sorted_pairs(max_tokens):
    """numpy's sort and cut (a tuple per pair in sorted() took 9 s for 4.5 M pairs) against the rule
    written out; ties in length keep index order, and tied lengths are many here."""
    for seed in range(3):
        src, tgt = lengths(2000, seed)
        assert token_batches(src, tgt, max_tokens) == greedy_batches(src, tgt, max_tokens)
    assert token_batches([], [], 10) == []
    assert token_batches([5], [7], 7) == [[0]]


def test_a_pair_longer_than_max_tokens_is_an_error():
    with pytest.raises(UserError, match="^pair 2 has 11 tokens, more than max_tokens=10$"):
        token_batches([3, 11], [3, 3], 10)
    with pytest.raises(UserError, match="^pair 3 has 12 tokens"):  # the first in length order: the shorter
        token_batches([3, 40, 12], [3, 3, 3], 10)


def test_processes_share_out_what_accumulation_would_see():
    order = epoch_order(23, 3, 0)
    n = updates_in_epoch(23, 4)
    assert n == 5
    for update in range(n):
        one_process = update_batches(order, update, 4, rank=0, world_size=1)
        two = [update_batches(order, update, 4, rank=r, world_size=2) for r in range(2)]
        assert sorted(two[0] + two[1]) == sorted(one_process) and len(two[0]) == len(two[1]) == 2

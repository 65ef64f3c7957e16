"""Searches against answers we did not compute with them: full recomputation, a scripted decoder with
hand-computed scores (fairseq's test_sequence_generator pattern), exhaustive enumeration, the length
penalty formulas, and the invariants beam 1 == greedy and batch == each sentence alone."""

import dataclasses
import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from aiayn.config import ConfigError
from aiayn.decoding import DecodeConfig, beam_search, generate, greedy_search, length_penalty
from aiayn.decoding.sampling import filter_logits
from aiayn.decoding.search import sampling_generator
from aiayn.decoding.topk import argmax_rows, topk_rows
from aiayn.model import KVCache
from conftest import padded_batch, tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")


def full_log_prob(model, src, tokens):
    """log P(tokens | src) by one uncached forward pass: the oracle for what a search accumulates.
    Searches never output padding, so its probability is spread over the other tokens."""
    tgt_in = torch.tensor([[model.config.decoder_start_id] + tokens[:-1]])
    with torch.no_grad():
        logits = model(src[None], tgt_in)[0]  # (T, V)
        logits[:, model.config.pad_id] = float("-inf")
        log_probs = logits.log_softmax(-1)
    return log_probs.gather(1, torch.tensor(tokens)[:, None]).sum().item()


# --- the cache ---------------------------------------------------------------------------------------


def poison_unfilled(cache: KVCache) -> None:
    """NaN in every position not written yet and in the whole spare buffer: `select`, `keep_sentences`
    and `expand_beams` copy only the filled past into uninitialized buffers, so decoding must never
    read a slot before `append` writes it. A read of one would put NaN into the output."""
    for buf in (cache.k, cache.v):
        buf[:, :, cache.length :] = float("nan")  # (L, rows, max_len - length, H, D)
    for buf in cache.spare or ():
        buf.fill_(float("nan"))


@pytest.mark.parametrize(
    "perm",  # beam reorderings within each sentence: most rows move (a gather into the spare buffer),
    [[2, 0, 1, 4, 4, 3], [0, 2, 2, 3, 4, 5],  # or one row takes another's past (a copy of that row),
     [0, 0, 1, 3, 4, 5]],  # or a chain: row 2 takes row 1's old past while row 1 takes row 0's
)
def test_cache_with_shared_cross_kv_reordered_and_shrunk_equals_full_recomputation(perm):
    model = tiny_model()
    b, k, t_max = 2, 3, 6
    src = padded_batch([6, 3], 50)
    tgt = padded_batch([t_max] * (b * k), 50)  # (B*K, T): three different prefixes per sentence
    perm = torch.tensor(perm)
    with torch.no_grad():
        memory, mask = model.encode(src), model.src_mask(src)
        full = model.decode(tgt, memory.repeat_interleave(k, 0), mask.repeat_interleave(k, 0))
        full_perm = model.decode(tgt[perm], memory.repeat_interleave(k, 0), mask.repeat_interleave(k, 0))
        cache = model.new_cache(b * k, t_max, beam_size=k)
        rows, expected = tgt, full
        for t in range(t_max):
            if t == 3:  # reorder beams: self-attention rows move, the shared cross K/V stay
                cache.select(perm)
                rows, expected = tgt[perm], full_perm
            if t == 5:  # sentence 0 finished: keep sentence 1 only, its rows and its cross K/V
                cache.keep_sentences(torch.tensor([1]))
                rows, expected = rows[k:], expected[k:]
                memory, mask = memory[1:], mask[1:]
            poison_unfilled(cache)
            step = model.decode(rows[:, t : t + 1], memory, mask, cache)  # (rows, 1, V)
            torch.testing.assert_close(step[:, 0], expected[:, t], atol=1e-5, rtol=1e-5)
    assert cache.cross[0][0].shape[0] == 1  # one cross K/V row per sentence, never one per beam


def test_cache_dropping_finished_rows_equals_full_recomputation():
    """Greedy search: finished rows leave (`select` with fewer rows), their cross K/V with them (K = 1)."""
    model = tiny_model()
    src, tgt = padded_batch([6, 3, 5, 4], 50), padded_batch([6] * 4, 50)
    with torch.no_grad():
        memory, mask = model.encode(src), model.src_mask(src)
        full = model.decode(tgt, memory, mask)  # (4, T, V)
        cache = model.new_cache(4, 6)
        alive = torch.arange(4)
        for t in range(6):
            keep = {2: [0, 2, 3], 4: [0, 2]}.get(t)  # positions in the live batch: rows 1, then 2, finished
            if keep is not None:
                keep = torch.tensor(keep)
                cache.select(keep)
                alive, memory, mask = alive[keep], memory[keep], mask[keep]
            poison_unfilled(cache)
            step = model.decode(tgt[alive, t : t + 1], memory, mask, cache)  # (rows, 1, V)
            torch.testing.assert_close(step[:, 0], full[alive, t], atol=1e-5, rtol=1e-5)
    assert alive.tolist() == [0, 3] and cache.cross[0][0].shape[0] == 2


@pytest.mark.parametrize("index", [[1, 0, 2, 3],  # two rows swap: a copy of each moved row
                                   [3, 2, 0, 1],  # every row moves: a gather into the spare buffer
                                   [2, 0]])  # rows leave as well
def test_cache_without_beams_reordered_equals_full_recomputation(index):
    """K = 1, rows are sentences: `select` moves each row's cross K/V with its self-attention past."""
    model = tiny_model()
    src, tgt = padded_batch([6, 3, 5, 4], 50), padded_batch([4] * 4, 50)
    index = torch.tensor(index)
    with torch.no_grad():
        memory, mask = model.encode(src), model.src_mask(src)
        full = model.decode(tgt[index], memory[index], mask[index])  # (rows, T, V)
        cache = model.new_cache(4, 4)
        model.decode(tgt[:, :1], memory, mask, cache)
        cache.select(index)
        poison_unfilled(cache)
        step = model.decode(tgt[index, 1:2], memory[index], mask[index], cache)  # (rows, 1, V)
    torch.testing.assert_close(step[:, 0], full[:, 1], atol=1e-5, rtol=1e-5)


def test_cache_grown_into_beams_equals_full_recomputation():
    """Beam search: one row per sentence for the shared first steps, then `expand_beams` into K rows."""
    model = tiny_model()
    b, k, t_max, shared = 2, 3, 6, 2
    src = padded_batch([6, 3], 50)
    tgt = padded_batch([t_max] * (b * k), 50)  # (B*K, T): K prefixes per sentence,
    tgt[:, :shared] = tgt[::k, :shared].repeat_interleave(k, 0)  # the same in their first 2 positions
    with torch.no_grad():
        memory, mask = model.encode(src), model.src_mask(src)
        full = model.decode(tgt, memory.repeat_interleave(k, 0), mask.repeat_interleave(k, 0))
        cache = model.new_cache(b, t_max)
        for t in range(t_max):
            if t == shared:
                cache.expand_beams(torch.arange(b).repeat_interleave(k), k)  # (B*K,) row of each beam
            rows = torch.arange(b) * k if t < shared else torch.arange(b * k)  # beam 0 alone at first
            poison_unfilled(cache)
            step = model.decode(tgt[rows, t : t + 1], memory, mask, cache)  # (rows, 1, V)
            torch.testing.assert_close(step[:, 0], full[rows, t], atol=1e-5, rtol=1e-5)
    assert cache.cross[0][0].shape[0] == b  # one cross K/V row per sentence, never one per beam


def test_search_scores_equal_full_recomputation():
    model = tiny_model()
    src = padded_batch([5, 3, 7], 50)
    config = DecodeConfig(beam=3, n_best=3, max_len_a=0.0, max_len_b=8)
    for i, hyps in enumerate(generate(model, src, config)):
        assert len(hyps) == 3 and [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:
            n = int((src[i] != 0).sum())
            assert h.log_prob == pytest.approx(full_log_prob(model, src[i, :n], h.tokens), abs=1e-4)
            assert h.score == pytest.approx(h.log_prob / ((5 + len(h.tokens)) / 6) ** 0.6, abs=1e-6)


# --- a scripted decoder: known hypotheses and scores --------------------------------------------------

EOS, A, B = 2, 3, 4
SCRIPTS = {  # source id -> {output prefix: {next token: probability}}; unlisted prefixes: EOS for sure
    5: {(): {A: 0.6, B: 0.4}, (A,): {EOS: 0.4, A: 0.3, B: 0.3}, (B,): {EOS: 0.9, A: 0.05, B: 0.05}},
    6: {(): {A: 0.55, B: 0.45}, (A,): {EOS: 0.5, A: 0.45, B: 0.05}, (B,): {EOS: 0.4, B: 0.6},
        (A, A): {EOS: 0.9, A: 0.1}, (B, B): {EOS: 0.95, B: 0.05}},
    7: {(): {EOS: 0.5, A: 0.35, B: 0.15}, (A,): {EOS: 0.8, A: 0.1, B: 0.1}, (B,): {B: 1.0}, (B, B): {B: 1.0}},
}


class ScriptedModel:
    """The decoding interface of `Transformer` with table-driven distributions. Each row's prefix is
    read back from the KV cache, so a wrong beam reordering would read the wrong table row."""

    def __init__(self):
        self.config = SimpleNamespace(eos_id=EOS, pad_id=0, decoder_start_id=1, max_len=100,
                                      target_vocab_size=5)
        self.rows_per_step: list[int] = []
        self.one_row_step = None  # no compiled step (`Transformer.one_row_step`)

    def encode(self, src):
        return src[:, :1, None].float()  # (B, 1, 1): the script id is the memory

    def src_mask(self, src):
        return (src != 0)[:, None, None, :]

    def new_cache(self, batch_size, max_len, *, beam_size=1):
        return KVCache(1, batch_size, 1, 1, max_len, beam_size=beam_size)

    def decode(self, tgt_in, memory, src_mask, cache):
        rows = tgt_in.shape[0]
        self.rows_per_step.append(rows)
        ids = tgt_in.float()[:, None, :, None]  # (R, 1, 1, 1): stored as keys to follow reorders
        prefixes, _ = cache.append(0, ids, ids)
        cache.advance(1)
        logits = torch.full((rows, 1, 5), float("-inf"))
        for r in range(rows):
            prefix = tuple(int(x) for x in prefixes[r, 0, 1:, 0])  # without the start token
            script = SCRIPTS[int(memory[r * memory.shape[0] // rows, 0, 0])]
            for token, p in script.get(prefix, {EOS: 1.0}).items():
                logits[r, 0, token] = math.log(p)
        return logits


def scripted(config):
    model = ScriptedModel()
    hyps = beam_search(model, torch.tensor([[5, 2], [6, 2]]), config)
    return model, [[(h.tokens, h.score) for h in sentence] for sentence in hyps]


def test_scripted_beam_search_without_length_penalty():
    model, hyps = scripted(DecodeConfig(beam=2, n_best=2, lenpen=0.0))
    assert hyps[0] == [([B, EOS], pytest.approx(math.log(0.4 * 0.9))),
                       ([A, EOS], pytest.approx(math.log(0.6 * 0.4)))]
    assert hyps[1] == [([A, EOS], pytest.approx(math.log(0.55 * 0.5))),
                       ([B, B, EOS], pytest.approx(math.log(0.45 * 0.6 * 0.95)))]
    # one row per sentence in the first step (its beams are one empty hypothesis), then K = 2 each;
    # sentence 0 finished after step 2 and left the batch
    assert model.rows_per_step == [2, 4, 2]


def test_scripted_beam_search_length_penalties_prefer_the_longer_hypothesis():
    gnmt = lambda n: ((5 + n) / 6) ** 0.6  # noqa: E731 (the paper's alpha; |Y| counts EOS)
    _, hyps = scripted(DecodeConfig(beam=2, n_best=2, lenpen=0.6))
    assert hyps[1] == [([B, B, EOS], pytest.approx(math.log(0.45 * 0.6 * 0.95) / gnmt(3))),
                       ([A, EOS], pytest.approx(math.log(0.55 * 0.5) / gnmt(2)))]
    _, hyps = scripted(DecodeConfig(beam=2, n_best=1, lenpen=1.0, lenpen_kind="power"))
    assert hyps[1] == [([B, B, EOS], pytest.approx(math.log(0.45 * 0.6 * 0.95) / 3))]


def test_scripted_beam_search_goes_on_while_a_live_hypothesis_could_still_win_at_the_length_limit():
    """Script 7 with beam 2, alpha 2, at most 4 tokens: [EOS] and [A, EOS] finish in the first two steps;
    the live [B, B] (log P = log 0.15) cannot beat [A, EOS] if it ended now (lp(3)), but can at lp(4), and
    does: [B, B, B, EOS]. A stopping bound using the smaller penalty stopped with [A, EOS] second."""
    gnmt = lambda n: ((5 + n) / 6) ** 2.0
    config = DecodeConfig(beam=2, n_best=2, lenpen=2.0, max_len_a=0, max_len_b=4)
    hyps = beam_search(ScriptedModel(), torch.tensor([[7, 2]]), config)
    assert math.log(0.15) / gnmt(3) < math.log(0.35 * 0.8) / gnmt(2) < math.log(0.15) / gnmt(4)  # the case
    assert [(h.tokens, h.score) for h in hyps[0]] == [
        ([EOS], pytest.approx(math.log(0.5))), ([B, B, B, EOS], pytest.approx(math.log(0.15) / gnmt(4)))]


def test_scripted_greedy_and_max_length():
    model = ScriptedModel()
    hyps = greedy_search(model, torch.tensor([[5, 2], [6, 2]]), DecodeConfig(beam=1, lenpen=0.0))
    assert [(h[0].tokens, h[0].score) for h in hyps] == [
        ([A, EOS], pytest.approx(math.log(0.6 * 0.4))), ([A, EOS], pytest.approx(math.log(0.55 * 0.5)))]
    cut = beam_search(ScriptedModel(), torch.tensor([[6, 2]]), DecodeConfig(beam=2, max_len_a=0, max_len_b=1))
    assert cut[0][0].tokens == [A]  # cut at one token, no EOS: |Y| = 1


# --- exhaustive search, beam 1, batching ---------------------------------------------------------------


@pytest.mark.parametrize("alpha,kind", [(0.0, "none"), (0.6, "gnmt"), (1.0, "power")])
def test_wide_beam_finds_the_exhaustive_best(alpha, kind):
    torch.manual_seed(4)  # a model where beam 2 misses the best output for every penalty below
    model = tiny_model(vocab_size=6)
    src = torch.tensor([4, 3, 4, 2])
    eos, others = model.config.eos_id, [t for t in range(6) if t not in (model.config.eos_id, 0)]  # 0: pad
    outputs = [list(p) + [eos] for n in range(3) for p in itertools.product(others, repeat=n)]
    outputs += [list(p) for p in itertools.product(others, repeat=3)]  # cut at the maximum length 3
    best = max(outputs, key=lambda y: full_log_prob(model, src, y) / length_penalty(len(y), alpha, kind))
    config = DecodeConfig(beam=64, lenpen=alpha, lenpen_kind=kind, max_len_a=0, max_len_b=3)
    assert beam_search(model, src[None], config)[0][0].tokens == best  # 64 > 4^2 beams hold every prefix
    narrow = DecodeConfig(beam=2, lenpen=alpha, lenpen_kind=kind, max_len_a=0, max_len_b=3,
                          early_stopping=True)
    assert beam_search(model, src[None], narrow)[0][0].tokens != best  # so the search problem is not trivial


@pytest.mark.parametrize("vocab, limit, beam", [(4, 1, 4), (4, 3, 16), (5, 2, 16), (8, 1, 8),  # fewer
                                                 (4, 30, 16), (50, 1, 8), (5, 1, 4)])  # all n_best
def test_n_best_falls_short_only_where_fewer_outputs_fit_the_length_limit(vocab, limit, beam):
    """The outputs of at most `limit` tokens over `vocab` ids (padding never one, EOS ending one early) are
    sum(m**i for i <= limit), m = vocab - 2; a sentence gets fewer than n_best hypotheses exactly when
    that is less than n_best: a tiny vocabulary alone (4 ids, 30 tokens) or a one-token limit alone (50
    ids) gives them all, which translate_stream's docstring said it did not."""
    torch.manual_seed(0)
    model = tiny_model(vocab_size=vocab)
    src = padded_batch([4, 6], vocab)  # (B, S)
    possible = sum((vocab - 2) ** i for i in range(limit + 1))
    for early_stopping in (False, True):
        config = DecodeConfig(beam=beam, n_best=beam, max_len_a=0.0, max_len_b=limit)
        hyps = generate(model, src, dataclasses.replace(config, early_stopping=early_stopping))
        assert [len(h) for h in hyps] == [min(beam, possible)] * 2
        assert all(len({tuple(h.tokens) for h in s}) == len(s) for s in hyps)  # each a different output


def test_beam_one_equals_greedy():
    model = tiny_model()
    src = padded_batch([5, 3, 7, 1], 50)
    # alpha 0: once EOS is the best token no continuation can beat it (log P only falls), so the beam
    # of 1 stops where greedy search does (early_stopping, which did the same, is refused at beam 1)
    config = DecodeConfig(beam=1, lenpen=0.0, max_len_a=0.0, max_len_b=12)
    greedy, beam = greedy_search(model, src, config), beam_search(model, src, config)
    for g, b in zip(greedy, beam):
        assert g[0].tokens == b[0].tokens and g[0].score == pytest.approx(b[0].score, abs=1e-5)


@pytest.mark.parametrize("beam", [1, 4])
def test_batch_translates_as_each_sentence_alone(beam):
    model = tiny_model()
    lengths = [5, 2, 7]
    src = padded_batch(lengths, 50)
    config = DecodeConfig(beam=beam, n_best=beam, max_len_a=1.0, max_len_b=4)
    batch = generate(model, src, config)
    for i, n in enumerate(lengths):
        alone = generate(model, src[i : i + 1, :n], config)[0]
        assert [h.tokens for h in batch[i]] == [h.tokens for h in alone]
        assert [h.score for h in batch[i]] == pytest.approx([h.score for h in alone], abs=1e-5)


def test_min_and_max_length():
    model = tiny_model()
    src = padded_batch([3, 6], 50)
    forced = generate(model, src, DecodeConfig(beam=4, min_len=9, max_len_a=0.0, max_len_b=9))
    assert all(len(h[0].tokens) == 9 and model.config.eos_id not in h[0].tokens for h in forced)
    short = generate(model, src, DecodeConfig(beam=1, max_len_a=2.0, max_len_b=1))
    assert all(len(h[0].tokens) <= 2 * n + 1 for h, n in zip(short, [3, 6]))


# --- length penalty and sampling ---------------------------------------------------------------------


def test_length_penalty_hand_computed_values():
    assert length_penalty(10, 0.6, "gnmt") == pytest.approx(1.7328621, abs=1e-6)  # (15/6)^0.6 = 2.5^0.6
    assert length_penalty(2, 0.6, "gnmt") == pytest.approx(1.0969026, abs=1e-6)  # (7/6)^0.6
    assert length_penalty(1, 0.6, "gnmt") == 1.0  # (6/6)^alpha: one token is never penalized
    assert length_penalty(10, 0.6, "power") == pytest.approx(3.9810717, abs=1e-6)  # 10^0.6
    assert length_penalty(7, 0.0, "power") == length_penalty(7, 0.6, "none") == 1.0
    with pytest.raises(ValueError, match="wnmt"):
        length_penalty(3, 0.6, "wnmt")


def test_sampling_is_seeded_and_filters():
    model = tiny_model()
    src = padded_batch([5, 3], 50)
    config = DecodeConfig(beam=1, sample=True, seed=3, n_best=2, top_p=0.9, max_len_b=5)
    first, again = generate(model, src, config), generate(model, src, config)
    assert [[h.tokens for h in s] for s in first] == [[h.tokens for h in s] for s in again]
    assert all(len(s) == 2 for s in first)
    top1 = generate(model, src, DecodeConfig(beam=1, sample=True, seed=1, top_k=1, max_len_b=5))
    greedy = generate(model, src, DecodeConfig(beam=1, max_len_b=5))
    assert [s[0].tokens for s in top1] == [s[0].tokens for s in greedy]
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    kept = filter_logits(logits, top_k=0, top_p=0.8).isfinite()  # 0.5 + 0.3 reaches 0.8: two tokens
    assert kept.tolist() == [[True, True, False, False]]
    assert filter_logits(logits, top_k=3, top_p=1.0).isfinite().tolist() == [[True, True, True, False]]


def test_top_p_keeps_the_smallest_set_reaching_p():
    """Against exact fractions: with p the mass of the j best tokens, exactly those j stay (rounding in
    log, softmax and the sum kept a (j+1)th in 243 of 1,050 such cases)."""
    from fractions import Fraction
    from itertools import combinations

    cases = 0
    for n in (3, 4, 5):
        for weights in combinations(range(9, 0, -1), n):  # distinct, best first
            total = sum(weights)
            logits = torch.tensor([[math.log(w / total) for w in weights]])
            for j in range(1, n):
                p = float(Fraction(sum(weights[:j]), total))
                kept = filter_logits(logits, top_k=0, top_p=p).isfinite()[0].tolist()
                assert kept == [True] * j + [False] * (n - j), (weights, j)
                cases += 1
    assert cases > 1000
    for tiny in (1e-6, 1e-9):  # the most likely token stays, however small top_p is
        assert filter_logits(torch.tensor([[0.0, -1.0]]), top_k=0, top_p=tiny).isfinite().tolist() == [[True, False]]


def test_unseeded_sampling_leaves_the_global_generator_alone():
    model = tiny_model()
    src = padded_batch([5, 3], 50)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    generate(model, src, DecodeConfig(beam=1, sample=True, max_len_b=3))  # seed None: a random one
    assert torch.equal(torch.rand(3), expected)


def test_decode_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="n_best"):
        DecodeConfig(beam=2, n_best=3)
    with pytest.raises(ConfigError, match="lenpen_kind"):
        DecodeConfig(lenpen_kind="gnmt2")
    with pytest.raises(ConfigError, match="sample"):
        DecodeConfig(beam=4, sample=True)


@pytest.mark.parametrize("settings", [{"beam": 1}, {"sample": True, "beam": 1}])
def test_early_stopping_is_refused_where_it_would_be_ignored(settings):
    """Beam 1 is greedy search (sampling too): no beam to stop early, so the option was silently a no-op."""
    with pytest.raises(ConfigError, match=r"early_stopping=True needs beam > 1, not 1"):
        DecodeConfig(early_stopping=True, **settings)
    assert DecodeConfig(beam=2, early_stopping=True).early_stopping


SAMPLING = {"sample": True, "beam": 1}


@pytest.mark.parametrize("settings, message", [
    ({"lenpen": math.nan}, "lenpen=nan"),  # NaN scores: silently different translations
    ({"lenpen": math.inf}, "lenpen=inf"),
    ({"lenpen": -math.inf}, "lenpen=-inf"),
    ({"lenpen": 1000.0}, "lenpen=1000.0"),  # lp(|Y|) overflowed
    ({"lenpen": -1000.0}, "lenpen=-1000.0"),  # lp(|Y|) was 0: ZeroDivisionError
    ({"max_len_a": math.nan}, "max_len_a=nan"),
    ({"max_len_a": math.inf}, "max_len_a=inf"),
    ({"max_len_a": 0.0, "max_len_b": 0}, "max_len_a=0.0 and max_len_b=0 allow no output token"),
    ({"max_len_a": 0.0, "max_len_b": 2, "min_len": 3},  # every output was cut at 2, without EOS
     "min_len=3 is more than the max_len_b=2 tokens that max_len_a=0.0 allows"),
    ({"temperature": math.nan, **SAMPLING}, "temperature=nan"),  # torch: probability tensor contains nan
    ({"temperature": math.inf, **SAMPLING}, "temperature=inf"),
    ({"temperature": 1e-50, **SAMPLING}, "temperature=1e-50"),  # 0 in float32: 0 / 0
    ({"temperature": 1e39, **SAMPLING}, r"temperature=1e\+39 must be a number in \[0.001, 3.403e\+38\]"),  # inf
    ({"top_p": math.nan, **SAMPLING}, "top_p=nan"),
    ({"seed": 2**64, **SAMPLING}, "seed=18446744073709551616"),  # torch: Overflow when unpacking long long
    ({"seed": -(2**63) - 1, **SAMPLING}, "seed=-9223372036854775809"),
    ({"temperature": 0.5}, r"temperature=0.5 needs sample=True"),  # a search would ignore them
    ({"top_k": 3}, "top_k=3 needs sample=True"),
    ({"top_p": 0.5}, "top_p=0.5 needs sample=True"),
    ({"seed": 7}, "seed=7 needs sample=True"),
    ({"beam": 0}, r"DecodeConfig: beam=0 must be at least 1$"),  # not also "n_best=1 must be ... beam=0"
    ({"beam": 2**63}, r"beam=9223372036854775808 is more than 2147483647 rows"),  # torch: Overflow when ...
    ({"n_best": 10**20, **SAMPLING}, r"n_best=100000000000000000000 is more than 2147483647 rows"),
    ({"n_best": 0, **SAMPLING}, r"DecodeConfig: n_best=0 must be at least 1$"),  # not "between 1 and beam=1"
])
def test_decode_config_refuses_values_a_search_cannot_use(settings, message):
    with pytest.raises(ConfigError, match=message):
        DecodeConfig(**settings)


@pytest.mark.parametrize("seed", [2**32, 2**32 + 1, 2**40 + 1, 2**64 - 1, -1, -(2**63)])
def test_a_seed_the_cpu_generator_cannot_tell_apart_is_refused(seed):
    """torch's CPU generator keeps a seed's low 32 bits: these were accepted, and drew what seed
    `seed % 2**32` draws (1 and 2**32 + 1 the same samples), while CUDA's generator drew others."""
    refusal = (rf"^DecodeConfig: seed={seed} must be between 0 and 2\*\*32 - 1 \(4,294,967,295\), the seeds "
               r"PyTorch's CPU generator tells apart$")
    with pytest.raises(ConfigError, match=refusal):
        DecodeConfig(seed=seed, **SAMPLING)


def test_the_seeds_accepted_draw_apart():
    """The extremes accepted reach the generator as they are, and each draws its own samples."""
    model = tiny_model()
    src = padded_batch([5, 3, 6], 50)
    drawn = set()
    for seed in (0, 1, 2**31, 2**32 - 1):
        config = DecodeConfig(seed=seed, temperature=3.0, n_best=4, max_len_b=8, **SAMPLING)
        assert sampling_generator(config, torch.device("cpu")).initial_seed() == seed
        drawn.add(str([[h.tokens for h in s] for s in generate(model, src, config)]))
    assert len(drawn) == 4


def test_decode_config_bounds_still_decode_with_finite_scores():
    """The extreme values accepted give finite scores and probabilities, and a huge max_len_a is capped."""
    model = tiny_model()
    src = padded_batch([5, 3], 50)
    for lenpen, kind in [(10.0, "power"), (-10.0, "power"), (10.0, "gnmt"), (-10.0, "gnmt")]:
        assert all(0 < length_penalty(n, lenpen, kind) < math.inf for n in (1, 2, 10**6))
        hyps = generate(model, src, DecodeConfig(beam=2, n_best=2, lenpen=lenpen, lenpen_kind=kind, max_len_b=5))
        assert all(math.isfinite(h.score) for s in hyps for h in s)
    cold = DecodeConfig(temperature=1e-3, seed=2**32 - 1, max_len_b=5, **SAMPLING)
    assert [s[0].tokens for s in generate(model, src, cold)] == [s[0].tokens for s in generate(model, src,
                                                                 DecodeConfig(beam=1, max_len_b=5))]
    generate(model, src, DecodeConfig(seed=0, max_len_b=5, **SAMPLING))  # the lowest seed
    hot = DecodeConfig(temperature=3.4028234663852886e38, seed=1, max_len_b=5, **SAMPLING)  # float32's largest
    assert all(math.isfinite(s[0].score) for s in generate(model, src, hot))
    assert DecodeConfig(max_len_a=1e308).max_lengths([1, 2, 3], 40) == [40, 40, 40]  # a * n = inf before int
    assert DecodeConfig(max_len_a=0.0, max_len_b=1).max_lengths([3], 40) == [1]  # the smallest maximum
    for a in (0.0, 0.5):  # a float of b overflowed: "OverflowError: int too large to convert to float"
        assert DecodeConfig(max_len_a=a, max_len_b=10**309).max_lengths([1, 3], 40) == [40, 40]
    assert DecodeConfig(max_len_a=0.5, max_len_b=39).max_lengths([1, 3, 4], 40) == [39, 40, 40]  # as before
    # 0.29 * 100 is 28.999999999999996 in floats: int() of it gave 28 tokens where --help promises 29
    assert DecodeConfig(max_len_a=0.29, max_len_b=0).max_lengths([100, 200], 1024) == [29, 58]


def test_one_generator_draws_on_across_batches():
    """The same sentence in two batches sharing a generator gets independent samples; a new generator
    per batch (what a caller must not do) repeats the first batch's draws."""
    model = tiny_model()
    src = padded_batch([6], 50)
    config = DecodeConfig(temperature=3.0, seed=1, max_len_a=0.0, max_len_b=8, **SAMPLING)
    shared = sampling_generator(config, src.device)
    draws = [generate(model, src, config, shared)[0][0].tokens for _ in range(4)]
    assert len({tuple(d) for d in draws}) > 1
    assert generate(model, src, config)[0][0].tokens == generate(model, src, config)[0][0].tokens == draws[0]


def test_searches_and_scoring_refuse_dropout_and_bad_batches():
    """A model in training mode (as `Transformer(config)` starts) dropped activations at every step: each
    search found, and each forced decoding scored, under another random model. An empty or 1-D batch
    failed in beam search's length limit or `source_lengths` before `encode` could name it."""
    from aiayn.decoding.ensemble import Ensemble
    from aiayn.decoding.score import force_decode

    model = tiny_model(dropout=0.3).train()
    src = padded_batch([5, 3], 50)
    calls = [lambda m: greedy_search(m, src, DecodeConfig(beam=1)),
             lambda m: beam_search(m, src, DecodeConfig(beam=3)),
             lambda m: generate(m, src, DecodeConfig(seed=1, **SAMPLING)),
             lambda m: force_decode(m, src, [[4, 2], [5, 2]])]
    for call in calls:
        for m in (model, Ensemble([model.eval(), tiny_model()]).eval()):
            model.train()  # also a member left in training mode inside an ensemble in eval mode
            with pytest.raises(ValueError, match=r"^the model is in training mode, .* call model.eval"):
                call(m)
        model.eval()
        assert call(model) == call(model)  # deterministic once in eval mode
    unused = tiny_model(dropout=0.0).train()  # training mode without dropout changes nothing: allowed
    assert generate(unused, src, DecodeConfig()) == generate(unused.eval(), src, DecodeConfig())
    for m in model.eval().modules():  # Monte Carlo dropout, switched on by hand: the caller's choice
        if type(m).__name__ == "Dropout":
            m.train()
    assert len({tuple(generate(model, src, DecodeConfig())[0][0].tokens) for _ in range(4)}) > 1
    model.eval()
    for beam in (1, 4):
        with pytest.raises(ValueError, match=r"^src has shape \(0, 3\): no token to read"):
            generate(model, torch.zeros(0, 3, dtype=torch.long), DecodeConfig(beam=beam))
        with pytest.raises(ValueError, match=r"^src has shape \(3,\): token ids are \(batch, length\)"):
            generate(model, torch.tensor([5, 6, 2]), DecodeConfig(beam=beam))
    with pytest.raises(ValueError, match=r"^generator is used only with sample=True$"):  # it was ignored
        generate(model, src, DecodeConfig(), torch.Generator())
    with pytest.raises(ValueError, match=r"^greedy_search keeps one hypothesis a sentence, not beam=2: call "
                                         r"beam_search, or generate, which picks the search$"):
        greedy_search(model, src, DecodeConfig(beam=2))  # searched greedily, silently
    for config in (None, {"beam": 4}):  # an AttributeError: "'NoneType' object has no attribute 'sample'"
        refusal = rf"^generate\(\) takes a DecodeConfig, not {type(config).__name__}: build one with "
        with pytest.raises(TypeError, match=refusal):
            generate(model, src, config)


def test_the_searches_refuse_sources_padded_on_the_left_or_without_eos():
    """A source padded on the left (or inside) was searched with its tokens at other positions, one without
    EOS, or a row of padding alone, as no training source was: each silently."""
    model = tiny_model()
    before = r"is padded before a token: sources are right-padded$"
    no_eos = r"does not end with EOS \(2\): every source does \(Tokenizer.encode_src\)$"
    bad = [([[5, 6, 2], [0, 7, 2]], f"1 {before}"), ([[5, 0, 6, 2]], f"0 {before}"),
           ([[5, 6, 2], [7, 8, 0]], f"1 {no_eos}"), ([[5, 6, 7]], f"0 {no_eos}"),
           ([[5, 2], [0, 0]], f"1 {no_eos}")]
    for config in (DecodeConfig(beam=1), DecodeConfig(beam=3), DecodeConfig(n_best=2, **SAMPLING)):
        config = dataclasses.replace(config, max_len_b=3)
        for rows, problem in bad:
            with pytest.raises(ValueError, match=rf"^src row {problem}"):
                generate(model, torch.tensor(rows), config)
        assert len(generate(model, torch.tensor([[5, 6, 2], [7, 2, 0]]), config)) == 2
        with pytest.raises(ValueError, match=r"^src has shape \(3,\): token ids are \(batch, length\)"):
            generate(model, torch.tensor([5, 6, 2]), config)  # sampling n_best 2: an IndexError before


# --- the two-pass top-k ------------------------------------------------------------------------------


@pytest.mark.parametrize("v, chunk", [(32_000, 128), (1_000, 16), (1_003, 16), (50, 16)])
def test_topk_rows_equals_torch_topk(v, chunk):
    """Values and indices equal `torch.topk`'s, with a partial last chunk, -inf entries (masked tokens,
    empty beams) and the largest entries bunched in one chunk or split across the tail."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, v, generator=gen)
    x[1, : v // 2] = float("-inf")  # half a row masked
    x[2, :-3] = float("-inf")  # only the tail is finite: fewer finite entries than k in another row
    x[3, 5:13] += 20.0  # the best eight side by side, in one chunk
    x[4, -2:] += 20.0  # two of the best in the partial last chunk
    x[5] = float("-inf")  # an empty beam
    for k in (1, 3, 8):
        values, indices = topk_rows(x, k, chunk)
        expected = x.topk(k, dim=1)
        torch.testing.assert_close(values, expected.values, rtol=0, atol=0)
        finite = expected.values.isfinite()  # -inf ties may come from any column
        assert torch.equal(indices[finite], expected.indices[finite])
        assert torch.equal(x.gather(1, indices), values)  # every index points at its value


@pytest.mark.parametrize("v, chunk", [(32_000, 128), (1_000, 16), (1_003, 16), (50, 16), (20, 16)])
def test_argmax_rows_equals_torch_argmax(v, chunk):
    """The same index as `torch.argmax`, ties included (the first of equal maxima), whether they fall in
    one chunk, in two chunks, or in a whole chunk and the partial last one; masked rows and NaN too."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, v, generator=gen)
    x[1, : v // 2] = float("-inf")  # half a row masked
    x[2] = float("-inf")  # nothing but -inf: index 0, as argmax
    x[3, [v // 3, 2 * v // 3]] = 30.0  # a tie across chunks: the first wins
    x[4, [3, 4]] = 30.0  # a tie inside one chunk
    x[5, [1, v - 1]] = 30.0  # a tie between the first chunk and the last entry
    x[6, v - 1] = 30.0  # the maximum is the last entry
    x[7, v - 2] = float("nan")  # NaN counts as the largest, as in torch.argmax
    x[8, [2, v - 1]] = float("nan")  # the first NaN wins
    x[9] = torch.arange(v, 0, -1, dtype=torch.float32)  # strictly falling: the maximum is entry 0
    x[10] = x[10].round()  # many exact ties
    for rows in (x, x[:1], x[[5, 6, 7]]):
        assert torch.equal(argmax_rows(rows, chunk), rows.argmax(1))

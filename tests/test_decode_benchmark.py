"""The decoding benchmark's Linear floor: it times the products of a real cached decoder step, and each
of its kernels computes x W^T."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from aiayn.config import model_config
from aiayn.decoding import DecodeConfig
from aiayn.decoding.search import source_mask, step_log_probs
from aiayn.model import Transformer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import decode  # noqa: E402


@pytest.mark.parametrize("rows", [1, 3])
def test_step_linear_shapes_are_the_products_of_a_cached_step(rows):
    """After the first step (which projects the source's K/V once), a decoder step's mm/addmm FLOPs,
    as torch counts them, are those of `step_linear_shapes` (attention's products are bmm, outside)."""
    torch.manual_seed(0)
    c = model_config("tiny", vocab_size=500, n_decoder_layers=3)
    model = Transformer(c).eval()
    src = torch.randint(3, 500, (rows, 7))
    with torch.inference_mode():
        memory, mask = model.encode(src), source_mask(model, src)
        cache = model.new_cache(rows, 8)
        last = torch.full((rows,), c.decoder_start_id)
        step_log_probs(model, last, memory, mask, cache, 0, DecodeConfig())
        with FlopCounterMode(display=False) as counter:
            step_log_probs(model, last, memory, mask, cache, 1, DecodeConfig())
    counted = counter.get_flop_counts()["Global"]
    linear = sum(n for op, n in counted.items() if op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    assert linear == 2 * rows * sum(i * o for i, o in decode.step_linear_shapes(c))


@pytest.mark.parametrize("rows", [1, 5])
def test_every_floor_kernel_computes_x_times_w_transposed(rows):
    w, x = torch.randn(24, 16), torch.randn(rows, 16)
    kernels = decode.floor_kernels(rows)
    assert {"MKL sgemm on W", "MKL sgemm on W^T"} <= set(kernels)
    for name, layout in kernels.items():
        torch.testing.assert_close(layout(w)(x), F.linear(x, w), msg=name)


def test_linear_floor_runs_the_steps_with_the_fastest_kernel():
    floor = decode.LinearFloor(model_config("tiny", vocab_size=500))
    assert floor(2, 1) == [decode.NEW_TOKENS] * 2
    assert floor(1, 3) == [decode.NEW_TOKENS]
    assert set(floor.chosen) == {2, 3}
    assert all(kernel in decode.floor_kernels(r) for r, kernel in floor.chosen.items())


def test_each_engine_is_taken_at_its_own_best_thread_count():
    measured = {"greedy, batch 1": {"aiayn fp32@1": 100.0, "CT2 float32@1": 120.0,
                                    "aiayn fp32@2": 150.0, "CT2 float32@2": 70.0}}
    per_threads = decode.by_threads(measured, [1, 2])
    assert per_threads == {1: {"greedy, batch 1": {"aiayn fp32": 100.0, "CT2 float32": 120.0}},
                           2: {"greedy, batch 1": {"aiayn fp32": 150.0, "CT2 float32": 70.0}}}
    best, count = decode.at_best(per_threads)
    assert best == {"greedy, batch 1": {"aiayn fp32": 150.0, "CT2 float32": 120.0}}
    assert count == {"greedy, batch 1": {"aiayn fp32": 2, "CT2 float32": 1}}


def test_thread_counts_parse_a_comma_list():
    assert decode.thread_counts("2,1,2") == [1, 2]
    for bad in ("0", "two", "1,"):
        with pytest.raises(decode.argparse.ArgumentTypeError):
            decode.thread_counts(bad)

"""The training step's speed-ups change no result: fast dropout, the math SDPA backend, the
one-pass loss gradient, projecting only real targets, and malloc keeping freed memory."""

import os
import resource
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import vm_flags

from aiayn.config import model_config
from aiayn.memory import HUGE_PAGE, cap_kernel_caches, keep_freed_memory, on_huge_pages, release_freed_memory
from aiayn.model import Transformer, target_positions
from aiayn.model.attention import sdpa
from aiayn.model.dropout import Dropout, dropout, keep_mask, keep_scale
from aiayn.train.loss import SmoothedCrossEntropy, block_rows, label_smoothed_nll


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_dropout_keeps_each_element_with_probability_1_minus_p(p):
    torch.manual_seed(0)
    n = 2_000_000
    kept = keep_mask(torch.Size([n]), p, torch.device("cpu")).double().mean().item()
    # Binomial standard deviation sqrt(p(1-p)/n) < 4e-4; p is rounded to a multiple of 2^-15.
    assert abs(kept - (1 - p)) < 2e-3


def test_dropout_masks_are_independent_across_the_four_slices_of_a_draw():
    torch.manual_seed(1)
    m = keep_mask(torch.Size([400_000, 4]), 0.5, torch.device("cpu")).double()  # one int64 per row
    corr = torch.corrcoef(m.T)  # (4, 4)
    assert (corr - torch.eye(4)).abs().max() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p", [1e-6, 0.1, 0.5, 1 - 1e-6])  # thresholds 0, 3277, 16384 and 2^15
def test_dropout_masks_keep_from_the_threshold_on_without_int16_overflow(p, dtype):
    # The reference in int32, from the same draws: four 15-bit uniforms per int64, kept from round(p 2^15)
    # on. Every one of the 2^15 uniforms occurs; int16 arithmetic must not wrap at either end.
    shape = torch.Size([1_000, 1_000])
    torch.manual_seed(4)
    draws = torch.empty(shape.numel() // 4, dtype=torch.int64).random_()
    kept = (draws.view(torch.int16).int() & (2**15 - 1)).view(shape) >= round(p * 2**15)  # int32
    for make in (lambda: keep_mask(shape, p, torch.device("cpu")),
                 lambda: keep_scale(shape, p, dtype, torch.device("cpu"))):
        torch.manual_seed(4)
        got = make()
        assert got.shape == shape and torch.equal(got != 0, kept)
        if got.dtype != torch.bool:
            assert got.dtype == dtype and torch.equal(got[kept], torch.full_like(got[kept], 1 / (1 - p)))


def test_dropout_scales_survivors_and_masks_the_gradient_like_F_dropout():
    torch.manual_seed(2)
    x = torch.randn(64, 33, 16, requires_grad=True)
    y = dropout(x, 0.3, training=True)
    kept = y != 0
    assert torch.allclose(y[kept], x[kept] / 0.7)
    y.backward(torch.ones_like(y))
    assert torch.allclose(x.grad, kept.float() / 0.7)
    # Same expectation as F.dropout's: the mean of many draws tends to x.
    mean = torch.stack([dropout(x, 0.3, True) for _ in range(400)]).mean(0)
    ref = torch.stack([F.dropout(x, 0.3, True) for _ in range(400)]).mean(0)
    assert (mean - x).abs().mean() < 0.06 and (ref - x).abs().mean() < 0.06
    assert torch.equal(Dropout(0.3).eval()(x), x) and torch.equal(dropout(x, 0.0, True), x)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_math_backend_for_bf16_training_matches_float64(causal):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 2, 9, 8, generator=g) for _ in range(3))
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 5:] = False
    mask = None if causal else mask  # the model passes one or the other (SDPA refuses both)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, is_causal=causal)
    ref.backward(torch.ones_like(ref))
    before = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    try:
        for allowed in (False, True):  # whatever the caller's global flag, it is left as it was
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)
            qb, kb, vb = (t.bfloat16().requires_grad_() for t in (q, k, v))  # the math-backend case
            out = sdpa(qb, kb, vb, mask, causal)
            assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed() == allowed
            assert out.dtype == torch.bfloat16 and (out.double() - ref).abs().max() < 3e-2
            out.backward(torch.ones_like(out))
            for low, high in ((qb, qd), (kb, kd), (vb, vd)):  # bf16 scores: a few bf16 roundings off
                assert (low.grad.double() - high.grad).abs().max() < 5e-2 * high.grad.abs().max()
    finally:  # a failure here must not change the attention of the tests that follow
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(before)


@pytest.mark.parametrize("grad_now", [False, True])  # the gradient made in the backward, or the forward
@pytest.mark.parametrize("rows", [3, 11, None])  # blocks of 3, 3, 3, 2 rows, one block, or a GPU's kernels
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_one_pass_loss_gradient_equals_autograd_through_F_cross_entropy(eps, rows, grad_now):
    g = torch.Generator().manual_seed(4)
    z = torch.randn(11, 17, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 17, (11,), generator=g)
    z0 = z.detach().clone()
    assert torch.autograd.gradcheck(lambda z: SmoothedCrossEntropy.apply(z, y, eps, rows, grad_now), (z,))
    smoothed, nll = SmoothedCrossEntropy.apply(z, y, eps, rows, grad_now)
    (grad,) = torch.autograd.grad(smoothed.sum(), z)
    ref = F.cross_entropy(z, y, label_smoothing=eps, reduction="none")
    (ref_grad,) = torch.autograd.grad(ref.sum(), z)
    assert torch.allclose(smoothed, ref, rtol=1e-12, atol=0)
    assert torch.allclose(nll, F.cross_entropy(z, y, reduction="none"), rtol=1e-12, atol=0)
    assert torch.allclose(grad, ref_grad, atol=1e-12)
    assert torch.equal(z.detach(), z0)  # the backward's blocks are copies: the logits are left alone


@pytest.mark.parametrize("weighted", [True, False])  # rows weighted, or the mean that training takes
@pytest.mark.parametrize("rows, grad_now", [(16, False), (16, True), (None, False)])
def test_loss_blocks_of_bf16_logits_match_one_float64_pass(rows, grad_now, weighted):
    """The CPU's cache-sized blocks (with a ragged last one), with the gradient made in the backward or
    already in the forward, and the GPU's whole-tensor kernels that upcast as they read, give the float64
    loss of the bfloat16 logits within float32 rounding, and their float64 gradient within a bf16
    rounding or two (G, then G times the mean's 1/70, for `grad_now`)."""
    g = torch.Generator().manual_seed(6)
    z = (torch.randn(70, 300, generator=g) * 4).bfloat16().requires_grad_()
    y = torch.randint(0, 300, (70,), generator=g)
    assert block_rows(z, elements=300 * 16) == 16  # 16, 16, 16, 16, 6
    smoothed, nll = SmoothedCrossEntropy.apply(z, y, 0.1, rows, grad_now)
    # unequal weights per row reach every block's gradient; or the mean that training backpropagates
    w = torch.randn(70, generator=g) if weighted else torch.full((70,), 1 / 70)
    (smoothed * w).sum().backward() if weighted else smoothed.mean().backward()
    z64 = z.detach().double().requires_grad_()
    ref = F.cross_entropy(z64, y, label_smoothing=0.1, reduction="none")
    ref_nll = F.cross_entropy(z64, y, reduction="none")
    (ref * w.double()).sum().backward()
    assert not nll.requires_grad  # a statistic
    assert torch.allclose(smoothed.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(nll.double(), ref_nll, rtol=1e-6, atol=1e-6)
    assert z.grad.dtype == torch.bfloat16
    assert torch.allclose(z.grad.double(), z64.grad, rtol=2**-7, atol=1e-9)  # within two bf16 roundings


def test_gradient_made_in_the_forward_is_the_backward_one_and_survives_underflow():
    """With a power-of-two scale (a mean over 64 rows) the forward's G times it is the backward's gradient
    bit for bit; a reference probability that underflows float32 (z_y 200 below the top) still gives the
    exact NLL; and without autograd (validation) no gradient is made."""
    g = torch.Generator().manual_seed(7)
    z = (torch.randn(64, 500, generator=g) * 4).bfloat16()
    y = torch.randint(0, 500, (64,), generator=g)
    z[0, y[0]] = -200.0
    grads, nlls = [], []
    for grad_now in (False, True):
        zz = z.clone().requires_grad_()
        smoothed, nll = SmoothedCrossEntropy.apply(zz, y, 0.1, 16, grad_now)
        smoothed.mean().backward()
        grads.append(zz.grad)
        nlls.append(nll)
    assert torch.equal(grads[0], grads[1])
    ref = F.cross_entropy(z.double(), y, reduction="none")
    assert ref[0] > 200 and torch.allclose(nlls[1].double(), ref, rtol=1e-6)
    assert torch.allclose(nlls[0], nlls[1], rtol=1e-6)
    with torch.no_grad():
        loss, _ = label_smoothed_nll(z.requires_grad_(), y, 0.1, None)
    assert loss.grad_fn is None


def test_projecting_only_real_targets_gives_the_same_loss_and_gradients():
    torch.manual_seed(5)
    model = Transformer(model_config("micro", vocab_size=40, dropout=0.0))
    src = torch.randint(4, 40, (3, 6))
    tgt = torch.randint(4, 40, (3, 8))
    tgt[0, 5:] = 0
    tgt[2, 2:] = 0
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    full, _ = label_smoothed_nll(model(src, tgt_in), tgt_out, 0.1, 0)
    g_full = torch.autograd.grad(full, list(model.parameters()))
    positions = target_positions(tgt_out, 0)  # (N,)
    part, _ = label_smoothed_nll(model(src, tgt_in, positions), tgt_out.flatten()[positions], 0.1, None)
    g_part = torch.autograd.grad(part, list(model.parameters()))
    assert part.item() == pytest.approx(full.item(), rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g_full, g_part))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_large_blocks_are_reused_without_new_page_faults():
    def faults_of_a_fresh_64mb_tensor() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 * 2**20)  # 64 MiB, freed at once
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    if not keep_freed_memory():
        pytest.skip("not glibc")
    # The heap grows for the first few: torch's aligned allocations fit a freed block of the same size
    # only once neighbouring free blocks have merged (in a fresh process, the fifth allocation here).
    for _ in range(8):
        faults_of_a_fresh_64mb_tensor()
    assert max(faults_of_a_fresh_64mb_tensor() for _ in range(3)) < 1000  # 16,384 4-KiB pages if mmap'd anew


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_gives_free_pages_in_the_middle_of_the_heap_back():
    def resident_bytes() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()

    if not keep_freed_memory():
        pytest.skip("not glibc")
    blocks = [torch.ones(8 * 2**20 + i) for i in range(16)]  # 16 x 32 MiB, touched, so resident
    del blocks[::2]  # 256 MiB free between live blocks: no trim of the heap's top can return it
    before = resident_bytes()
    assert release_freed_memory()
    assert before - resident_bytes() > 200 * 2**20


def test_kernel_caches_are_capped_unless_the_environment_already_sets_them(monkeypatch):
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")  # the user's choice stands
    assert cap_kernel_caches() == {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "512"}
    assert os.environ["LRU_CACHE_CAPACITY"] == "64" and os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_huge_page_copies_are_equal_aligned_and_advised_for_huge_pages():
    tensors = [torch.randn(3 * HUGE_PAGE // 4), torch.randn(7, 5).double(), torch.arange(3), torch.randn(0),
               torch.randn(6, 4).t()]  # float32 over a huge page, float64, int64, empty, not contiguous
    copies = on_huge_pages(tensors)
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t) and c.is_contiguous()
        assert c.data_ptr() % 64 == 0 and (c.numel() == 0 or c.data_ptr() != t.data_ptr())
    ends = sorted((c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in copies if c.numel())
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:]))  # side by side, no overlap
    assert copies[0].data_ptr() % HUGE_PAGE == 0  # the first starts a huge page
    assert "hg" in vm_flags(copies[0].data_ptr())  # the mapping carries MADV_HUGEPAGE
    assert vm_flags(copies[0].data_ptr()) == vm_flags(copies[-1].data_ptr())
    copies[1][0, 0] = 1e9  # copies, not views of the originals
    assert tensors[1][0, 0] != 1e9
    del tensors
    assert torch.equal(copies[2], torch.arange(3))  # the mapping outlives everything but the copies
    assert on_huge_pages([]) == []
    weight = torch.nn.Parameter(torch.randn(3, 4))
    (leaf,) = on_huge_pages(t for t in [weight])  # any iterable; a parameter's copy is a plain leaf
    assert leaf.is_leaf and not leaf.requires_grad and torch.equal(leaf, weight.detach())

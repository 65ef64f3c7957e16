"""The schedule against equation 3 and the loss against a direct computation of H(q, p)."""

import math

import pytest
import torch
import torch.nn.functional as F

from aiayn.train.loss import label_smoothed_nll
from aiayn.train.schedule import cooldown_factor, inverse_sqrt_lr


@pytest.mark.parametrize("step", [1, 10, 1000, 3999, 4000, 4001, 10000, 100000])
def test_schedule_is_equation_3(step):
    d_model, warmup = 512, 4000
    expected = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    assert inverse_sqrt_lr(step, d_model, warmup) == pytest.approx(expected, rel=1e-12)
    assert inverse_sqrt_lr(step, d_model, warmup, scale=2.0) == pytest.approx(2 * expected, rel=1e-12)


def test_schedule_peaks_at_warmup():
    lrs = [inverse_sqrt_lr(s, 512, 4000) for s in range(1, 20001)]
    assert max(range(len(lrs)), key=lrs.__getitem__) + 1 == 4000
    assert lrs[3999] == pytest.approx(6.987712429686844e-4, rel=1e-12)  # 512^-0.5 * 4000^-0.5
    assert lrs[0] == pytest.approx(lrs[3999] / 4000, rel=1e-12)  # linear warmup from step 1
    assert lrs[15999] == pytest.approx(lrs[3999] / 2, rel=1e-12)  # 4x the steps, half the rate


def test_schedule_takes_step_0_as_step_1():
    """Its docstring's promise: equation 3 has no value at step 0 (0^-0.5), which a caller asking for the
    rate before the first update would otherwise get as a ZeroDivisionError."""
    first = 512**-0.5 * 4000**-1.5  # equation 3 at step 1
    assert inverse_sqrt_lr(0, 512, 4000) == inverse_sqrt_lr(1, 512, 4000) == pytest.approx(first, rel=1e-12)


@pytest.mark.parametrize(
    "progress, cooldown, expected",
    [(0.0, 0.3, 1.0), (0.7, 0.3, 1.0), (0.85, 0.3, 0.5), (0.97, 0.3, 0.1), (1.0, 0.3, 0.0), (1.2, 0.3, 0.0),
     (0.99, 0.0, 1.0), (0.5, 0.5, 1.0), (0.75, 0.5, 0.5)],
)
def test_cooldown_is_linear_to_zero_over_the_last_fraction(progress, cooldown, expected):
    assert cooldown_factor(progress, cooldown) == pytest.approx(expected, abs=1e-12)


def direct_smoothed_ce(logits, target, eps, pad):
    """-sum_v q_v log p_v with q = (1 - eps) onehot + eps / V, in float64, skipping pads."""
    lp = torch.log_softmax(logits.double(), -1)
    v = logits.shape[-1]
    loss = nll = 0.0
    for b in range(target.shape[0]):
        for t in range(target.shape[1]):
            y = int(target[b, t])
            if y == pad:
                continue
            q = torch.full((v,), eps / v, dtype=torch.float64)
            q[y] += 1 - eps
            loss += float(-(q * lp[b, t]).sum())
            nll += float(-lp[b, t, y])
    return loss, nll


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_loss_against_direct_computation(eps):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 3
    target = torch.randint(1, 11, (3, 5), generator=g)
    target[0, 3:] = 0  # padding, id 0
    target[2, 1:] = 0
    loss, nll = label_smoothed_nll(logits, target, eps, ignore_index=0)
    want_loss, want_nll = direct_smoothed_ce(logits, target, eps, pad=0)
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    assert float(nll) == pytest.approx(want_nll, rel=1e-5)
    # PyTorch's own label smoothing is the same distribution.
    torch_loss = F.cross_entropy(
        logits.view(-1, 11), target.view(-1), ignore_index=0, label_smoothing=eps, reduction="sum"
    )
    assert float(loss) == pytest.approx(float(torch_loss), rel=1e-5)


def test_padding_changes_nothing():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 4, 7, generator=g)
    target = torch.tensor([[3, 4, 5, 6]])
    padded_logits = torch.cat([logits, torch.randn(1, 3, 7, generator=g) * 100], dim=1)
    padded_target = torch.tensor([[3, 4, 5, 6, 0, 0, 0]])
    a = label_smoothed_nll(logits, target, 0.1, 0)
    b = label_smoothed_nll(padded_logits, padded_target, 0.1, 0)
    assert torch.allclose(a[0], b[0]) and torch.allclose(a[1], b[1])


def test_gradient_flows_and_bf16_logits_are_upcast():
    logits = torch.randn(2, 3, 9, requires_grad=True)
    target = torch.tensor([[1, 2, 0], [4, 0, 0]])
    loss, _ = label_smoothed_nll(logits.bfloat16(), target, 0.1, 0)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logits.grad[0, 2].abs().sum() == 0 and logits.grad[0, 0].abs().sum() > 0  # pads get no gradient
    assert math.isfinite(loss.item())


def test_mismatched_shapes_and_eps_are_refused_and_nothing_scored_has_zero_gradient():
    """(3, V) logits with 2 targets gave a number read past the logits (5e23 in one run); eps outside
    [0, 1] a number; and a batch whose every target is ignored failed in the backward."""
    with pytest.raises(ValueError, match=r"^logits \(3, 10\) and target \(2,\): the target needs"):
        label_smoothed_nll(torch.randn(3, 10), torch.tensor([1, 2]), 0.1, None)
    with pytest.raises(ValueError, match=r"^logits \(2, 5, 10\) and target \(2, 4\)"):
        label_smoothed_nll(torch.randn(2, 5, 10), torch.zeros(2, 4, dtype=torch.long), 0.1, 0)
    for eps in (-0.5, 2.0, math.nan):
        with pytest.raises(ValueError, match="label smoothing eps="):
            label_smoothed_nll(torch.randn(3, 10), torch.tensor([1, 2, 3]), eps, None)
    logits = torch.randn(2, 3, 10, requires_grad=True)
    loss, nll = label_smoothed_nll(logits, torch.zeros(2, 3, dtype=torch.long), 0.1, 0)  # all padding
    loss.backward()
    assert loss.item() == nll.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))

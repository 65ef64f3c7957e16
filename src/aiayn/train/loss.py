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
from torch import Tensor


def label_smoothed_nll(
    logits: Tensor, target: Tensor, eps: float, ignore_index: int | None
) -> tuple[Tensor, Tensor]:
    """(..., V) logits, (...) target ids -> (smoothed loss sum, NLL sum) over non-ignored positions.

    The leading dimensions are (B, T) for a padded batch, or (N,) for the real target positions only:
    what training passes, with `ignore_index` None (nothing to drop; looking would wait for a GPU).
    Computed in float32 whatever the autocast dtype: a bf16 log-softmax over 37k classes loses the
    small probabilities that the smoothing term sums. The NLL is a statistic and carries no gradient.
    """
    if logits.shape[:-1] != target.shape:  # (3, V) with (2,) read past the logits, or broadcast
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)}: the target needs "
                         "the logits' shape without the last (vocabulary) dimension")
    if not 0.0 <= eps <= 1.0:  # a number outside is no distribution
        raise ValueError(f"label smoothing eps={eps} is not in [0, 1]")
    if ignore_index is not None:
        keep = target != ignore_index  # (...)
        if not bool(keep.all()):
            logits, target = logits[keep], target[keep]  # (N, V), (N,)
    logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)  # (N, V), (N,)
    grad_now = torch.is_grad_enabled() and logits.requires_grad  # training: the backward will follow
    smoothed, nll = SmoothedCrossEntropy.apply(logits, target, eps, block_rows(logits), grad_now)  # (N,) each
    return smoothed.sum(), nll.sum()


class SmoothedCrossEntropy(torch.autograd.Function):
    """Per-token smoothed loss and NLL of (N, V) logits, with the gradient written directly.

    With z the logits and lp = log_softmax(z): nll = -lp_y and smoothed = (1 - eps) nll - eps mean_v(lp_v),
    so d smoothed / dz = G = softmax(z) - (1 - eps) onehot(y) - eps / V. The NLL is a statistic, reported
    beside the loss that training minimizes: it carries no gradient.
    Autograd through log_softmax, gather and mean builds and adds three (N, V) gradients; this writes one.
    On a CPU the rows go through in blocks of about 2 MB a thread (`block_rows`) that stay in the cores'
    caches while they are upcast, (log-)softmaxed by PyTorch's fused kernels and cast back: memory sees
    the logits read once and their gradient written once, instead of about nine (N, V) float32 passes.

    `grad_now` (a CPU, in training): one softmax per block in the forward gives the loss and G at once,
    and G, in the logits' dtype, is kept instead of the logits; the backward only scales it by the one
    number that a sum or mean of the losses sends back. Against a log-softmax forward and a softmax
    backward that is half the exps and one upcast less: forward and backward of 2,048 x 32,000 bf16
    logits on two threads of an AMD EPYC, both interleaved in one run, about 49 against 70 ms; 2,048 x
    8,000, 13 against 19. Bf16 logits' gradient is then rounded twice (G, then G times the scale), at most
    half a bf16 unit more; with a power-of-two scale, such as the benchmark's 1 / 2,048, the two ways give
    the same bits. Without it (validation) only the logits are kept; a backward, if one comes, makes G then.
    On a GPU (`rows` None) whole-tensor kernels that cast as they read do it in fewer passes: forward
    log_softmax(dtype=float32) and its mean, backward softmax(dtype=float32), one addcmul and the cast;
    the CPU's blocks would be many small kernels, and broadcasting in-place ops run slowly there
    (an H200, `base` at a 25k-token batch, bf16: the loss's kernels took about 17 ms a step, against
    about 10 for F.cross_entropy's; benchmarks/RESULTS.md).
    tests/test_speedups.py checks it against `F.cross_entropy` and gradcheck.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, eps: float, rows: int | None,
                grad_now: bool) -> tuple[Tensor, Tensor]:
        acc = torch.promote_types(logits.dtype, torch.float32)  # at least float32
        ctx.eps, ctx.rows, ctx.acc, ctx.grad_now = eps, rows, acc, grad_now and rows is not None
        if rows is None:  # whole tensors, the log-softmax upcasting as it reads (a GPU)
            lp = torch.log_softmax(logits, dim=-1, dtype=acc)  # (N, V)
            lp_y, mean_lp = lp.gather(-1, target[:, None]).squeeze(-1), lp.mean(dim=-1)  # (N,) each
            del lp
            ctx.save_for_backward(logits, target)
        elif ctx.grad_now:
            lp_y, mean_lp, grad = _statistics_and_gradient(logits, target, eps, rows, acc)
            ctx.save_for_backward(grad, target)
        else:
            lp_y, mean_lp = _log_softmax_statistics(logits, target, rows, acc)
            ctx.save_for_backward(logits, target)
        nll = -lp_y  # (N,) -log p_y
        smoothed = (1.0 - eps) * nll - eps * mean_lp  # (N,): the smoothing's -mean_v log p_v
        ctx.mark_non_differentiable(nll)
        return smoothed, nll

    @staticmethod
    def backward(ctx, g_smoothed: Tensor, _: Tensor) -> tuple[Tensor, None, None, None, None]:
        saved, target = ctx.saved_tensors  # the logits, or with grad_now the gradient G
        logits, eps, rows, acc, vocab = saved, ctx.eps, ctx.rows, ctx.acc, saved.shape[-1]
        if rows is not None:  # a CPU: G from the forward (training), or made now from the saved logits
            grad = saved if ctx.grad_now else _statistics_and_gradient(logits, target, eps, rows, acc)[2]
            return _scaled(grad, g_smoothed), None, None, None, None
        # whole tensors (a GPU): softmax upcasts as it reads, addcmul scales in one pass
        uniform = (eps / vocab) * g_smoothed  # (N,) the smoothing's share of every class
        onehot = -(1.0 - eps) * g_smoothed  # (N,) added at the reference token
        p = torch.softmax(logits, dim=-1, dtype=acc)  # (N, V)
        torch.addcmul(-uniform[:, None], p, g_smoothed[:, None], out=p)  # p * g - uniform
        p.scatter_add_(-1, target[:, None], onehot[:, None])
        return p.to(logits.dtype), None, None, None, None


def _statistics_and_gradient(
    logits: Tensor, target: Tensor, eps: float, rows: int, acc: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """(N, V) logits, (N,) targets -> log p_y and mean_v log p_v of each row ((N,) each, in `acc`) and
    the smoothed loss's gradient G = p - (1 - eps) onehot(y) - eps / V ((N, V), the logits' dtype), from
    one softmax per block of `rows` rows. The log-sum-exp comes from the row's largest logit m and its
    probability exp(m - lse) = max_v p_v >= 1 / V, which cannot underflow: lse = m - log max_v p_v, and
    log p_y = z_y - lse holds where p_y itself is 0 in float32."""
    n, vocab = logits.shape
    grad = torch.empty_like(logits)  # (N, V)
    lp_y = torch.empty(n, dtype=acc, device=logits.device)  # (N,)
    mean_lp = torch.empty(n, dtype=acc, device=logits.device)  # (N,)
    narrow = logits.dtype != acc
    block = torch.empty(min(rows, n), vocab, dtype=acc, device=logits.device) if narrow else None
    hit = torch.full((min(rows, n), 1), -(1.0 - eps), dtype=acc, device=logits.device)  # G's at y
    for i in range(0, n, rows):
        j = slice(i, i + rows)
        p = grad[j] if block is None else block[: grad[j].shape[0]]  # (rows, V), in cache
        p.copy_(logits[j])  # z, upcast
        m, z_sum, z_y = p.amax(dim=-1), p.sum(dim=-1), p.gather(-1, target[j, None]).squeeze(-1)  # (rows,)
        # PyTorch's softmax kernel, not exp(z - lse): its vectorized exp runs about 1.5x faster than exp_'s
        # (one 32 x 32,000 block on this AMD EPYC: 334 against 511 us, copy included)
        torch.softmax(p, dim=-1, out=p)  # p, in place
        lse = m - p.amax(dim=-1).log()  # (rows,)
        torch.sub(z_y, lse, out=lp_y[j])
        torch.sub(z_sum / vocab, lse, out=mean_lp[j])
        p.sub_(eps / vocab).scatter_add_(-1, target[j, None], hit[: p.shape[0]])  # G
        if block is not None:
            grad[j] = p  # cast to the logits' dtype
    return lp_y, mean_lp, grad


def _scaled(grad: Tensor, g: Tensor) -> Tensor:
    """G times the (N,) gradient of the smoothed losses. Training sends one number for every row (a
    sum's or a mean's gradient, expanded: stride 0): one pass, computed in float32 and rounded once.
    Rows weighted differently go through an (N, V) float32 product."""
    if grad.shape[0] == 0:  # no position scored (every target ignored): nothing to scale
        return grad
    if g.numel() == 1 or g.stride(0) == 0:
        return torch.mul(grad, g[0])  # a 0-dim factor: the result keeps G's dtype, nothing read back
    return (grad * g[:, None]).to(grad.dtype)


def _log_softmax_statistics(
    logits: Tensor, target: Tensor, rows: int, acc: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(N, V) logits, (N,) targets -> log p_y and mean_v log p_v of each row, (N,) each in `acc`, from a
    log-softmax made `rows` rows at a time into one reused block of `acc` (float32, or float64 for
    float64 logits). PyTorch's fused log-softmax (max, sum of exp, write, one exp per value) in a block
    that stays allocated halved the forward against logsumexp and mean of a fresh float32 copy per block,
    whose temporaries made four more passes (2,048 x 32,000 bf16 logits, two threads of an AMD EPYC: 26.6
    against 52.6 ms)."""
    n, vocab = logits.shape
    lp_y = torch.empty(n, dtype=acc, device=logits.device)  # (N,)
    mean_lp = torch.empty(n, dtype=acc, device=logits.device)  # (N,)
    lp = torch.empty(min(rows, n), vocab, dtype=acc, device=logits.device)  # (rows, V), cache-sized
    for i in range(0, n, rows):
        j = slice(i, i + rows)
        block = lp[: logits[j].shape[0]]
        torch.log_softmax(logits[j], dim=-1, dtype=acc, out=block)
        torch.gather(block, -1, target[j, None], out=lp_y[j, None])
        torch.mean(block, dim=-1, out=mean_lp[j])
    return lp_y, mean_lp


def block_rows(logits: Tensor, elements: int | None = None) -> int | None:
    """Rows per block of `SmoothedCrossEntropy`: on a CPU about `elements` values, by default 2^19 (2 MB of
    float32) per thread, each thread's share of a block staying in its caches; None (whole tensors,
    kernels that cast as they read) on a GPU, where many small kernels would cost more than the memory
    passes they save. Forward and backward of 2,048 x V bf16 logits on an AMD EPYC (Zen 4), ms by elements
    per block and thread (2^17, 2^18, 2^19, 2^20, 2^21): V = 32,000, two threads 81.0, 69.8, 64.3, 68.5,
    86.2, one thread 141.5, 125.7, 119.0, 117.9, 138.3; V = 8,000, two threads 21.0, 19.1, 18.9, 19.3,
    26.1, one thread 35.8, 32.3, 30.7, 31.4, 39.3."""
    if logits.device.type != "cpu":
        return None
    elements = elements or 2**19 * min(torch.get_num_threads(), 8)  # measured up to two: not 128 MB at 64
    return max(1, elements // logits.shape[-1])

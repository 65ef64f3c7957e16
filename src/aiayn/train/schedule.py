"""The learning-rate schedule of the paper (section 5.3, equation 3).

    lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

It rises linearly for `warmup` steps, peaks at step = warmup with d_model^-0.5 * warmup^-0.5
(7.0e-4 for the base model with warmup 4000), then decays with the inverse square root of the step.
"""

from __future__ import annotations


def inverse_sqrt_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """Learning rate for update number `step` (counted from 1; step 0 is treated as 1)."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)

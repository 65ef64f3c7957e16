"""The learning-rate schedule of the paper (section 5.3, equation 3).

    lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)

It rises linearly for `warmup` steps, peaks at step = warmup with d_model^-0.5 * warmup^-0.5
(7.0e-4 for the base model with warmup 4000), then decays with the inverse square root of the step.

A run with a fixed budget (a number of minutes on a laptop) may end with a cooldown: the last part of
the budget takes the learning rate linearly down to 0, which settles the weights the way the paper's
checkpoint averaging does, and the two combine (Hagele et al., 2024, "Scaling Laws and
Compute-Optimal Training beyond Fixed Training Durations").
"""

from __future__ import annotations


def inverse_sqrt_lr(step: int, d_model: int, warmup: int, scale: float = 1.0) -> float:
    """Learning rate for update number `step` (counted from 1; step 0 is treated as 1)."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)


def cooldown_factor(progress: float, cooldown: float) -> float:
    """Multiplier of the lr: 1 until `1 - cooldown` of the budget is used, then linearly to 0 at its end.

    `progress` is the used fraction of the budget (time or updates); `cooldown` = 0 leaves the schedule as is.
    """
    if cooldown <= 0.0:
        return 1.0
    return min(1.0, max(0.0, (1.0 - progress) / cooldown))

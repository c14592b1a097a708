"""Learning-rate schedules as one pure function of the update number.

`lr_at(step, ...)` is the rate of optimizer update `step` (1-based: the first update is
step 1). Warmup rises linearly, `lr * step / warmup_steps`, reaching `lr` at
`step == warmup_steps`; after it, with progress `p = (step - warmup) / (total - warmup)`
clamped to [0, 1]:
- cosine:   min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2
- linear:   lr - (lr - min_lr) * p
- constant: lr
so the last update (`step == total_steps`) of a decaying schedule runs at `min_lr`. The
schedule has no state besides the step, which the checkpoint keeps.
"""

import math

SCHEDULES = ("cosine", "linear", "constant")


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int, schedule: str) -> float:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; supported: {', '.join(SCHEDULES)}")
    if warmup_steps > 0 and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    span = max(total_steps - warmup_steps, 1)
    progress = min(max((step - warmup_steps) / span, 0.0), 1.0)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr - (lr - min_lr) * progress

"""When a training loss oscillates: it keeps changing direction and no longer goes down.

QAT freezes BatchNorm statistics on it (``qat: {freeze_bn_on_oscillation: N}``): batch statistics
that move under fake quantization make the loss jump up and down, and the statistics the model
was trained with are the steadier ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["MIN_WINDOW", "loss_oscillates"]

MIN_WINDOW = 4  # the fewest losses that show a change of direction twice


def loss_oscillates(losses: Sequence[float]) -> bool:
    """True when the successive differences of ``losses`` change sign at least half the time
    (the loss goes up and down) and the later half of the window is on average lower than the
    earlier half by less than half a typical step (the loss is not going down through the
    noise). A steadily falling loss, noisy or not, and a steadily rising one do not oscillate."""
    if len(losses) < MIN_WINDOW:
        return False
    diffs = [b - a for a, b in itertools.pairwise(losses) if b != a]
    flips = sum(1 for a, b in itertools.pairwise(diffs) if (a > 0) != (b > 0))
    half = len(losses) // 2
    earlier = sum(losses[:half]) / half
    later = sum(losses[-half:]) / half
    if len(diffs) < 2 or 2 * flips < len(diffs) - 1:
        return False
    typical_step = sum(abs(d) for d in diffs) / len(diffs)
    return earlier - later < 0.5 * typical_step

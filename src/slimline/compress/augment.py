"""Input augmentation for distillation: the student learns the teacher's outputs on views of the
training rows that the rows alone do not show.

When a student distils from its FP32 teacher on unlabelled rows, the teacher labels whatever it
is shown, so any view of an input is a training example, as long as the teacher sees the same
view as the student (a "consistent teacher"). With few rows (QAT from an ONNX file has the
task's calibration rows and nothing else), the student otherwise learns those rows and the
held-out rows judge it on others. Two views of image rows (float inputs of rank 4,
``[N, C, H, W]``):

- ``flip``: each row mirrored left to right with probability 1/2;
- ``mixup``: each row replaced by ``lam * row + (1 - lam) * other``, another row of the batch,
  ``lam`` uniform in [0, 1] per row.

Only batches without labels are augmented (a mirrored image no longer matches its label map),
and only where every input is an image (a second input, e.g. an image size, would no longer
match a mixed row). The draw of step ``k`` is seeded with ``k``: a resumed run sees the views the
interrupted one would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

__all__ = ["AUGMENTS", "augment_rows", "augmentable"]

AUGMENTS = Literal["flip", "mixup"]


def augmentable(inputs: dict[str, np.ndarray]) -> bool:
    """True where every input is a float batch of images (rank 4) with more than zero rows."""
    return bool(inputs) and all(
        v.ndim == 4 and np.issubdtype(v.dtype, np.floating) and len(v) > 0 for v in inputs.values()
    )


def augment_rows(
    inputs: dict[str, np.ndarray], kinds: Sequence[str], step: int
) -> dict[str, np.ndarray]:
    """``inputs`` with the ``kinds`` of views applied (the same draw to every input), or as
    they were where they are not :func:`augmentable`."""
    if not kinds or not augmentable(inputs):
        return inputs
    rng = np.random.default_rng(step)
    n = len(next(iter(inputs.values())))
    out = {k: np.array(v, copy=True) for k, v in inputs.items()}
    if "flip" in kinds:
        rows = rng.random(n) < 0.5
        for x in out.values():
            x[rows] = x[rows][..., ::-1]
    if "mixup" in kinds and n > 1:
        other = (np.arange(n) + rng.integers(1, n, size=n)) % n  # never the row itself
        lam = rng.random(n)
        for k, x in out.items():
            w = lam.astype(x.dtype).reshape(n, 1, 1, 1)
            out[k] = w * x + (1 - w) * x[other]
    return out

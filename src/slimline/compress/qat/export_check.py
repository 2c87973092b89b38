"""The QAT export check: ONNX Runtime's outputs of the QDQ export against the fake-quant
model's, passing at a cosine bound or within the model's own noise floor (how far it disagrees
with itself under rounding-sized input noise)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...errors import StepError
from ...measure.quality import fidelity
from ..finetune import to_tensors
from . import fakequant as fq
from .held_out import output_arrays
from .sensitivity import cosine_score

__all__ = ["NOISE", "export_passes", "noise_floor", "verify_export"]


NOISE = 1e-6  # relative perturbation of the noise floor: float32 sums of a few hundred terms


def noise_floor(model: Any, sample: dict[str, np.ndarray], ref: list[np.ndarray]) -> float:
    """Mean cosine (of the worst output) of the fake-quant model's outputs on ``sample`` to its
    outputs when every value it quantizes (the input of each activation fake quant, the model's
    input among them) is moved by relative Gaussian noise of ``NOISE``: the difference a float
    implementation with another summation order makes at each layer, and so how far two correct
    implementations can be expected to disagree through this model. A quantized model is a step
    function: where a value sits near a rounding boundary, a change in its 6th digit moves it a
    whole step, and a deep network can amplify that step. 1.0 when the model has no activation
    fake quant."""
    import torch

    gen = torch.Generator().manual_seed(0)

    def jitter(module: Any, args: Any) -> Any:
        x = args[0]
        noise = torch.randn(x.shape, generator=gen, dtype=x.dtype) * NOISE
        return (x * (1.0 + noise), *args[1:])

    acts = list(fq.activation_fake_quants(model).values())
    if not acts:
        return 1.0
    handles = [m.register_forward_pre_hook(jitter) for m in acts]
    try:
        with torch.no_grad():
            moved = output_arrays(model(**to_tensors(sample)))
    finally:
        for h in handles:
            h.remove()
    return cosine_score(moved, ref)


def verify_export(
    model: Any, path: Path, sample: dict[str, np.ndarray], bound: float, threads: int
) -> dict[str, Any]:
    """ONNX Runtime's outputs against the fake-quant model's (cosine per row). The export passes
    at ``bound`` (the step's ``min_export_cosine``), or where ONNX Runtime disagrees with the
    fake-quant model no more than the fake-quant model disagrees with itself under rounding-sized
    input noise (:func:`noise_floor`), with the same slack: a different summation order cannot
    do better than that, and a wrong export (a missing Q/DQ pair, a wrong scale) does far worse."""
    import torch

    from ...measure.runners import ort_session

    with torch.no_grad():
        ref = output_arrays(model(**to_tensors(sample)))
    sess = ort_session(path, threads)
    got = sess.run(None, {k: np.ascontiguousarray(v) for k, v in sample.items()})
    each = [fidelity(g, r, logits=False) for g, r in zip(got, ref, strict=True)]
    agree = min(each, key=lambda f: f["cosine_mean"] or 0.0)  # the worst output's
    out: dict[str, Any] = {
        "rows": len(ref[0]),
        **{k: agree[k] for k in ("cosine_mean", "cosine_min", "max_abs_err")},
        "exporter": "torchscript (torch.onnx.export dynamo=False)",
        "bound": bound,
    }
    cosine = out["cosine_mean"] or 0.0
    if cosine >= bound:
        return {**out, "passed_by": "bound"}
    floor = noise_floor(model, sample, ref)
    out["noise_floor_cosine"] = floor
    if export_passes(cosine, floor, bound):
        return {**out, "passed_by": "noise floor"}
    raise StepError(
        f"ONNX Runtime's outputs of the QDQ export differ from the fake-quant model: mean "
        f"cosine {cosine:.5f} < {bound}, and below what the fake-quant model "
        f"gives itself under input noise of {NOISE:g} of its spread ({floor:.5f})"
    )


def export_passes(cosine: float, noise_floor: float, bound: float) -> bool:
    """The export check's rule: at ``bound``, or within the same slack (``1 - bound``) of the
    model's own agreement under rounding-sized input noise."""
    return cosine >= bound or cosine >= noise_floor - (1.0 - bound)

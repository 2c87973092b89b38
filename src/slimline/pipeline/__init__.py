"""Run a recipe: baselines, steps (cached by content hash), accept/reject, measure, record.

Order of work, one module each, read in this order:

1. :mod:`.run`: load the task, hash its model and data, build the FP32 baselines
   (``fp32-torch`` and its export ``fp32-onnx``) and the FP32 reference outputs on the
   evaluation data;
2. :mod:`.step`: run each step on the last accepted candidate. Its output is cached under a key
   that hashes its inputs; a rerun (or a resumed run) reuses it. A step that fails (an
   exporter, a pruning library, the quantizer), or whose output fails its check
   (``onnx.checker`` plus an ONNX Runtime load), evaluation or timing, is recorded as rejected
   with the error as its reason; only an error in the user's input
   (:func:`~slimline.errors.is_user_error`) stops the run at once;
3. :mod:`.judge`: the new candidate is kept only if it meets the budget AND is measurably
   faster (or smaller, when the objective is size) than its parent; otherwise it is recorded
   as rejected with the measured reason and the next step starts from the parent;
4. :mod:`.final`: measure every candidate of the chain interleaved (latency, throughput, RSS,
   size, metric, fidelity), then the per-operator and memory profiles;
5. :mod:`.manifest`: write the manifest and the artifacts, atomically (the report follows).
   When nothing can run any more (no FP32 baseline), the run stops with the manifest (status
   ``failed``, the reason) and the report written, and raises.

Beside them, :mod:`.state` holds the :class:`Run` every part reads and adds to, and
:mod:`.measurement` how a run measures a candidate (the same for a step's search, a verdict and
the final figures; a step's ``ctx.evaluate`` and ``ctx.compare`` land there).
"""

from __future__ import annotations

from .measurement import step_context
from .run import recipe_task, run_recipe, start_run
from .state import Run

__all__ = ["Run", "recipe_task", "run_recipe", "start_run", "step_context"]

"""NNCF's two INT8 paths (compress/nncf_ptq.py: the ONNX backend; compress/nncf_ov.py: the
documented OpenVINO path, an IR): the overflow fix follows the CPU kind, the ONNX backend gets
per-channel weights on an old-opset graph, and a candidate OpenVINO cannot convert is rejected
while the run goes on. What the files hold is checked, not the kernels' numbers, so the CPU kind
is chosen by the ``cpu_kind`` fixture and nothing here is marked ``cpu_kinds``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from quant_fixtures import TinyCNN, _seeded, batches, cnn_inputs, cnn_task

from slimline import api
from slimline.candidate import Candidate
from slimline.compress.nncf_ov import nncf_ov_alternative, nncf_ov_quantize
from slimline.compress.nncf_ptq import NncfConfig, nncf_quantize_onnx, overflow_fix_for
from slimline.compress.quant.candidates import cpu_formats
from slimline.compress.quant.config import QuantizeConfig, QuantSpec
from slimline.compress.quant.step import for_openvino
from slimline.cpu import CpuInt8
from slimline.export import export_module
from slimline.recipe import Recipe

pytest.importorskip("nncf", reason="the openvino extra is not installed")
pytest.importorskip("openvino", reason="the openvino extra is not installed")

HALF = 64  # NNCF's overflow fix: weights on half the 8-bit grid, |q| <= 64


def _qdq_weight_levels(path: Path) -> list[tuple[int, int]]:
    """(largest |q|, channels of its scale) of each INT8 weight a DequantizeLinear reads."""
    model = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = []
    for n in model.graph.node:
        q = inits.get(n.input[0])
        if n.op_type == "DequantizeLinear" and q is not None and q.dtype == np.int8 and q.ndim > 1:
            out.append((int(np.abs(q.astype(np.int32)).max()), inits[n.input[1]].size))
    return out


def _activation_zero_points(path: Path) -> set[np.dtype]:
    """The types of the zero points of the QuantizeLinear nodes on activations."""
    model = onnx.load(str(path))
    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    consts |= {
        n.output[0]: numpy_helper.to_array(n.attribute[0].t)
        for n in model.graph.node
        if n.op_type == "Constant"
    }
    return {
        consts[n.input[2]].dtype
        for n in model.graph.node
        if n.op_type == "QuantizeLinear" and n.input[0] not in consts
    }


def _ir_weight_levels(path: Path) -> list[int]:
    """Largest |q| of each INT8 constant (the quantized weights) in an OpenVINO IR."""
    import openvino as ov

    model = ov.Core().read_model(str(path))
    return [
        int(np.abs(op.get_data().astype(np.int32)).max())
        for op in model.get_ops()
        if op.get_type_name() == "Constant" and str(op.get_element_type()) == "<Type: 'int8_t'>"
    ]


def test_overflow_fix_follows_the_cpu_kind(
    cpu_kind: CpuInt8, cnn_onnx: Path, tmp_path: Path
) -> None:
    """Without VNNI every convolution's weights use half the grid in both NNCF paths (U8S8 pairs
    cannot saturate 16 bits); with VNNI NNCF's default leaves later layers the full grid. The
    ONNX backend quantizes an opset-11 graph's weights per channel (converted to opset 13)."""
    saturates = cpu_kind.u8s8_saturates
    assert overflow_fix_for("auto", cpu_kind) == ("enable" if saturates else None)
    assert overflow_fix_for("disable", cpu_kind) == "disable"
    old = export_module(_seeded(TinyCNN), cnn_inputs(0, 2), tmp_path / "cnn11.onnx", opset=11)
    cfg = NncfConfig(samples=16)
    calib = batches(cnn_inputs, 1, 16)
    meta = nncf_quantize_onnx(old, calib, tmp_path / "onnx.onnx", cfg)
    assert meta["opset_converted_from"] == 11
    # without VNNI (7-bit weights) the activation pairs are unsigned, which OpenVINO reads there
    unsigned = meta["activations_made_unsigned"]
    assert (unsigned > 0) == saturates
    kinds = _activation_zero_points(tmp_path / "onnx.onnx")
    assert (kinds == {np.dtype(np.uint8)}) if saturates else (np.dtype(np.int8) in kinds)
    levels = _qdq_weight_levels(tmp_path / "onnx.onnx")
    assert len(levels) == 5 and all(channels > 1 for _, channels in levels[:4])  # per channel
    ir_meta = nncf_ov_quantize(cnn_onnx, batches(cnn_inputs, 1, 16), tmp_path / "ov.xml", cfg)
    ir_levels = _ir_weight_levels(tmp_path / "ov.xml")
    assert ir_meta["backend"] == "openvino" and len(ir_levels) == 5
    assert (tmp_path / "ov.bin").is_file()
    _an_ir_runs_on_openvino_only(tmp_path / "ov.xml")
    for fix, tops in (
        (meta["overflow_fix"], [q for q, _ in levels]),
        (ir_meta["overflow_fix"], ir_levels),
    ):
        if saturates:
            assert fix == "enable" and max(tops) <= HALF, tops
        else:
            assert fix.startswith("nncf default") and max(tops) > HALF, tops


def _an_ir_runs_on_openvino_only(ir: Path) -> None:
    """An IR passes the candidate check (OpenVINO reads it), hashes and sizes with its weights,
    and ONNX Runtime's runner and server refuse it with the reason."""
    from slimline.candidate import artifact_size
    from slimline.errors import CandidateError, ServeError
    from slimline.measure.runners import check_candidate, make_runner
    from slimline.serve.model import make_backend

    check_candidate(ir)
    cand = Candidate("ir", "nncf", None, onnx=ir)
    assert artifact_size(ir) > ir.stat().st_size
    before = cand.content_hash()
    ir.with_suffix(".bin").write_bytes(ir.with_suffix(".bin").read_bytes()[::-1])
    assert cand.content_hash() != before  # the weights are part of the candidate
    with pytest.raises(CandidateError, match="runs on OpenVINO only"):
        make_runner(cand, 1, runtime="onnxruntime")
    with pytest.raises(ServeError, match="--runtime openvino"):
        make_backend(ir, 1, "onnxruntime")


def _ctx(tmp_path: Path, onnx_path: Path, runtime: str) -> Any:
    """A step context on the tiny CNN whose target runs ``runtime``, without a benchmark."""
    recipe = Recipe(name="t", task="tests", target={"threads": 1, "runtime": runtime})
    base = Candidate("fp32-onnx", "export", None, onnx=onnx_path)
    return api.context_for(
        cnn_task(onnx_path), recipe, tmp_path / "w", baseline=base, cache=tmp_path / "c",
        timed=False,
    )  # fmt: skip


def test_a_graph_openvino_cannot_convert_rejects_that_candidate_only(
    cnn_onnx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import openvino as ov

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "Exception from src/frontends/onnx/frontend/src/frontend.cpp:123:\n"
            "Check 'unknown_operators.empty()' failed at src/frontends/onnx/frontend/src/core/"
            "graph.cpp:210:\nOpenVINO does not support the following ONNX operations: FancyOp\n"
        )

    monkeypatch.setattr(ov, "convert_model", refuse)
    ctx = _ctx(tmp_path, cnn_onnx, "openvino")
    cfg = QuantizeConfig(mode="static", samples=16, mixed_precision=False, nncf=True)
    chosen = api.quantize(ctx, ctx.baseline, cfg)  # the step goes on
    assert chosen.onnx is not None and chosen.onnx.is_file()
    alts = {a.name: a for a in ctx.alternatives}
    ir, onnx_backend = alts["quantize-nncf-ov"], alts["quantize-nncf"]
    assert ir.accepted is False and ir.onnx is None
    assert ir.reason == (
        "failed: OpenVINO cannot convert cnn.onnx (ov.convert_model): OpenVINO does not support "
        "the following ONNX operations: FancyOp"
    )
    assert onnx_backend.onnx is not None and onnx_backend.meta["competes"]  # built, competes
    assert any("NNCF OpenVINO candidate was not built" in w for w in ctx.warnings)


def test_no_ir_is_built_where_the_target_never_runs_openvino(
    cnn_onnx: Path, tmp_path: Path
) -> None:
    ctx = _ctx(tmp_path, cnn_onnx, "onnxruntime")
    ir = nncf_ov_alternative(ctx.baseline, ctx, 16)
    assert ir.accepted is False and ir.onnx is None
    assert "runs on OpenVINO only" in ir.reason and "runtime: openvino or auto" in ir.reason
    assert not (tmp_path / "w" / "nncf-ov").exists()


def test_qdq_files_for_openvino_have_signed_weights_7_bit_without_vnni(cpu_kind: CpuInt8) -> None:
    """For a target that runs only OpenVINO, the QDQ settings keep INT8 weights (OpenVINO runs
    UINT8 weights in float), on 7 bits where U8S8 saturates; ONNX Runtime and auto keep all."""
    specs = [
        (QuantSpec("static", activation_type=a, weight_type=w, reduce_range=rr), None)
        for a, w, rr in cpu_formats(QuantizeConfig(), cpu_kind)
    ]
    kept = [sp for sp, _ in for_openvino(specs, "openvino")]
    assert kept and all(sp.weight_type == "int8" for sp in kept)
    assert all(sp.reduce_range == cpu_kind.u8s8_saturates for sp in kept)
    assert for_openvino(specs, "auto") == for_openvino(specs, "onnxruntime") == specs
    forced = [(QuantSpec("static", weight_type="uint8"), None)]  # the recipe asked for it
    assert for_openvino(forced, "openvino") == forced

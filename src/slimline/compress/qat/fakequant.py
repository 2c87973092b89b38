"""Fake quantization that simulates the INT8 format the ``quantize`` step deploys, and its export.

The format is the one :func:`slimline.compress.quant.candidates.cpu_formats` chooses for the CPU: U8
asymmetric per-tensor activations and S8 symmetric per-channel weights (range [-127, 127], as
ONNX Runtime's quantizer uses for symmetric INT8), 7-bit weights ([-64, 64]) where the CPU has
no VNNI. ``torch.ao.quantization``'s FX graph mode inserts the fake-quant modules (Conv-BN-ReLU
fused into QAT modules whose BatchNorm statistics can be frozen); for export each fused module is
replaced by a convolution with BatchNorm folded in and its weight already on the learned INT8
grid, and the TorchScript exporter writes every fake-quant op as a QuantizeLinear /
DequantizeLinear pair with the learned scale and zero point.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from ...cpu import CpuInt8
from ..quant.calibrate import ENTROPY_BINS, HISTOGRAM_BINS, bound_bins, hist_limit, subsample
from ..quant.candidates import cpu_formats
from ..quant.config import QuantizeConfig

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    import torch.ao.nn.intrinsic.qat as nniqat
    import torch.ao.nn.qat as nnqat
    from torch import Tensor, nn
    from torch.ao.quantization import FakeQuantize, FakeQuantizeBase, QConfig, QConfigMapping

    from ._modules import LearnedRange, QConv2d, QLinear

__all__ = [
    "CalibrationMethod",
    "FakeQuantFormat",
    "activation_fake_quants",
    "calibrate",
    "export_module_for",
    "fake_quant_modules",
    "format_for",
    "freeze_bn",
    "freeze_observers",
    "learn_ranges",
    "prepare",
    "range_parameters",
]


@dataclass(frozen=True)
class FakeQuantFormat:
    """The simulated INT8 format (what ``quantize`` would deploy on the CPU)."""

    activation_type: Literal["uint8"] = "uint8"
    weight_type: Literal["int8"] = "int8"
    reduce_range: bool = False  # 7-bit weights: no VNNI on this x86 CPU
    cpu_kind: str = ""
    ops: Literal["all", "compute"] = "all"  # where activations are fake-quantized (QuantOps)
    float_modules: tuple[str, ...] = ()  # modules (by name) left in float: no fake quants

    @property
    def weight_range(self) -> tuple[int, int]:
        return (-64, 64) if self.reduce_range else (-127, 127)

    @property
    def label(self) -> str:
        rr = " reduce-range" if self.reduce_range else ""
        ops = " compute-ops" if self.ops == "compute" else ""
        kept = f", {len(self.float_modules)} float" if self.float_modules else ""
        return f"QAT QDQ U8S8 per-channel{rr}{ops}{kept}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "weight_range": list(self.weight_range), "label": self.label}


def format_for(
    cpu: CpuInt8, ops: Literal["all", "compute"] = "all", float_modules: tuple[str, ...] = ()
) -> FakeQuantFormat:
    """The format ``quantize`` tries first on ``cpu`` (its default settings): U8S8 per-channel,
    with 7-bit weights where U8S8 sums can saturate (x86 without VNNI). U8U8, its other candidate
    there, has no symmetric INT8 weights to simulate, so QAT uses the reduce-range format.
    ``ops``: fake quantization at every op ``quantize_ops: all`` quantizes, or around the compute
    layers only (``compute``)."""
    _, _, reduce_range = cpu_formats(QuantizeConfig(), cpu)[0]
    return FakeQuantFormat(
        reduce_range=reduce_range, cpu_kind=cpu.kind, ops=ops, float_modules=float_modules
    )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.ao.quantization warns on import and use that it is deprecated (in favour of torchao,
    which has no QDQ ONNX export path for CPU): the warnings are not the user's to act on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _qconfig(fmt: FakeQuantFormat) -> QConfig:
    import torch
    from torch.ao.quantization import (
        FakeQuantize,
        MovingAverageMinMaxObserver,
        MovingAveragePerChannelMinMaxObserver,
        QConfig,
    )

    wmin, wmax = fmt.weight_range
    act = FakeQuantize.with_args(  # type: ignore[no-untyped-call]
        observer=MovingAverageMinMaxObserver,
        quant_min=0,
        quant_max=255,
        dtype=torch.quint8,
        qscheme=torch.per_tensor_affine,
    )
    weight = FakeQuantize.with_args(  # type: ignore[no-untyped-call]
        observer=MovingAveragePerChannelMinMaxObserver,
        quant_min=wmin,
        quant_max=wmax,
        dtype=torch.qint8,
        qscheme=torch.per_channel_symmetric,
        ch_axis=0,
    )
    return QConfig(activation=act, weight=weight)  # type: ignore[no-untyped-call]


def _qconfig_mapping(fmt: FakeQuantFormat) -> QConfigMapping:
    """Every op (``all``), or the compute layers only (``compute``): convolutions and linear
    layers with the BatchNorm and ReLU that fuse into them (fusion needs one qconfig for all the
    modules it fuses); the element-wise ops between them stay float, as in ONNX Runtime's QDQ
    model with ``op_types_to_quantize`` the compute ops."""
    from torch.ao.quantization import QConfigMapping

    qconfig = _qconfig(fmt)
    if fmt.ops == "all":
        mapping = QConfigMapping().set_global(qconfig)
    else:
        mapping = QConfigMapping()
        for kind in _compute_types():
            mapping = mapping.set_object_type(kind, qconfig)
    for name in fmt.float_modules:
        mapping = mapping.set_module_name(name, None)
    return mapping


def _compute_types() -> tuple[Callable[..., Any], ...]:
    import torch
    from torch import nn

    return (
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
        nn.Linear,
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.ReLU,
        nn.functional.relu,
        torch.relu,
    )


def prepare(model: nn.Module, example: dict[str, Tensor], fmt: FakeQuantFormat) -> nn.Module:
    """A fake-quant copy of ``model`` (an FX ``GraphModule`` in training mode); ``model`` is
    left as it was. Fake quantization starts disabled: :func:`calibrate` sets the ranges first."""
    import torch
    from torch.ao.quantization import disable_fake_quant
    from torch.ao.quantization.backend_config import get_native_backend_config
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    student = copy.deepcopy(model).train()
    with _quiet():
        prepared = prepare_qat_fx(
            student,
            _qconfig_mapping(fmt),
            tuple(example.values()),
            backend_config=get_native_backend_config(),
        )
    prepared.apply(disable_fake_quant)
    assert isinstance(prepared, torch.nn.Module)
    simulate_int32_bias(prepared)
    return prepared


def fake_quant_modules(model: nn.Module) -> dict[str, FakeQuantizeBase]:
    from torch.ao.quantization import FakeQuantizeBase

    return {n: m for n, m in model.named_modules() if isinstance(m, FakeQuantizeBase)}


def learn_ranges(model: nn.Module, weights: bool = False, zero_points: bool = False) -> int:
    """Make every activation range of the calibrated fake-quant ``model`` trainable: each
    activation fake quant becomes a :class:`._modules.LearnedRange` that starts at its
    calibrated scale and zero point; with ``weights``, each weight fake quant becomes a
    :class:`._modules.LearnedWeightRange` starting at its current per-channel scales. Returns
    how many fake quants now learn."""
    from ._modules import LearnedRange, LearnedWeightRange

    count = 0
    for name, fq in list(fake_quant_modules(model).items()):
        if isinstance(fq, (LearnedRange, LearnedWeightRange)):
            continue
        fq = cast("FakeQuantize", fq)  # what prepare() inserts: its qconfig's FakeQuantize
        if _is_weight(fq):
            if weights:
                new = LearnedWeightRange(fq.scale, int(fq.quant_min), int(fq.quant_max))
                new.fake_quant_enabled.copy_(fq.fake_quant_enabled)
                _replace(model, name, new)
                count += 1
            continue
        learned = LearnedRange(
            float(fq.scale.reshape(-1)[0]),
            int(fq.zero_point.reshape(-1)[0]),
            int(fq.quant_min),
            int(fq.quant_max),
            zero_points,
        )
        learned.fake_quant_enabled.copy_(fq.fake_quant_enabled)
        _replace(model, name, learned)
        count += 1
    simulate_int32_bias(model)  # the layers read the new fake quants' scales
    return count


def range_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable range parameters (:func:`learn_ranges`) of ``model``."""
    from ._modules import LearnedRange, LearnedWeightRange

    kinds = (LearnedRange, LearnedWeightRange)
    return [m.log_gain for m in model.modules() if isinstance(m, kinds)]


def offset_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable zero points (offsets, in quantization steps) of ``model``'s learned
    activation ranges (``learn_ranges(..., zero_points=True)``)."""
    from ._modules import LearnedRange

    return [
        m.offset for m in model.modules() if isinstance(m, LearnedRange) and m.offset.requires_grad
    ]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def _fixed_range(learned: LearnedRange) -> FakeQuantize:
    """A plain fake quant (observer off) with a learned range's final scale and zero point: the
    form the TorchScript exporter writes as QuantizeLinear / DequantizeLinear."""
    import torch
    from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver

    fixed = FakeQuantize(  # type: ignore[no-untyped-call]
        observer=MovingAverageMinMaxObserver,
        quant_min=learned.quant_min,
        quant_max=learned.quant_max,
        dtype=torch.quint8,
        qscheme=torch.per_tensor_affine,
    )
    fixed.scale.resize_(1).copy_(learned.scale)
    fixed.zero_point.resize_(1).copy_(learned.zero_point)
    fixed.fake_quant_enabled.copy_(learned.fake_quant_enabled)
    fixed.disable_observer()
    return fixed


CalibrationMethod = Literal["minmax", "entropy", "percentile"]


def calibrate(
    model: nn.Module,
    batches: Iterable[dict[str, np.ndarray]],
    samples: int,
    method: CalibrationMethod = "minmax",
    percentile: float = 99.99,
) -> int:
    """Set every activation range from ``samples`` calibration rows, then enable fake
    quantization: the min / max (``minmax``, what post-training MinMax calibration computes), or
    the thresholds ONNX Runtime's histogram calibrators choose (``entropy``: least KL divergence;
    ``percentile``: the central ``percentile`` % of the values), from the same histograms the
    ``quantize`` step's calibration builds; their observers are switched off at once (a moving
    min / max would pull the range back to the outliers). Weight ranges follow the weights
    until :func:`freeze_observers`. Runs in eval mode
    (BatchNorm running statistics, as deployed); returns the rows seen."""
    import torch
    from torch.ao.quantization import enable_fake_quant

    acts = activation_fake_quants(model)
    ranges = _Ranges(method, percentile, samples)
    handles = [m.register_forward_pre_hook(ranges.hook(n)) for n, m in acts.items()]
    was_training, seen = model.training, 0
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                x = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}
                model(**x)
                seen += len(next(iter(batch.values())))
                if seen >= samples:
                    break
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    for name, (lo, hi) in ranges.result().items():
        if name in acts:
            _set_range(cast("FakeQuantize", acts[name]), lo, hi)  # prepare()'s
            if method != "minmax":  # a moving min / max would drift back to the outliers
                acts[name].disable_observer()
    model.apply(enable_fake_quant)
    return seen


class _Ranges:
    """Per-tensor ranges of the activations a calibration pass sees (always including 0)."""

    def __init__(self, method: CalibrationMethod, percentile: float, samples: int) -> None:
        self.method, self.samples = method, samples
        self.lo: dict[str, float] = {}
        self.hi: dict[str, float] = {}
        self.collector: Any = None
        if method != "minmax":
            from onnxruntime.quantization.calibrate import HistogramCollector

            bins = ENTROPY_BINS if method == "entropy" else HISTOGRAM_BINS
            # the arguments the quantize step's calibration passes (asymmetric U8 activations)
            self.collector = HistogramCollector(method, False, bins, 128, percentile, "same")

    def hook(self, name: str) -> Callable[[nn.Module, tuple[Tensor, ...]], None]:
        def record(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0].detach()
            self.lo[name] = min(self.lo.get(name, 0.0), float(x.min()))
            self.hi[name] = max(self.hi.get(name, 0.0), float(x.max()))
            if self.collector is not None:
                self._histogram(name, x.float().numpy())

        return record

    def _histogram(self, name: str, arr: np.ndarray) -> None:
        sub = {name: subsample(arr, hist_limit(len(arr), self.samples))}
        bound_bins(self.collector, sub)
        with contextlib.redirect_stdout(None):  # the collector prints per call
            self.collector.collect(sub)

    def result(self) -> dict[str, tuple[float, float]]:
        if self.collector is None or not self.collector.histogram_dict:
            return {n: (self.lo[n], self.hi[n]) for n in self.lo}
        with contextlib.redirect_stdout(None):
            found = self.collector.compute_collection_result()
        out: dict[str, tuple[float, float]] = {}
        for name, res in found.items():
            lo, hi = float(res[0]), float(res[1])
            out[name] = (min(lo, 0.0), max(hi, 0.0))
        return out


def _is_weight(fq: nn.Module) -> bool:
    import torch

    return bool(fq.qscheme == torch.per_channel_symmetric)


def _set_range(fq: FakeQuantize, lo: float, hi: float) -> None:
    import torch

    obs = fq.activation_post_process
    obs.min_val = torch.tensor(lo)
    obs.max_val = torch.tensor(hi)
    scale, zero_point = obs.calculate_qparams()
    fq.scale.resize_(scale.shape).copy_(scale)
    fq.zero_point.resize_(zero_point.shape).copy_(zero_point)


def freeze_bn(model: nn.Module) -> None:
    """BatchNorm statistics stop updating (the QAT forward already uses the running ones), in
    the fused QAT modules and in any BatchNorm left outside them (after a layer kept in float),
    which is put in eval mode: it normalizes with its running statistics, as deployed."""
    import torch
    from torch.ao.nn.intrinsic.qat.modules.conv_fused import _ConvBnNd

    for module in model.modules():
        if isinstance(module, _ConvBnNd):  # also slimline's INT32-bias twins (not type-equal)
            module.freeze_bn_stats()  # type: ignore[no-untyped-call]
        elif isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.eval()


def freeze_observers(model: nn.Module) -> None:
    """Activation and weight ranges stop following the data: the scales are final."""
    from torch.ao.quantization import disable_observer

    model.apply(disable_observer)


# -- export --------------------------------------------------------------------------------------
def _export_weight(fq: FakeQuantize, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(weight on the learned grid, scale, int32 zero point) of one per-channel fake quant."""
    import torch

    scale = fq.scale.detach().clone()
    zp = fq.zero_point.detach().to(torch.int32).clone()
    q = torch.fake_quantize_per_channel_affine(
        weight.detach(), scale, zp, int(fq.ch_axis), int(fq.quant_min), int(fq.quant_max)
    )
    return q, scale, zp


def _export_conv(module: nnqat.Conv2d | nniqat.ConvBn2d) -> QConv2d:
    import torch
    import torch.ao.nn.intrinsic.qat as nniqat

    from ._modules import QConv2d

    relu = isinstance(module, (nniqat.ConvBnReLU2d, nniqat.ConvReLU2d))
    weight, bias = module.weight.detach(), module.bias
    bias = bias.detach() if bias is not None else torch.zeros(weight.shape[0])
    if isinstance(module, (nniqat.ConvBn2d, nniqat.ConvBnReLU2d)):
        bn: Any = module.bn
        factor = bn.weight.detach() / torch.sqrt(bn.running_var + bn.eps)
        weight = weight * factor.reshape(-1, 1, 1, 1)
        bias = bn.bias.detach() + (bias - bn.running_mean) * factor
    q, scale, zp = _export_weight(module.weight_fake_quant, weight)
    return QConv2d(q, bias.detach(), scale, zp, module, relu)


def _export_linear(module: nnqat.Linear) -> QLinear:
    import torch
    import torch.ao.nn.intrinsic.qat as nniqat

    from ._modules import QLinear

    weight = module.weight.detach()
    bias = module.bias.detach() if module.bias is not None else torch.zeros(weight.shape[0])
    q, scale, zp = _export_weight(module.weight_fake_quant, weight)
    return QLinear(q, bias, scale, zp, isinstance(module, nniqat.LinearReLU))


def _export_replacement(module: nn.Module) -> nn.Module | None:
    import torch.ao.nn.intrinsic.qat as nniqat
    import torch.ao.nn.qat as nnqat

    convs = (nniqat.ConvBn2d, nniqat.ConvBnReLU2d, nniqat.ConvReLU2d, nnqat.Conv2d)
    if isinstance(module, convs):
        return _export_conv(module)
    if isinstance(module, (nniqat.LinearReLU, nnqat.Linear)):
        return _export_linear(module)
    return None


def export_module_for(model: nn.Module) -> nn.Module:
    """An eval-mode copy of the fake-quant ``model`` that computes the same function in the form
    the QDQ export needs: BatchNorm folded into each convolution, each weight on its learned
    INT8 grid, activation fake quants as they are (observers off), and each quantized layer's
    bias on the INT32 grid ONNX Runtime runs it on (:func:`_round_biases`)."""
    from ._modules import LearnedRange

    out = copy.deepcopy(model).eval()
    freeze_observers(out)
    for name, module in list(out.named_modules()):
        new = (
            _fixed_range(module)
            if isinstance(module, LearnedRange)
            else _export_replacement(module)
        )
        if new is not None:
            _replace(out, name, new)
    left = [n for n, fq in fake_quant_modules(out).items() if _is_weight(fq)]
    if left:
        raise TypeError(f"weight fake quants of unsupported modules left: {', '.join(left)}")
    _round_biases(out)
    return out


def _round_biases(model: nn.Module) -> int:
    """Put the bias of every quantized convolution or linear layer whose input is fake-quantized
    per tensor on the grid of ONNX Runtime's INT32 bias: input scale x each channel's weight
    scale. ONNX Runtime quantizes a float bias that way at load time (its
    ``WeightBiasQuantization`` transformer, for a Conv or Gemm between a DequantizeLinear and a
    QuantizeLinear), so without this the INT8 model differs from the export module by the
    rounding of each bias, which on PP-OCRv4's detector cost the export check 0.996 -> 0.980.
    Returns how many biases were rounded."""
    from torch.ao.quantization import FakeQuantize

    from ._modules import _QWeight

    done = 0
    for layer, fq in _layers_and_inputs(model):
        if not isinstance(layer, _QWeight):
            continue
        if isinstance(fq, FakeQuantize) and not _is_weight(fq) and fq.scale.numel() == 1:
            layer.round_bias(float(fq.scale.reshape(-1)[0]))
            done += 1
    return done


def _layers_and_inputs(model: nn.Module) -> Iterator[tuple[nn.Module, nn.Module]]:
    """(module, the module that computed its first input) for each module call of the FX
    ``model`` whose first input is another module's output."""
    graph = getattr(model, "graph", None)
    for node in graph.nodes if graph is not None else ():
        if node.op != "call_module" or not node.args:
            continue
        src = node.args[0]
        if getattr(src, "op", None) == "call_module":
            yield model.get_submodule(str(node.target)), model.get_submodule(str(src.target))


# -- INT32 biases in training ------------------------------------------------------------------
def simulate_int32_bias(model: nn.Module) -> int:
    """Make every QAT convolution or linear layer whose input is fake-quantized per tensor add
    what rounding its bias to ONNX Runtime's INT32 grid changes (``_modules.bias_rounding``), as
    the exported model computes (:func:`_round_biases`), so training sees the deployed
    arithmetic. Binds each layer to its input's current fake quant (call again after
    :func:`learn_ranges` replaces them); returns how many layers simulate it."""
    from ._modules import BIAS_TWINS

    twins = set(BIAS_TWINS.values())
    done = 0
    for layer, fq in _layers_and_inputs(model):
        if type(layer) not in BIAS_TWINS and type(layer) not in twins:
            continue
        if not _is_activation_fq(fq):
            continue
        if type(layer) in BIAS_TWINS:  # the class is switched: copies and checkpoints keep it
            layer.__class__ = BIAS_TWINS[type(layer)]
        layer.__dict__["_bias_input"] = [fq]
        done += 1
    return done


def _is_activation_fq(module: nn.Module) -> bool:
    from torch.ao.quantization import FakeQuantizeBase

    return isinstance(module, FakeQuantizeBase) and not _is_weight(module)


def activation_fake_quants(model: nn.Module) -> dict[str, FakeQuantizeBase]:
    """``model``'s activation fake quants (not its weights'), by name."""
    return {n: m for n, m in fake_quant_modules(model).items() if not _is_weight(m)}

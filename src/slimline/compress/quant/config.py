"""Typed configuration of the quantize step, and the concrete spec of one quantized variant."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ...recipe import StepConfig

__all__ = ["CalibrationName", "Precision", "QuantOps", "QuantSpec", "QuantizeConfig"]

Precision = Literal["int8", "float"]
CalibrationName = Literal["minmax", "percentile", "entropy"]
# "all": every op type ONNX Runtime's QDQ quantizer handles (element-wise Add/Mul, pooling,
# Resize, Concat... too); "compute": only Conv, ConvTranspose, MatMul, Gemm and Attention, whose
# inputs and outputs get Q/DQ while the element-wise ops between them compute in float
QuantOps = Literal["all", "compute"]


_AUTO_ONLY = (
    "is ignored outside mode auto (whose search recalibrates a near miss); drop it, or set "
    "mode: auto"
)
_CHECK_AUTO_ONLY = (
    "is ignored outside mode auto (whose search times its static candidates before "
    "calibrating on all rows); drop it, or set mode: auto"
)


class QuantizeConfig(StepConfig):
    """INT8 post-training quantization with ONNX Runtime's quantization tool.

    ``mode: auto`` (the default) builds candidates suited to the model, measures them against
    FP32 and keeps the fastest that meets the budget, keeping the worst layers in float when
    needed. ``static`` and ``dynamic`` quantize once with the given settings.

    ``precision`` maps node names to ``int8`` or ``float``. Keys are exact node names, or regular
    expressions written ``re:<pattern>`` (matched with ``re.fullmatch``). Precedence, highest
    first: exact name, then the first matching regex in the order written, then the default rule
    (first and last compute layers float when ``keep_first_last_float``), then ``int8``. Names
    refer to the graph after preparation, as listed in the report's layer-wise table.
    """

    kind: ClassVar[str] = "quantize"
    mode: Literal["auto", "static", "dynamic"] = "auto"
    calibration: CalibrationName = "minmax"
    percentile: float = Field(99.99, gt=90.0, lt=100.0, description="for percentile calibration")
    per_channel: bool = True
    activation_type: Literal["uint8", "int8"] = "uint8"
    weight_type: Literal["int8", "uint8"] = "int8"
    activation_symmetric: bool = False
    weight_symmetric: bool = True
    reduce_range: bool = Field(
        False, description="7-bit weights: avoids U8S8 saturation on x86 without VNNI"
    )
    quantize_embeddings: bool = Field(
        True, description="dynamic candidates store embedding tables (Gather, EmbedLayerNorm) INT8"
    )
    samples: int = Field(512, ge=1, le=100_000, description="calibration samples")
    precision: dict[str, Precision] = Field(default_factory=dict)
    keep_first_last_float: bool = True
    quantize_ops: QuantOps = Field(
        "all",
        description="static QDQ: all op types ONNX Runtime quantizes, or only the compute ops "
        "(element-wise ops in float: fewer requantizations, see docs/quantization.md)",
    )
    optimize_graph: bool = True
    mixed_precision: bool = True
    max_float_share: float = Field(
        0.5, gt=0.0, le=1.0, description="mixed precision keeps at most this share in float"
    )
    recalibrate_near_miss: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="mode auto: when no candidate is faster than FP32 and within budget, and the "
        "closest one that is faster misses it by at most this share of the budget's allowance "
        "(1 - min_agreement, or 1 - min_cosine), that candidate is rebuilt with each calibration "
        "not yet tried (entropy) before mixed precision (0: never)",
    )
    fallback: Literal["none", "qat"] = Field(
        "none",
        description="qat: quantization-aware training when PTQ plus mixed precision misses the "
        "budget or keeps more than max_float_share of the compute ops in float",
    )
    speed_check: bool = Field(
        True,
        description="mode auto: build the static candidates on the ranges of speed_check_rows "
        "calibration rows and time them against FP32 first; calibrate on all rows only when one "
        "can be faster (an INT8 model's speed does not depend on its ranges)",
    )
    speed_check_rows: int = Field(32, ge=1, le=10_000)
    layerwise_samples: int = Field(16, ge=1, le=1024)
    screen: bool = Field(
        True,
        description="evaluate each candidate on a quarter of the evaluation rows first (with 16 "
        "rows or more), and on all rows only while the budget is within reach of it",
    )
    impact_nodes: int = Field(
        24,
        ge=0,
        le=1024,
        description="mixed precision measures the gain in the budget's cosine of keeping each "
        "of this many worst-ranked nodes alone in float and tries them by gain per cost (0: "
        "layer-wise order)",
    )
    representativeness_samples: int = Field(64, ge=0, le=10_000)
    calibration_chunk_mb: int = Field(128, ge=16, le=16_384)
    nncf: bool = Field(
        False,
        description="also build NNCF's PTQ model (slimline[openvino]) from the same float graph "
        "and calibration data, and, where the target runs OpenVINO, NNCF's documented OpenVINO "
        "path (an OpenVINO IR); they compete with the chosen QDQ candidate on the same budget",
    )

    @model_validator(mode="after")
    def _no_setting_the_mode_ignores(self) -> QuantizeConfig:
        """A field set away from its default where the chosen mode never reads it is an error
        (a default value is harmless: a printed recipe lists every field)."""
        for name, why in self._ignored():
            value = getattr(self, name)
            if value != type(self).model_fields[name].default:
                shown = str(value).lower() if isinstance(value, bool) else value
                raise ValueError(f"`{name}: {shown}` {why}")
        return self

    def _ignored(self) -> list[tuple[str, str]]:
        """(field, why it is ignored and what to do) for the fields this config never reads."""
        static = "; drop it, or set mode: static to choose it"
        by_mode = {
            "auto": [
                ("calibration", "is ignored by mode auto, which tries minmax and percentile "
                 "(entropy after a near miss)" + static),
                ("per_channel", "is ignored by mode auto, which quantizes weights per channel" + static),
            ],
            "static": [
                ("recalibrate_near_miss", _AUTO_ONLY),
                ("speed_check", _CHECK_AUTO_ONLY),
                ("speed_check_rows", _CHECK_AUTO_ONLY),
                ("quantize_embeddings", "is ignored by mode static: only dynamic quantization "
                 "stores embedding tables in INT8; drop it, or set mode: dynamic"),
            ],
            "dynamic": [
                ("recalibrate_near_miss", _AUTO_ONLY),
                ("speed_check", _CHECK_AUTO_ONLY),
                ("speed_check_rows", _CHECK_AUTO_ONLY),
                *(
                (name, "is ignored by mode dynamic, which quantizes activations at run time from "
                 "their own range" + static)
                for name in ("calibration", "percentile", "activation_type",
                             "activation_symmetric", "quantize_ops")
                ),
            ],
        }[self.mode]  # fmt: skip
        if self.mode == "static" and self.calibration != "percentile":
            by_mode.append(
                ("percentile", f"is ignored with calibration: {self.calibration}; set "
                 "calibration: percentile, or drop percentile")
            )  # fmt: skip
        if not self.mixed_precision:
            by_mode.append(
                ("impact_nodes", "is ignored with mixed_precision: false; drop it, or turn "
                 "mixed precision on")
            )  # fmt: skip
        return by_mode

    @field_validator("precision")
    @classmethod
    def _valid_patterns(cls, v: dict[str, Precision]) -> dict[str, Precision]:
        import re

        for key in v:
            if key.startswith("re:"):
                try:
                    re.compile(key[3:])
                except re.error as err:
                    raise ValueError(f"precision key {key!r} is not a valid regex: {err}") from None
        return v


@dataclass(frozen=True)
class QuantSpec:
    """One concrete quantization setting (what ``quantize_model`` applies)."""

    mode: Literal["static", "dynamic"]
    calibration: CalibrationName = "minmax"
    per_channel: bool = True
    activation_type: Literal["uint8", "int8"] = "uint8"
    weight_type: Literal["int8", "uint8"] = "int8"
    activation_symmetric: bool = False
    weight_symmetric: bool = True
    percentile: float = 99.99
    reduce_range: bool = False  # 7-bit weights
    embeddings: bool = False  # dynamic: also Gather / EmbedLayerNormalization tables in INT8
    ops: QuantOps = "all"  # static: which op types get Q/DQ

    @property
    def label(self) -> str:
        a = "U8" if self.activation_type == "uint8" else "S8"
        w = "S8" if self.weight_type == "int8" else "U8"
        gran = "per-channel" if self.per_channel else "per-tensor"
        rr = " reduce-range" if self.reduce_range else ""
        if self.mode == "dynamic":
            emb = " +embeddings" if self.embeddings else ""
            return f"dynamic {w} {gran}{rr}{emb}"  # activations: U8, computed at run time
        cal = (
            self.calibration
            if self.calibration != "percentile"
            else f"percentile {self.percentile:g}"
        )
        ops = " compute-ops" if self.ops == "compute" else ""
        return f"static QDQ {a}{w} {gran}{rr}{ops} {cal}"

    @property
    def saturates_without_vnni(self) -> bool:
        """U8S8 with full 8-bit weights: x86 without VNNI adds its products in 16 bits
        (VPMADDUBSW), which can saturate; 7-bit weights (``reduce_range``) or U8U8 cannot."""
        u8s8 = self.activation_type == "uint8" and self.weight_type == "int8"
        return u8s8 and not self.reduce_range

    @property
    def slug(self) -> str:
        return self.label.replace(" ", "-").replace(".", "_").lower()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_config(cls, cfg: QuantizeConfig) -> QuantSpec:
        assert cfg.mode != "auto"
        return cls(
            mode=cfg.mode,
            calibration=cfg.calibration,
            per_channel=cfg.per_channel,
            activation_type=cfg.activation_type,
            weight_type=cfg.weight_type,
            activation_symmetric=cfg.activation_symmetric,
            weight_symmetric=cfg.weight_symmetric,
            percentile=cfg.percentile,
            reduce_range=cfg.reduce_range,
            embeddings=cfg.mode == "dynamic" and cfg.quantize_embeddings,
            ops=cfg.quantize_ops,
        )

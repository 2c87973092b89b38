"""The CPU features that decide which INT8 kernels ONNX Runtime runs, read from ``/proc/cpuinfo``.

On x86-64, ONNX Runtime's U8S8 matrix kernels use VPMADDUBSW on AVX2 and AVX512BW, which adds
pairs of 8-bit products into a 16-bit register and can saturate; with AVX512-VNNI, AVX-VNNI or
AMX-INT8 the products accumulate in 32 bits and nothing saturates. On ARM64 the dot-product
(``asimddp``) and matrix-multiply (``i8mm``) extensions are the fast INT8 paths. The parser is a
pure function of the text so that tests can feed any machine's ``/proc/cpuinfo``.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["ARM_FEATURES", "X86_FEATURES", "CpuInt8", "detect", "parse_cpuinfo"]

X86_FEATURES = ("avx2", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")
ARM_FEATURES = ("asimddp", "i8mm")
_VNNI = ("avx512_vnni", "avx_vnni", "amx_int8")  # 32-bit accumulation of U8S8 products
_X86 = ("x86_64", "amd64", "i686", "i386")
_ARM = ("aarch64", "arm64")


@dataclass(frozen=True)
class CpuInt8:
    """What the CPU offers INT8 kernels: its architecture and the features present."""

    arch: str  # "x86_64", "aarch64", or what platform.machine() said
    features: frozenset[str]
    known: bool = True  # False when the features could not be read

    @property
    def x86(self) -> bool:
        return self.arch in _X86

    @property
    def vnni(self) -> bool:
        return bool(self.features & set(_VNNI))

    @property
    def u8s8_saturates(self) -> bool:
        """U8S8 with full 8-bit weights risks 16-bit saturation: x86 without any VNNI.
        Unknown features count as no risk: the measured fidelity decides either way."""
        return self.known and self.x86 and not self.vnni

    @property
    def kind(self) -> str:
        if not self.known:
            return f"{self.arch}-unknown"
        if self.x86:
            return _x86_kind(self.features)
        if self.arch in _ARM:
            return (
                "arm64-i8mm"
                if "i8mm" in self.features
                else ("arm64-dotprod" if "asimddp" in self.features else "arm64")
            )
        return self.arch

    def names(self) -> tuple[str, ...]:
        """The features this architecture can have, in a fixed order."""
        if self.x86:
            return X86_FEATURES
        return ARM_FEATURES if self.arch in _ARM else ()

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``hardware.int8``: one boolean per feature (None when unknown)."""
        out: dict[str, Any] = {
            f: (f in self.features) if self.known else None for f in self.names()
        }
        out["kind"] = self.kind
        return out

    def describe(self) -> str:
        """One line for the report and the terminal: the kind and the features present."""
        if not self.known:
            return f"{self.kind} (INT8 features not readable)"
        present = [f for f in self.names() if f in self.features]
        return f"{self.kind} ({', '.join(present) or 'no INT8 extensions'})"


def _x86_kind(features: frozenset[str]) -> str:
    for flag, kind in (
        ("amx_int8", "x86-amx-int8"),
        ("avx512_vnni", "x86-avx512-vnni"),
        ("avx_vnni", "x86-avx-vnni"),
        ("avx512bw", "x86-avx512"),
        ("avx2", "x86-avx2"),
    ):
        if flag in features:
            return kind
    return "x86-sse"


def _normal_arch(machine: str) -> str:
    m = machine.lower()
    if m in _X86:
        return "x86_64" if m in ("x86_64", "amd64") else m
    return "aarch64" if m in _ARM else m


def parse_cpuinfo(text: str, machine: str) -> CpuInt8:
    """Features from ``/proc/cpuinfo`` text: the x86 ``flags`` line or the ARM ``Features`` line
    of the first processor."""
    arch = _normal_arch(machine)
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            present = set(value.split())
            wanted = X86_FEATURES if arch in _X86 else ARM_FEATURES
            return CpuInt8(arch, frozenset(f for f in wanted if f in present))
    return CpuInt8(arch, frozenset(), known=False)


@cache
def detect() -> CpuInt8:
    """This machine's INT8 features (read once per process)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text, platform.machine())

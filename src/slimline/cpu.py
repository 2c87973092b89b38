"""The CPU features that decide which INT8 kernels ONNX Runtime runs, read as the kernels read them.

On x86-64, ONNX Runtime's U8S8 matrix kernels use VPMADDUBSW on AVX2 and AVX512BW, which adds
pairs of 8-bit products into a 16-bit register and can saturate; with AVX512-VNNI, AVX-VNNI or
AMX-INT8 the products accumulate in 32 bits and nothing saturates. On ARM64 the dot-product
(``asimddp``) and matrix-multiply (``i8mm``) extensions are the fast INT8 paths.

The kernels dispatch on CPUID and on XCR0 (which register state the operating system enables), so
on x86-64 :func:`detect` reads those (:mod:`slimline.cpuid`); a feature whose state the OS does not
enable counts as absent, as the kernels count it. ``/proc/cpuinfo`` is read too: where the two
disagree (an emulator shows the emulated CPU to CPUID and the host's flags in ``/proc/cpuinfo``),
one warning is logged and the manifest records both. Where CPUID cannot run (ARM, a kernel that
refuses executable mappings), ``/proc/cpuinfo`` is the source. Both parsers are pure functions of
their input, so tests can feed any machine's registers or text.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

from .cpuid import Registers, read_registers

__all__ = [
    "ARM_FEATURES",
    "X86_FEATURES",
    "CpuInt8",
    "detect",
    "from_registers",
    "kernel_view",
    "parse_cpuinfo",
    "reconcile",
    "recorded_saturates",
]

log = logging.getLogger(__name__)

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
    source: str = "proc_cpuinfo"  # "cpuid": CPUID and XCR0, as the kernels read them
    # what /proc/cpuinfo says, kept only where it disagrees with CPUID (an emulator, a hypervisor)
    proc_cpuinfo: CpuInt8 | None = None

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
        """The manifest's ``hardware.int8``: one boolean per feature (None when unknown), the
        kind, the source, and ``proc_cpuinfo`` (the same fields) where that source disagrees."""
        out: dict[str, Any] = {
            f: (f in self.features) if self.known else None for f in self.names()
        }
        out["kind"] = self.kind
        out["source"] = self.source
        if self.proc_cpuinfo is not None:
            out["proc_cpuinfo"] = self.proc_cpuinfo.to_dict()
        return out

    def describe(self) -> str:
        """One line for the report and the terminal: the kind and the features present, and what
        ``/proc/cpuinfo`` claims instead where it disagrees."""
        if not self.known:
            return f"{self.kind} (INT8 features not readable)"
        present = [f for f in self.names() if f in self.features]
        line = f"{self.kind} ({', '.join(present) or 'no INT8 extensions'})"
        if self.proc_cpuinfo is not None:
            line += f"; /proc/cpuinfo claims {self.proc_cpuinfo.describe()}"
        return line


def recorded_saturates(int8: dict[str, Any]) -> bool:
    """:attr:`CpuInt8.u8s8_saturates` of the CPU a manifest's ``hardware.int8`` describes."""
    return str(int8.get("kind", "")).startswith("x86-") and not any(int8.get(f) for f in _VNNI)


def kernel_view(int8: dict[str, Any]) -> dict[str, Any]:
    """A manifest's ``hardware.int8`` without where it was read: what the kernels see, the part
    that two runs must share to be compared."""
    return {k: v for k, v in int8.items() if k not in ("source", "proc_cpuinfo")}


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


# (CPUID word, bit) of each x86 feature, and the XCR0 state bits the OS must enable for it
_AVX_STATE = 0b110  # SSE and AVX (YMM) state
_AVX512_STATE = _AVX_STATE | 0b1110_0000  # + opmask, ZMM_Hi256, Hi16_ZMM
_AMX_STATE = 0b11 << 17  # XTILECFG, XTILEDATA
_X86_BITS: dict[str, tuple[str, int, int]] = {
    "avx2": ("leaf7_ebx", 5, _AVX_STATE),
    "avx512bw": ("leaf7_ebx", 30, _AVX512_STATE),
    "avx512_vnni": ("leaf7_ecx", 11, _AVX512_STATE),
    "avx_vnni": ("leaf7_1_eax", 4, _AVX_STATE),
    "amx_int8": ("leaf7_edx", 25, _AMX_STATE),
}


def from_registers(regs: Registers) -> CpuInt8:
    """Features from CPUID and XCR0: present only when the CPU reports the bit and the OS
    enables the register state it needs, as the kernels decide."""
    found = frozenset(
        name
        for name, (word, bit, state) in _X86_BITS.items()
        if getattr(regs, word) >> bit & 1 and regs.xcr0 & state == state
    )
    return CpuInt8("x86_64", found, source="cpuid")


def reconcile(kernels: CpuInt8, text: CpuInt8) -> CpuInt8:
    """The kernels' view, with ``/proc/cpuinfo``'s kept beside it where the two disagree."""
    if not text.known or text.features == kernels.features:
        return kernels
    log.warning(
        "CPUID shows %s but /proc/cpuinfo claims %s (an emulator or hypervisor?); slimline "
        "follows CPUID, as the INT8 kernels do, and records both",
        kernels.describe(),
        text.describe(),
    )
    return replace(kernels, proc_cpuinfo=text)


@cache
def detect() -> CpuInt8:
    """This machine's INT8 features as the kernels see them (read once per process)."""
    try:
        text = parse_cpuinfo(Path("/proc/cpuinfo").read_text(), platform.machine())
    except OSError:
        text = parse_cpuinfo("", platform.machine())
    regs = read_registers()
    return text if regs is None else reconcile(from_registers(regs), text)

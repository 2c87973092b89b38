"""Read CPUID and XCR0 the way the INT8 kernels do, from Python.

ONNX Runtime (MLAS), OpenVINO (oneDNN) and PyTorch (cpuinfo) choose their kernels by executing
the ``cpuid`` and ``xgetbv`` instructions, not by reading ``/proc/cpuinfo``. Under an emulator
such as ``qemu-x86_64 -cpu Haswell`` the two differ: the kernel's text shows the host's flags,
the instruction shows the emulated CPU. So slimline runs the instructions too, from a small
executable page mapped with :mod:`mmap` and called through :mod:`ctypes`.

No library on PyPI reads both the feature bits slimline needs (AVX512-VNNI, AVX-VNNI, AMX-INT8)
and the XCR0 register state that decides whether the operating system enables them, in process:
py-cpuinfo reads neither AMX nor XCR0 and runs CPUID in a subprocess; archspec reads
``/proc/cpuinfo``.

:func:`read_registers` returns ``None`` where the instructions cannot run (not x86-64, or a
kernel that refuses executable mappings); the caller then falls back to ``/proc/cpuinfo``.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
from dataclasses import dataclass

__all__ = ["Registers", "read_registers"]

# void cpuid(uint32_t leaf, uint32_t subleaf, uint32_t out[4])   (System V AMD64 ABI)
_CPUID_CODE = bytes.fromhex(
    "53"  # push rbx (callee-saved; cpuid writes it)
    "89f8"  # mov eax, edi
    "89f1"  # mov ecx, esi
    "4989d0"  # mov r8, rdx
    "0fa2"  # cpuid
    "418900"  # mov [r8], eax
    "41895804"  # mov [r8+4], ebx
    "41894808"  # mov [r8+8], ecx
    "4189500c"  # mov [r8+12], edx
    "5b"  # pop rbx
    "c3"  # ret
)
# uint64_t xgetbv(uint32_t index): edx:eax of XGETBV
_XGETBV_CODE = bytes.fromhex(
    "89f9"  # mov ecx, edi
    "0f01d0"  # xgetbv
    "48c1e220"  # shl rdx, 32
    "4809d0"  # or rax, rdx
    "c3"  # ret
)
_OSXSAVE = 1 << 27  # CPUID.1:ECX: the OS has set CR4.OSXSAVE, so XGETBV may run


@dataclass(frozen=True)
class Registers:
    """The CPUID words that carry the INT8-relevant features, and XCR0 (0 when unreadable)."""

    leaf1_ecx: int
    leaf7_ebx: int
    leaf7_ecx: int
    leaf7_edx: int
    leaf7_1_eax: int
    xcr0: int


class _Code:
    """Machine code in an executable anonymous mapping, kept alive with its callables."""

    def __init__(self) -> None:
        code = _CPUID_CODE + b"\x90" * (32 - len(_CPUID_CODE)) + _XGETBV_CODE
        self._map = _executable_map(code)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        u32 = ctypes.c_uint32
        self.cpuid = ctypes.CFUNCTYPE(None, u32, u32, ctypes.POINTER(u32))(base)
        self.xgetbv = ctypes.CFUNCTYPE(ctypes.c_uint64, u32)(base + 32)

    def leaf(self, leaf: int, subleaf: int = 0) -> tuple[int, int, int, int]:
        out = (ctypes.c_uint32 * 4)()
        self.cpuid(leaf, subleaf, out)
        return out[0], out[1], out[2], out[3]


def _executable_map(code: bytes) -> mmap.mmap:
    prot = mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC
    m = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=prot)
    m.write(code)
    return m


def read_registers() -> Registers | None:
    """This CPU's feature words as the kernels read them, or None where CPUID cannot run here."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        code = _Code()
    except (OSError, ValueError, TypeError):  # W+X mappings refused (e.g. a hardened kernel)
        return None
    max_leaf = code.leaf(0)[0]
    leaf1_ecx = code.leaf(1)[2]
    _, b7, c7, d7 = code.leaf(7) if max_leaf >= 7 else (0, 0, 0, 0)
    a71 = code.leaf(7, 1)[0] if max_leaf >= 7 else 0
    xcr0 = code.xgetbv(0) if leaf1_ecx & _OSXSAVE else 0
    return Registers(leaf1_ecx, b7, c7, d7, a71, xcr0)

from __future__ import annotations

from pathlib import Path

import pytest

from slimline.cpu import CpuInt8, detect, from_registers, kernel_view, parse_cpuinfo, reconcile
from slimline.cpuid import Registers, read_registers
from slimline.record import hardware

CPUINFO = Path(__file__).parent / "fixtures" / "cpuinfo"


def _parse(name: str, machine: str = "x86_64") -> CpuInt8:
    return parse_cpuinfo((CPUINFO / name).read_text(), machine)


def test_an_avx2_only_machine_saturates_u8s8() -> None:
    cpu = _parse("avx2.txt")
    assert cpu.features == {"avx2"} and cpu.kind == "x86-avx2"
    assert cpu.u8s8_saturates and not cpu.vnni
    assert cpu.to_dict() == {
        "avx2": True,
        "avx512bw": False,
        "avx512_vnni": False,
        "avx_vnni": False,
        "amx_int8": False,
        "kind": "x86-avx2",
        "source": "proc_cpuinfo",
    }


def test_vnni_and_amx_machines_do_not_saturate() -> None:
    vnni = _parse("avx512-vnni.txt")
    assert vnni.features == {"avx2", "avx512bw", "avx512_vnni"}
    assert vnni.kind == "x86-avx512-vnni" and not vnni.u8s8_saturates
    amx = _parse("amx.txt")
    assert amx.features == {"avx2", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8"}
    assert amx.kind == "x86-amx-int8" and not amx.u8s8_saturates
    assert amx.describe() == "x86-amx-int8 (avx2, avx512bw, avx512_vnni, avx_vnni, amx_int8)"


def test_avx_vnni_alone_counts_as_vnni() -> None:
    cpu = parse_cpuinfo("flags\t\t: sse4_2 avx2 avx_vnni\n", "x86_64")
    assert cpu.kind == "x86-avx-vnni" and cpu.vnni and not cpu.u8s8_saturates


def test_an_arm64_machine_reads_the_features_line() -> None:
    cpu = _parse("arm64.txt", "aarch64")
    # "svei8mm" is another token: only the whole word "i8mm" counts
    assert cpu.features == {"asimddp", "i8mm"} and cpu.kind == "arm64-i8mm"
    assert not cpu.u8s8_saturates
    assert cpu.to_dict() == {
        "asimddp": True,
        "i8mm": True,
        "kind": "arm64-i8mm",
        "source": "proc_cpuinfo",
    }
    dotprod = parse_cpuinfo("Features\t: fp asimd asimddp\n", "arm64")
    assert dotprod.kind == "arm64-dotprod"


def test_unreadable_features_are_unknown_not_absent() -> None:
    cpu = parse_cpuinfo("", "x86_64")
    assert not cpu.known and cpu.kind == "x86_64-unknown"
    assert not cpu.u8s8_saturates  # no format is ruled out on a guess; fidelity decides
    assert cpu.to_dict()["avx2"] is None


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="needs /proc/cpuinfo")
def test_the_manifest_records_this_machine() -> None:
    int8 = hardware()["int8"]
    assert int8 == detect().to_dict() and int8["kind"] == detect().kind


def test_the_summary_names_the_cpu_kind_or_says_it_is_unknown() -> None:
    from slimline.report.html import hardware_line

    new = {
        "hardware": {"cpu": "Xeon", "cores": 2, "int8": _parse("avx2.txt").to_dict()},
        "target": {"threads": 2},
    }
    assert hardware_line(new) == "Xeon, x86-avx2 (avx2), 2 cores, 2 threads"
    old = {"hardware": {"cpu": "Xeon", "cores": 2, "flags": ["avx2", "fma"]}, "target": {}}
    assert "INT8 features not recorded (flags: avx2, fma)" in hardware_line(old)


# CPUID words and XCR0 read on an AMX Xeon (Sapphire Rapids class), and under
# ``qemu-x86_64 -cpu Haswell-noTSX`` on that same host: what the kernels saw in each.
AMX_HOST = Registers(
    leaf1_ecx=0xFFFA3203,
    leaf7_ebx=0xF1BF2FFB,
    leaf7_ecx=0x1A415F46,
    leaf7_edx=0x23C14010,
    leaf7_1_eax=0x1C30,
    xcr0=0x600E7,
)
HASWELL_EMULATED = Registers(
    leaf1_ecx=0xFFFA3203, leaf7_ebx=0x7A9, leaf7_ecx=0, leaf7_edx=0, leaf7_1_eax=0, xcr0=0x7
)


def test_cpuid_registers_give_the_features_the_kernels_see() -> None:
    amx = from_registers(AMX_HOST)
    assert amx.kind == "x86-amx-int8" and amx.source == "cpuid"
    assert amx.features == {"avx2", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8"}
    haswell = from_registers(HASWELL_EMULATED)
    assert haswell.features == {"avx2"} and haswell.u8s8_saturates


def test_a_feature_the_os_does_not_enable_in_xcr0_is_absent() -> None:
    no_tiles = from_registers(Registers(**{**AMX_HOST.__dict__, "xcr0": 0xE7}))
    assert "amx_int8" not in no_tiles.features and no_tiles.kind == "x86-avx512-vnni"
    no_zmm = from_registers(Registers(**{**AMX_HOST.__dict__, "xcr0": 0x60007}))
    # AVX512 state off: AVX2, AVX-VNNI and AMX remain; VNNI still holds through AVX-VNNI
    assert no_zmm.features == {"avx2", "avx_vnni", "amx_int8"} and no_zmm.vnni
    no_osxsave = from_registers(Registers(**{**AMX_HOST.__dict__, "xcr0": 0}))
    assert no_osxsave.features == frozenset() and no_osxsave.kind == "x86-sse"


def test_an_emulator_disagreement_follows_cpuid_and_records_both(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host_text = _parse("amx.txt")
    seen = reconcile(from_registers(HASWELL_EMULATED), host_text)
    assert seen.kind == "x86-avx2" and seen.u8s8_saturates
    assert "CPUID shows x86-avx2" in caplog.text
    d = seen.to_dict()
    assert d["source"] == "cpuid" and d["proc_cpuinfo"]["kind"] == "x86-amx-int8"
    assert "/proc/cpuinfo claims x86-amx-int8" in seen.describe()
    agree = reconcile(from_registers(AMX_HOST), host_text)
    assert agree.proc_cpuinfo is None and "proc_cpuinfo" not in agree.to_dict()


def test_the_gate_compares_what_the_kernels_saw_not_where_it_was_read() -> None:
    from slimline.gate import hardware_differences

    emulated = reconcile(from_registers(HASWELL_EMULATED), _parse("amx.txt")).to_dict()
    real_avx2 = _parse("avx2.txt").to_dict()
    assert kernel_view(emulated) == kernel_view(real_avx2)
    differs, _ = hardware_differences(
        {"hardware": {"int8": emulated}}, {"hardware": {"int8": real_avx2}}
    )
    assert not [d for d in differs if "INT8" in d]
    differs, _ = hardware_differences(
        {"hardware": {"int8": from_registers(AMX_HOST).to_dict()}},
        {"hardware": {"int8": real_avx2}},
    )
    assert any("INT8 CPU features x86-amx-int8" in d for d in differs)


@pytest.mark.skipif(read_registers() is None, reason="CPUID cannot run here (not x86-64)")
def test_this_machines_cpuid_agrees_with_torchs_own_dispatch() -> None:
    """PyTorch reads CPUID and XCR0 through its own library: its kernel level must match ours,
    natively and under the emulated AVX2 lane alike."""
    import torch

    cpu = detect()
    assert cpu.source == "cpuid"
    level = torch.backends.cpu.get_cpu_capability()
    if level == "AVX512":
        assert "avx512bw" in cpu.features
    elif level == "AVX2":
        assert "avx2" in cpu.features and "avx512bw" not in cpu.features


@pytest.mark.cpu_kinds
def test_a_child_python_sees_the_cpu_kind_its_parent_sees() -> None:
    """Peak-RSS probes, servers and spawn pools are child Pythons: under the emulated lane they
    must run on the emulated CPU too (qemu-user does not follow exec; the lane's wrapper does)."""
    import subprocess
    import sys

    code = "from slimline.cpu import detect; print(detect().kind)"
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600
    )
    assert child.stdout.strip() == detect().kind

from __future__ import annotations

from pathlib import Path

import pytest

from slimline.cpu import CpuInt8, detect, parse_cpuinfo
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
    assert cpu.to_dict() == {"asimddp": True, "i8mm": True, "kind": "arm64-i8mm"}
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

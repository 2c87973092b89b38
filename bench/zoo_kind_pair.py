"""A zoo pick built for one CPU kind, judged beside the file slimline builds for the other.

The zoo round builds on the machine at hand; on a VNNI machine its NNCF pick is an IR built with
NNCF's default overflow fix (first layer only). On a CPU without VNNI slimline builds the same
candidate with the overflow fix on every layer. This script builds that AVX2 file natively, from
the round's own calibration rows, and judges both files against FP32 ONNX Runtime on the CPU at
hand: natively, then under the emulated AVX2 kind (quality only). Figures in
``bench/RESULTS-zoo.md`` (the emulated AVX2 bullet of its summary).

    .venv/bin/python bench/zoo_kind_pair.py build /tmp/zoo-w/s4/all/nudenet --out /tmp/pair
    OMP_NUM_THREADS=1 qemu-x86_64 -cpu Haswell-noTSX .venv/bin/python bench/zoo_kind_pair.py \\
        judge /tmp/zoo-w/s4/all/nudenet --out /tmp/pair --rows 6
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import zoo_peers
from slimline.api import recipe_task
from slimline.compress.nncf_ov import nncf_ov_quantize
from slimline.compress.nncf_ptq import NncfConfig
from slimline.cpu import CpuInt8, detect
from slimline.recipe import load_recipe

AVX2 = CpuInt8("x86_64", frozenset({"avx2"}))
OV = "openvino"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("build", "judge"))
    ap.add_argument("work", type=Path, help="a zoo model's work folder (recipe.yaml, run/)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, help="the first evaluation rows only")
    args = ap.parse_args(argv)
    fp32, pick, runtime, label = zoo_peers._selected(args.work / "run")
    avx2_file = args.out / "nncf-ov-avx2.xml"
    if args.action == "build":
        if runtime != OV or pick.suffix != ".xml":
            raise SystemExit(f"the pick is {label} on {runtime}, not an NNCF IR on OpenVINO")
        task = recipe_task(load_recipe(args.work / "recipe.yaml"))
        args.out.mkdir(parents=True, exist_ok=True)
        meta = nncf_ov_quantize(
            fp32, task.calibration_data(), avx2_file, NncfConfig(), task.signature, AVX2
        )
        (args.out / "built.json").write_text(json.dumps(meta, indent=1, default=str))
        return 0
    doc = zoo_peers.quality_only(
        args.work / "recipe.yaml",
        args.work / "run",
        args.work / "peers",
        args.rows,
        pick_only=True,
        extra=[("NNCF IR built for AVX2", avx2_file, OV)],
    )
    doc["cpu"] = detect().describe()
    for row in doc["rows"]:
        print(row, flush=True)
    (args.out / f"judged-{detect().kind}.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

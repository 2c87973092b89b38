"""What README.md claims about the code, checked against the code (the layer table is checked
in test_layering.py, the library-API rule for bench/ in test_api.py)."""

from __future__ import annotations

import re
from pathlib import Path

import slimline
from slimline.examples import EXAMPLES
from slimline.recipe import TargetConfig

README = (Path(slimline.__file__).parent.parent.parent / "README.md").read_text()
RUNTIME_NAMES = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}


def _ticked(text: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", text))


def _paragraph(start: str) -> str:
    at = README.index(start)
    return README[at : README.find("\n\n", at)]


def test_the_opening_names_the_default_runtime() -> None:
    default = TargetConfig.model_fields["runtime"].default
    opening = README.split("\n\n", 1)[1].split("\n## ", 1)[0]
    assert f"{RUNTIME_NAMES[default]} on CPU by default" in opening.replace("\n", " ")


def test_the_readme_names_every_built_in_example() -> None:
    assert _ticked(_paragraph("Built-in examples")) >= set(EXAMPLES)
    layout = next(line for line in README.splitlines() if line.strip().startswith("examples/"))
    assert _ticked(layout) == set(EXAMPLES)

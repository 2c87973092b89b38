from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

from slimline.export import export_module
from slimline.measure.runners import OrtRunner


def test_export_leaves_the_callers_module_as_it_was(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    net.train()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    path = export_module(net, {"input": x}, tmp_path / "m.onnx")
    assert all(m.training for m in net.modules())
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    assert all(not (m._forward_hooks or m._forward_pre_hooks) for m in net.modules())
    with torch.no_grad():
        want = copy.deepcopy(net).eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(OrtRunner("m", path, 1).run({"input": x}), want, atol=1e-5)

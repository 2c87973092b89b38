from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from slimline.measure.runners import TorchRunner


def test_torch_runner_changes_neither_the_module_nor_the_thread_count() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    net.train()  # the caller's module in training mode (BatchNorm would update its statistics)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    x = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    before = torch.get_num_threads()
    runner = TorchRunner("t", net, before + 1)
    out = runner.run({"input": x})
    assert torch.get_num_threads() == before
    assert all(m.training for m in net.modules())
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    with torch.no_grad():
        want = copy.deepcopy(net).eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(out, want, rtol=1e-6)

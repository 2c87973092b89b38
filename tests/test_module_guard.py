from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from slimline.errors import StepError
from slimline.module_guard import eval_module, private_copy, torch_threads


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))


def test_an_eval_mode_module_is_used_as_it_is() -> None:
    net = _net().eval()
    assert eval_module(net) is net


def test_a_module_in_training_mode_is_run_as_an_eval_copy() -> None:
    net = _net().eval()
    net[2].train()  # one submodule left in training mode is enough
    view = eval_module(net)
    assert view is not net and not any(m.training for m in view.modules())
    assert net[2].training and not net[0].training  # the caller's flags, untouched
    state = net.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in view.state_dict().items())


def test_a_module_that_cannot_be_copied_is_a_step_error_naming_it() -> None:
    class Locked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lock = threading.Lock()

    with pytest.raises(StepError, match=r"cannot copy Locked .*copy\.deepcopy"):
        private_copy(Locked())


def test_thread_count_is_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    other = before + 1
    with torch_threads(other):
        assert torch.get_num_threads() == other
        with torch_threads(other):  # already so: nothing is set
            calls: list[int] = []
            monkeypatch.setattr(torch, "set_num_threads", calls.append)
            with torch_threads(other):
                pass
            assert calls == []
            monkeypatch.undo()
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(other):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == before

"""Prunable groups of a torch model, found by Torch-Pruning's dependency graph.

A *group* is a set of coupled channels that must be removed together: a conv's output channels
with the next conv's input channels and the batch norm between them, the channels a residual add
ties together, the heads of an attention block (its query/key/value outputs and the input of the
output projection), or the intermediate neurons of a transformer FFN. Removing channels really
shrinks the layers: the pruned model is a smaller dense model.

Every structural change is followed by a forward pass on the example inputs; a model the
dependency graph did not trace completely fails there, and the error names the module.
"""

from __future__ import annotations

import fnmatch
import io
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from ...errors import StepError

if TYPE_CHECKING:  # torch is imported where it runs: importing slimline does not load it
    from torch import Tensor, nn

__all__ = [
    "CostModel",
    "PrunableGroup",
    "PruneGraph",
    "apply_history",
    "count_macs_params",
    "keep_units",
    "prune_channels",
    "sync_attention",
]

GroupKind = Literal["channels", "heads"]


@dataclass(frozen=True)
class PrunableGroup:
    name: str  # module name: the root layer, or the attention block for heads
    kind: GroupKind
    size: int  # units (channels or heads) in the unpruned model
    unit: int  # channels per unit: 1, or the head dimension
    modules: tuple[str, ...]  # layers whose weights the group touches
    outputs: tuple[str, ...]  # of those, the layers whose output channels it removes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def keep_units(size: int, ratio: float, kind: GroupKind, round_to: int, max_ratio: float) -> int:
    """Units kept when ``ratio`` of ``size`` is removed: channel counts rounded to a multiple of
    ``round_to`` (never below it), head counts to the nearest whole head; never above the cap."""
    if ratio <= 0.0:
        return size
    if kind == "heads" or round_to <= 1:
        keep = max(1, round(size * (1.0 - ratio)))
        while (size - keep) / size > max_ratio + 1e-9:
            keep += 1
        return min(size, keep)
    keep = max(round_to, round(size * (1.0 - ratio) / round_to) * round_to)
    while keep < size and (size - keep) / size > max_ratio + 1e-9:
        keep += round_to
    return min(size, keep)


@contextmanager
def _module_stack(model: nn.Module) -> Iterator[list[str]]:
    """Track which modules are executing; after an exception the innermost is last."""
    stack: list[str] = []
    handles = []
    for name, mod in model.named_modules():
        if not name:
            continue

        def pre(_m: nn.Module, _a: tuple[Any, ...], n: str = name) -> None:
            stack.append(n)

        def post(_m: nn.Module, _a: tuple[Any, ...], _o: Any, n: str = name) -> None:
            if stack and stack[-1] == n:
                stack.pop()

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def _forward(model: nn.Module, example: dict[str, Tensor]) -> Any:
    out = model(**example)
    return out[0] if isinstance(out, (tuple, list)) else out


def _attention_blocks(model: nn.Module) -> dict[str, Any]:
    """HF-style self-attention blocks: ``num_attention_heads`` and query/key/value Linears."""
    import torch.nn as nn

    blocks = {}
    for name, mod in model.named_modules():
        heads = getattr(mod, "num_attention_heads", None)
        qkv = [getattr(mod, k, None) for k in ("query", "key", "value")]
        if isinstance(heads, int) and all(isinstance(m, nn.Linear) for m in qkv):
            blocks[name] = mod
    return blocks


def sync_attention(model: nn.Module) -> None:
    """Keep attention blocks' head counts in step with their (pruned) projections."""
    for mod in _attention_blocks(model).values():
        head_dim = (
            int(getattr(mod, "attention_head_size", 0))
            or mod.query.out_features // mod.num_attention_heads
        )
        mod.num_attention_heads = mod.query.out_features // head_dim
        if hasattr(mod, "all_head_size"):
            mod.all_head_size = mod.query.out_features


def _head_dim(block: Any) -> int:
    return (
        int(getattr(block, "attention_head_size", 0))
        or block.query.out_features // block.num_attention_heads
    )


class PruneGraph:
    """The dependency graph of ``model`` and its prunable groups.

    ``exclude`` holds module-name patterns (fnmatch) whose output channels are never pruned.
    The output layers (whose channels are the model's output) are always kept; with
    ``keep_first_last`` the first conv/linear layer in execution order is kept too. Groups whose channels cannot be rounded to ``round_to`` are left out.
    """

    def __init__(
        self,
        model: nn.Module,
        example: dict[str, Tensor],
        *,
        exclude: list[str] | tuple[str, ...] = (),
        keep_first_last: bool = True,
        round_to: int = 8,
    ) -> None:
        self.model = model
        self.example = example
        self.round_to = round_to
        self.names = {m: n for n, m in model.named_modules()}
        self.dg, order = self._build()
        self._rank = {n: i for i, n in enumerate(order)}
        self.skipped: dict[str, str] = {}
        self._roots: dict[str, tuple[Any, Any]] = {}
        self.groups = self._discover(self._ignored(order, exclude, keep_first_last))

    # -- tracing -------------------------------------------------------------------------------
    def _build(self) -> tuple[Any, list[str]]:
        import torch
        import torch_pruning as tp

        order: list[str] = []
        roots = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear)
        hooks = [
            m.register_forward_pre_hook(lambda _m, _a, n=n: order.append(n))
            for n, m in self.model.named_modules()
            if isinstance(m, roots)
        ]
        try:
            with _module_stack(self.model) as stack:
                try:
                    dg = tp.DependencyGraph().build_dependency(
                        self.model,
                        example_inputs=self.example,
                        output_transform=_first_output,
                        verbose=False,
                    )
                except Exception as err:
                    where = stack[-1] if stack else "(graph construction after the forward pass)"
                    raise StepError(
                        f"Torch-Pruning cannot trace the model: {_first_line(err)} in module "
                        f"{where!r}; make that module's forward use plain torch ops on tensors, or "
                        "prune a model without it"
                    ) from None
        finally:
            for h in hooks:
                h.remove()
        return dg, list(dict.fromkeys(order))

    def _ignored(
        self, order: list[str], exclude: list[str] | tuple[str, ...], keep_first_last: bool
    ) -> list[nn.Module]:
        names = set(fnmatch.filter(self.names.values(), "*")) - {""}
        picked = {n for pat in exclude for n in fnmatch.filter(names, pat)}
        picked |= self._output_layers()  # their channels are the model's output
        if keep_first_last and order:
            picked.add(order[0])
        by_name = {n: m for m, n in self.names.items()}
        return [by_name[n] for n in sorted(picked)]

    def _output_layers(self) -> set[str]:
        """Conv/linear layers whose output reaches the model output through no other such layer
        (the "last" layers: pruning their channels would change the output)."""
        import torch

        made: dict[Any, str] = {}
        hooks = []
        for name, mod in self.model.named_modules():
            if isinstance(mod, (torch.nn.modules.conv._ConvNd, torch.nn.Linear)):

                def hook(_m: nn.Module, _i: tuple[Any, ...], o: Any, n: str = name) -> None:
                    if isinstance(o, torch.Tensor) and o.grad_fn is not None:
                        made[o.grad_fn] = n

                hooks.append(mod.register_forward_hook(hook))
        try:
            with torch.enable_grad():
                out = _forward(self.model, self.example)
        finally:
            for h in hooks:
                h.remove()
        found: set[str] = set()
        seen: set[Any] = set()
        todo = [out.grad_fn] if getattr(out, "grad_fn", None) is not None else []
        while todo:
            fn = todo.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            if fn in made:
                found.add(made[fn])
                continue
            todo.extend(nxt for nxt, _ in fn.next_functions)
        return found

    # -- discovery ------------------------------------------------------------------------------
    def _discover(self, ignored: list[Any]) -> dict[str, PrunableGroup]:
        import torch_pruning as tp

        blocks = _attention_blocks(self.model)
        qkv_owner = {getattr(b, k): n for n, b in blocks.items() for k in ("query", "key", "value")}
        groups: dict[str, PrunableGroup] = {}
        for group in self.dg.get_all_groups(
            ignored_layers=ignored, root_module_types=[tp.ops.TORCH_CONV, tp.ops.TORCH_LINEAR]
        ):
            touched = self._touched(group)
            out_mods = [
                d.target.module for d, _ in group if self.dg.is_out_channel_pruning_fn(d.handler)
            ]
            outs = tuple(sorted({self.names[m] for m in out_mods if m in self.names}))
            owners = {qkv_owner[m] for m in out_mods if m in qkv_owner}
            root = group[0].dep.target.module
            if owners:
                self._add_heads(groups, owners, blocks, touched, outs)
                continue
            name = (
                min(outs, key=lambda n: self._rank.get(n, len(self._rank)))
                if outs
                else self.names[root]
            )
            size = int(self.dg.get_out_channels(root))
            reason = self._unprunable(out_mods, size)
            if reason:
                self.skipped[name] = reason
                continue
            self._roots[name] = (root, group[0].dep.handler)
            groups[name] = PrunableGroup(name, "channels", size, 1, touched, outs)
        return groups

    def _add_heads(
        self,
        groups: dict[str, PrunableGroup],
        owners: set[str],
        blocks: dict[str, Any],
        touched: tuple[str, ...],
        outs: tuple[str, ...],
    ) -> None:
        import torch_pruning as tp

        if len(owners) != 1:
            self.skipped[",".join(sorted(owners))] = (
                "attention projections of several blocks are coupled"
            )
            return
        (name,) = owners
        block = blocks[name]
        heads = block.query.out_features // _head_dim(block)
        if heads < 2:
            self.skipped[name] = "a single attention head is left"
            return
        self._roots[name] = (block.query, tp.prune_linear_out_channels)
        groups[name] = PrunableGroup(name, "heads", heads, _head_dim(block), touched, outs)

    def _touched(self, group: Any) -> tuple[str, ...]:
        return tuple(
            sorted({self.names[d.target.module] for d, _ in group if d.target.module in self.names})
        )

    def _unprunable(self, out_mods: list[Any], size: int) -> str:
        import torch.nn as nn

        for m in out_mods:
            if isinstance(m, nn.modules.conv._ConvNd) and 1 < m.groups < m.out_channels:
                return "grouped convolution (not depthwise)"
        if self.round_to > 1 and size <= self.round_to:
            return f"{size} channels cannot be rounded below {self.round_to}"
        return ""

    # -- pruning --------------------------------------------------------------------------------
    def units(self, name: str) -> int:
        root, _ = self._roots[name]
        channels = int(self.dg.get_out_channels(root))
        g = self.groups[name]
        return channels // g.unit

    def full_group(self, name: str) -> Any:
        root, fn = self._roots[name]
        return self.dg.get_pruning_group(root, fn, list(range(int(self.dg.get_out_channels(root)))))

    def removal_order(self, name: str, importance: Callable[[Any], Any]) -> list[int]:
        """Units of ``name`` from least to most important."""
        import torch

        imp = importance(self.full_group(name))
        if imp is None:
            return list(range(self.units(name)))
        imp = imp.detach().float().cpu()
        g = self.groups[name]
        if g.kind == "heads":
            imp = imp.view(-1, g.unit).mean(1)
        return [int(i) for i in torch.argsort(imp, stable=True)]

    def channels(self, name: str, units: list[int]) -> tuple[str, list[int]]:
        """(root layer name, output-channel indices) that remove ``units`` of group ``name``."""
        g = self.groups[name]
        root, _ = self._roots[name]
        return self.names[root], sorted(u * g.unit + j for u in units for j in range(g.unit))

    def remove(self, name: str, units: list[int]) -> None:
        """Remove ``units`` (indices into the current units) of group ``name``, then check that
        the model still runs."""
        if not units:
            return
        _, idxs = self.channels(name, units)
        root, fn = self._roots[name]
        group = self.dg.get_pruning_group(root, fn, idxs)
        if not self.dg.check_pruning_group(group):
            raise StepError(
                f"pruning group {name!r} would remove every channel of a layer; lower its ratio "
                "in the plan or exclude it"
            )
        group.prune()
        sync_attention(self.model)
        self.check(name)

    def prune_to(self, name: str, keep: int, importance: Callable[[Any], Any]) -> int:
        """Prune group ``name`` down to ``keep`` units, least important first; returns removed."""
        drop = self.units(name) - keep
        if drop <= 0:
            return 0
        self.remove(name, self.removal_order(name, importance)[:drop])
        return drop

    def check(self, pruned: str) -> None:
        import torch

        with _module_stack(self.model) as stack, torch.no_grad():
            try:
                _forward(self.model.eval(), self.example)
            except Exception as err:
                where = stack[-1] if stack else "(model)"
                raise StepError(
                    f"after pruning group {pruned!r} the model fails in module {where!r} "
                    f"({_first_line(err)}): Torch-Pruning could not trace a dependency there "
                    f"(a detach, numpy round trip or custom op?); exclude {pruned!r} with "
                    f"`exclude: [{pruned}]`"
                ) from None

    def history(self) -> list[list[Any]]:
        return [
            [n, bool(out), [int(i) for i in idxs]] for n, out, idxs in self.dg.pruning_history()
        ]


def _first_output(out: Any) -> Any:
    if isinstance(out, (tuple, list)):
        out = out[0]
    if hasattr(out, "last_hidden_state"):
        out = out.last_hidden_state
    return out.float().sum()


def prune_channels(
    model: nn.Module, example: dict[str, Tensor], root: str, idxs: list[int]
) -> nn.Module:
    """Remove output channels ``idxs`` of layer ``root`` and everything coupled to them, in
    place (one-off: builds its own dependency graph)."""
    return apply_history(model, example, [[root, True, idxs]])


def apply_history(
    model: nn.Module, example: dict[str, Tensor], history: list[list[Any]]
) -> nn.Module:
    """Re-apply a recorded pruning history to a fresh copy of the unpruned model (in place)."""
    import torch_pruning as tp

    if not history:
        return model
    dg = tp.DependencyGraph().build_dependency(
        model, example_inputs=example, output_transform=_first_output, verbose=False
    )
    dg.load_pruning_history([list(h) for h in history])
    sync_attention(model)
    return model


# -- MACs and parameters ---------------------------------------------------------------------------
def count_macs_params(model: nn.Module, example: dict[str, Tensor]) -> tuple[int, int]:
    """(MACs at batch 1, parameters) counted by Torch-Pruning's op counter."""
    macs, params, _ = _count_layers(model, example)
    return macs, params


def _count_layers(
    model: nn.Module, example: dict[str, Tensor]
) -> tuple[int, int, dict[str, float]]:
    import torch
    import torch_pruning as tp

    one = {k: v[:1] for k, v in example.items()}
    with torch.no_grad(), redirect_stdout(io.StringIO()):
        macs, params, layer_macs, _ = tp.utils.count_ops_and_params(model, one, layer_wise=True)
    names = {m: n for n, m in model.named_modules()}
    leaf = {
        names[m]: float(v)
        for m, v in layer_macs.items()
        if v and not any(True for _ in m.children())
    }
    return int(macs), int(params), leaf


@dataclass
class _Layer:
    macs: float
    weight: float  # conv/linear weight elements: scale with input and output channels
    bias: float  # bias and norm elements: scale with output channels only
    groups: tuple[str, ...]  # every group touching the layer
    out_groups: tuple[str, ...]  # groups on its output channels


class CostModel:
    """MACs and parameters of the model as a function of each group's kept fraction.

    A conv or linear layer's MACs and weights scale with the kept fraction of every group that
    touches it (output and input channels); biases and norm parameters with the fraction of the
    group on their channels. This matches Torch-Pruning's module-level op counter exactly for
    convolutions and linear layers, and lets the planner price thousands of plans instantly.
    """

    def __init__(self, graph: PruneGraph) -> None:
        import torch

        self.total_macs, self.total_params, macs = _count_layers(graph.model, graph.example)
        touching: dict[str, set[str]] = {}
        outputs: dict[str, set[str]] = {}
        for g in graph.groups.values():
            for m in g.modules:
                touching.setdefault(m, set()).add(g.name)
            for m in g.outputs:
                outputs.setdefault(m, set()).add(g.name)
        self.layers: dict[str, _Layer] = {}
        for name, mod in graph.model.named_modules():
            if name not in touching:
                continue
            own = float(sum(p.numel() for _, p in mod.named_parameters(recurse=False)))
            if isinstance(mod, (torch.nn.modules.conv._ConvNd, torch.nn.Linear)):
                weight, outs = float(mod.weight.numel()), outputs.get(name, set())
            else:
                weight, outs = 0.0, touching[name]
            self.layers[name] = _Layer(
                macs.get(name, 0.0),
                weight,
                own - weight,
                tuple(sorted(touching[name])),
                tuple(sorted(outs)),
            )

    def cost(self, kept: dict[str, float]) -> tuple[float, float]:
        """(MACs, params) with ``kept[group]`` the kept fraction of each group (default 1)."""
        macs, params = float(self.total_macs), float(self.total_params)
        for layer in self.layers.values():
            f = math.prod(kept.get(g, 1.0) for g in layer.groups)
            f_out = math.prod(kept.get(g, 1.0) for g in layer.out_groups)
            macs -= layer.macs * (1.0 - f)
            params -= layer.weight * (1.0 - f) + layer.bias * (1.0 - f_out)
        return macs, params

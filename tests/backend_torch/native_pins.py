"""The native hand-pinned torch model a pin stands for, and training it beside ampbridge (shared by
test_native_pins.py and test_fuzz_models.py; not a test module).

A pin, written by hand: the module's forward runs under ``torch.autocast(device, enabled=False)`` on
its floating inputs cast to float32; the model's forward runs under ``torch.autocast(device, dtype)``;
``torch.amp.GradScaler`` scales the loss. Nothing else is cast anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

import ampbridge.torch as abt
from ampbridge import Policy


def hand_pin(model: nn.Module, paths: Iterable[str], device: str = "cpu") -> None:
    """Run each module at ``paths`` under autocast(enabled=False) on float32 inputs (in place)."""
    for path in paths:
        module = model.get_submodule(path)
        inner = module.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            with torch.autocast(device, enabled=False):
                args, kwargs = tree_map_only(torch.Tensor, lambda t: t.float() if t.is_floating_point() else t,
                                             (args, kwargs))
                return _inner(*args, **kwargs)

        module.forward = forward  # type: ignore[method-assign]


def pinned_paths(plan: Any) -> list[str]:
    """The outermost rows a keep_float32 entry pins (what a user would wrap by hand)."""
    return [r.path for r in plan.rows if r.rule.startswith("keep_float32") and r.inherited_from is None]


def record_outputs(model: nn.Module) -> tuple[dict[str, torch.dtype], list[Any]]:
    """Forward hooks that record each module's (first floating) output dtype."""
    seen: dict[str, torch.dtype] = {}

    def hook(path: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, out: Any) -> None:
            first = out
            if not isinstance(out, torch.Tensor):
                leaves = [t for t in torch.utils._pytree.tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.is_floating_point()]
                first = leaves[0] if leaves else None
            if isinstance(first, torch.Tensor) and first.is_floating_point():
                seen.setdefault(path, first.dtype)
        return record

    handles = [m.register_forward_hook(hook(p)) for p, m in model.named_modules()]
    return seen, handles


class Trained:
    """One training run: per-step losses, scales, skipped steps, final parameters, output dtypes."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.scales: list[float] = []
        self.outputs: dict[str, torch.dtype] = {}
        self.params: dict[str, torch.Tensor] = {}


def train(build: Callable[[], nn.Module], policy: Policy, batches: Sequence[tuple[Any, Any]],
          loss_fn: Callable[[Any, Any], torch.Tensor], *, native: bool, inject: Iterable[int] = (),
          lr: float = 0.05) -> tuple[Trained, Any]:
    """Train ``build()`` on ``batches`` natively (hand-pinned as ampbridge's Plan pins) or with
    ampbridge; at the steps in ``inject`` the scaled loss is made infinite (the step is skipped)."""
    inject, run = set(inject), Trained()
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    cfg = policy.resolved_loss_scale
    dtype = getattr(torch, policy.compute_dtype)
    if native:
        hand_pin(model, pinned_paths(abt.plan(build(), policy)))
        scaler = torch.amp.GradScaler("cpu", init_scale=cfg.initial_scale, growth_factor=cfg.growth_factor,
                                      backoff_factor=cfg.backoff_factor, growth_interval=cfg.growth_interval,
                                      enabled=cfg.mode == "dynamic")
        amp = None
    else:
        amp = abt.apply(model, policy)
    seen, handles = record_outputs(model)
    for i, (x, y) in enumerate(batches):
        if native:
            with torch.autocast("cpu", dtype=dtype):
                out = model(*x)
            loss = loss_fn(out, y)
            run.scales.append(scaler.get_scale())
            scaler.scale(loss * math.inf if i in inject else loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            out = amp.model(*x)
            loss = loss_fn(out, y)
            run.scales.append(amp.scaler.loss_scale_state().scale)
            amp.step(loss * math.inf if i in inject else loss, opt)
        opt.zero_grad(set_to_none=True)
        run.losses.append(float(loss))
        if i == 0:
            run.outputs = dict(seen)
    for h in handles:
        h.remove()
    run.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return run, amp


def mismatches(native: Trained, ours: Trained) -> list[str]:
    """Every way the two runs differ (bit for bit); empty when ampbridge equals the hand-pinned model."""
    out = []
    if [torch.tensor(x).view(torch.int32).item() for x in native.losses] != \
            [torch.tensor(x).view(torch.int32).item() for x in ours.losses]:
        out.append(f"losses {native.losses} != {ours.losses}")
    if native.scales != ours.scales:
        out.append(f"scales {native.scales} != {ours.scales}")
    for name, p in native.params.items():
        q = ours.params[name]
        if p.dtype != q.dtype or not torch.equal(p.view(-1).view(torch.int32) if p.dtype == torch.float32 else p,
                                                 q.view(-1).view(torch.int32) if q.dtype == torch.float32 else q):
            out.append(f"parameter {name}")
    for path in native.outputs.keys() | ours.outputs.keys():
        if path and native.outputs.get(path) != ours.outputs.get(path):
            out.append(f"output of {path!r}: native {native.outputs.get(path)}, ampbridge {ours.outputs.get(path)}")
    return out


def finite_losses(run: Trained) -> list[float]:
    return [x for x in run.losses if math.isfinite(x)]

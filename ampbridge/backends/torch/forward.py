"""The forward ampbridge installs on a pinned module: its region (autocast off, or a nested
autocast), its input, parameter and output casts, and installing and removing it.

Holds ``ForwardSpec``, ``_Forward``, ``install_forward``, ``uninstall_forward``, ``installed``,
``autocast_region``, ``float32_matmul_precision``, ``keep_slow_path`` and ``MhaSlowPath``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

# --- the realisation ---------------------------------------------------------------------------

class ForwardSpec(NamedTuple):
    """How one module's forward is run (frozen; stored on the module's forward wrapper)."""

    path: str
    device_type: str
    region: torch.dtype | None  # autocast region to enter; float32 = autocast off; None = enclosing
    input_dtype: torch.dtype | None  # floating inputs cast to this
    output_dtype: torch.dtype | None  # floating outputs cast to this
    param_dtype: torch.dtype | None  # own parameters presented in this dtype for the call
    matmul_precision: str | None = None  # the root only
    root: bool = False
    params_follow_input: bool = False  # present own parameters in the first floating input's dtype


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    # .to(dtype) unconditionally (it returns the tensor itself when the dtype is equal): a cast decided
    # by comparing dtypes would be decided at trace time under torch.compile, from a fake tensor whose
    # dtype can differ from the real one (a fused kernel's output under CPU autocast)
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if value is None or isinstance(value, (int, float, bool, str)):
        return value
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def autocast_region(device_type: str, dtype: torch.dtype | None) -> Any:
    """The autocast context a region computing in ``dtype`` runs in: none (None), autocast off
    (float32), or a nested autocast to ``dtype``."""
    if dtype is None:
        return contextlib.nullcontext()
    if dtype == torch.float32:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=dtype)


class float32_matmul_precision:
    """``torch.set_float32_matmul_precision`` for a scope, restored after (nothing when it is equal)."""

    __slots__ = ("precision", "previous")

    def __init__(self, precision: str | None):
        self.precision, self.previous = precision, None

    def __enter__(self) -> None:
        # inside torch.compile the setting in force when the compiled call starts applies (call it in
        # amp.autocast(), which sets it eagerly); reading it here would break the graph
        if self.precision is not None and not torch.compiler.is_compiling():
            previous = torch.get_float32_matmul_precision()
            if previous != self.precision:
                self.previous = previous
                torch.set_float32_matmul_precision(self.precision)

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            torch.set_float32_matmul_precision(self.previous)
            self.previous = None


@contextlib.contextmanager
def _params_as(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    # The parameters are presented in the compute dtype for this call only (their storage dtype
    # cannot feed the kernel); autograd carries the gradients back to the stored ones. A
    # MultiheadAttention reads its out_proj's parameters itself, so those are included.
    owners = [m for _, m in module.named_modules()] if isinstance(module, nn.MultiheadAttention) else [module]
    saved = [(m, name, p) for m in owners for name, p in m._parameters.items()
             if p is not None and p.is_floating_point() and p.dtype != dtype]
    for m, name, p in saved:
        m._parameters[name] = p.to(dtype)  # type: ignore[assignment]
    try:
        yield
    finally:
        for m, name, p in saved:
            m._parameters[name] = p


class _Forward:
    """The forward ampbridge installs on a module (an instance attribute; ``remove()`` deletes it)."""

    __slots__ = ("module", "spec", "previous")

    def __init__(self, module: nn.Module, spec: ForwardSpec, previous: Any):
        self.module, self.spec, self.previous = module, spec, previous

    @property
    def __wrapped__(self) -> Any:
        # the forward this one runs, so inspect.signature(model.forward) is the model's own: Trainer's
        # remove_unused_columns and loss-kwargs check and Lightning read the names there; computed per
        # access, as in __call__ (FSDP2 swaps the class). Nothing else is forwarded (__self__, __func__,
        # __code__): Dynamo reads them off a forward and would trace the model's own, without the regions
        return self.previous if self.previous is not None else type(self.module).forward.__get__(self.module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # kept flat (this runs for every pinned module on every forward): no helper frames on the
        # common path of tensor arguments, one region, no parameter presentation
        spec, module = self.spec, self.module
        dtype = spec.input_dtype
        if dtype is not None:
            args = tuple((a.to(dtype) if a.is_floating_point() else a)  # unconditional: see _cast_floating
                         if isinstance(a, torch.Tensor) else _cast_floating(a, dtype) for a in args)
            if kwargs:
                kwargs = {k: _cast_floating(v, dtype) for k, v in kwargs.items()}
        present = spec.param_dtype
        if spec.params_follow_input:
            present = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
        # looked up at call time: FSDP2's fully_shard swaps the module's class after apply
        inner = self.previous if self.previous is not None else type(module).forward.__get__(module)
        region = spec.region
        if region is None:
            scope: Any = contextlib.nullcontext()
        elif region is torch.float32:
            scope = torch.autocast(spec.device_type, enabled=False)
        else:
            scope = torch.autocast(spec.device_type, dtype=region)
        if spec.root:
            with float32_matmul_precision(spec.matmul_precision), scope:
                out = inner(*args, **kwargs) if present is None else _call_with_params(module, present, inner,
                                                                                        args, kwargs)
        else:
            with scope:
                out = inner(*args, **kwargs) if present is None else _call_with_params(module, present, inner,
                                                                                        args, kwargs)
        dtype = spec.output_dtype
        if dtype is None:
            return out
        if isinstance(out, torch.Tensor):
            return out.to(dtype) if out.is_floating_point() else out
        return _cast_floating(out, dtype)


def keep_slow_path(module: nn.Module, args: Any) -> None:
    """A no-op forward pre-hook: TransformerEncoderLayer skips its fused eval fast path (which would
    bypass its children's forwards, and with them their rules) while any hook is attached."""


class MhaSlowPath:
    """Forward pre-hook and always-called forward hook that keep a ``MultiheadAttention`` off its
    fused eval path for its call (``torch.backends.mha.set_fastpath_enabled``, restored after).

    That path checks CUDA's autocast only: under CPU autocast it runs a float32 query through one
    fused kernel (autocast reaching some of its inner ops), while torch.compile always takes the
    ordinary path (per-op autocast, as the Plan says), so eager and compiled outputs would differ.
    Inside a compiled region the hooks do nothing (the compiled code takes that path already).
    """

    __slots__ = ("previous",)

    def __init__(self) -> None:
        self.previous: list[bool] = []

    def before(self, module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            self.previous.append(torch.backends.mha.get_fastpath_enabled())
            torch.backends.mha.set_fastpath_enabled(False)

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.compiler.is_compiling() and self.previous:
            torch.backends.mha.set_fastpath_enabled(self.previous.pop())


def _call_with_params(module: nn.Module, dtype: torch.dtype, inner: Any, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
    with _params_as(module, dtype):
        return inner(*args, **kwargs)


def installed(module: nn.Module) -> _Forward | None:
    fwd = module.__dict__.get("forward")
    return fwd if isinstance(fwd, _Forward) else None


def install_forward(module: nn.Module, spec: ForwardSpec) -> None:
    """Give ``module`` ampbridge's forward for ``spec`` (over any instance forward already there)."""
    previous = module.__dict__.get("forward")
    module.forward = _Forward(module, spec, previous)  # type: ignore[method-assign]


def uninstall_forward(module: nn.Module) -> None:
    """Remove ampbridge's forward from ``module`` (what was there before comes back)."""
    fwd = installed(module)
    if fwd is None:
        return
    if fwd.previous is not None:
        module.forward = fwd.previous  # type: ignore[method-assign]
    else:
        del module.__dict__["forward"]

"""The numerics monitor: per-layer gradient statistics, overflow attribution (which layer went
non-finite first) and the run log ``ampbridge report`` reads.
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ...errors import AmpBridgeWarning
from ..common import StepRecord, read_host_scalar
from .plan import bypassed_modules

# --- the numerics monitor ----------------------------------------------------------------------

#: steps a monitor keeps on the device while the host has not learnt their found_inf (a fused
#: optimizer, or skip_nonfinite = false); it reads them together at the next sampled step, or here
_PENDING_LIMIT = 1000


def _to_host(values: torch.Tensor) -> list[float]:
    """The monitor's one device-to-host transfer for a logged step (tests count the calls)."""
    return values.to("cpu").tolist()


def _flag_in_host_memory(found: torch.Tensor | None) -> bool | None:
    """found_inf (> 0) where it already lies in host memory (the CPU device), else None.

    A CPU tensor's value is computed by the time its op returns, so this waits for nothing: it
    reads the four bytes at ``data_ptr()`` (no aten op). On an accelerator the same read would wait for the device, which a fused optimizer's
    loop never does, so there the monitor keeps the flag on the device instead."""
    if (found is None or type(found) is not torch.Tensor or found.device.type != "cpu"
            or found.dtype is not torch.float32 or found.numel() != 1):
        return None
    return read_host_scalar(found.data_ptr(), "float32") > 0


def _dense(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_dense() if grad.layout is not torch.strided else grad


def _extremes(t: torch.Tensor, values: list[torch.Tensor], who: list[int], index: int) -> None:
    """Append min and max of ``t`` (one kernel; non-finite iff some element is: nan propagates)."""
    low, high = torch.aminmax(t)
    values += (low, high)
    who += (index, index)


class _Flags:
    """What attribution saw in one step: extremes on the device, and on the host whose they are."""

    __slots__ = ("fwd_vals", "fwd_who", "bwd_vals", "bwd_who")

    def __init__(self) -> None:
        # forward outputs per candidate call, then the gradients w.r.t. each call's inputs in
        # backward order (who[k]: the candidate of values[k])
        self.fwd_vals: list[torch.Tensor] = []
        self.fwd_who: list[int] = []
        self.bwd_vals: list[torch.Tensor] = []
        self.bwd_who: list[int] = []


class _Call(NamedTuple):
    """One forward of the root (with gradients on) in replay mode: what a replay needs, by reference."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: tuple[torch.Tensor, torch.Tensor | None]  # the CPU generator's state, the accelerator's
    autocast: tuple[bool, torch.dtype]  # the enclosing autocast of the monitor's device type
    grads: dict[int, torch.Tensor]  # output leaf index -> its gradient (filled by the backward)


def _tensor_leaves(out: Any) -> list[Any]:
    """The leaves of a forward's output, mappings opened (a transformers ModelOutput is one)."""
    leaves = []
    for t in tree_leaves(out):
        if isinstance(t, dict) and not isinstance(t, torch.Tensor):
            leaves += _tensor_leaves(list(t.values()))
        else:
            leaves.append(t)
    return leaves


_NO_KWARGS: dict[str, Any] = {}  # shared by every recorded call without keywords (only ever read)

#: forwards kept for a replay between two steps (a loop that only runs forwards does not grow it)
_CALLS_LIMIT = 64


class _Pending(NamedTuple):
    """A step whose found_inf is still on the device (read later, all pending steps at once)."""

    step: int
    skip: bool
    values: torch.Tensor  # found, loss, scale, then the attribution maxima (forward, backward, parameters)
    fwd_who: list[int]
    bwd_who: list[int]
    param_who: list[int]


class Monitor:
    """The numerics log of a training run (JSON Lines; ``ampbridge report RUN.jsonl`` reads it).

    Made by :meth:`TorchAmp.monitor`; the scaler feeds it (``amp.step``, or the native
    ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` loop). Every step record
    holds the loss (of the last ``scaler.scale`` call), the scale the step used, ``found_inf`` and
    ``skipped``. On steps 0, N, 2N, ... of the scaler's step counter (``every=N``) it also holds
    each layer's gradient statistics (``ampbridge.diagnostics.runlog.layer_stats``: the gradients of the
    parameters the layer owns, before unscaling, in the layer's compute dtype), computed with
    torch ops on the device and read in one transfer. A step whose gradients were non-finite is
    always logged, with ``first_nonfinite``: where a forward value first went non-finite, in the
    order forwards finish: a leaf module's or a container's (a block's) output, its inputs having
    been finite (a module whose inputs were already non-finite is never named: the container
    whose own code made them is, or ``{"path": "", "where": "input"}`` for the model's inputs),
    else the first leaf (backward order) whose input gradient or own parameter gradient
    was, else ``{"path": "", "where": "loss"}``; and, when the host read ``found_inf`` (the
    default loop: the scaler syncs to skip), with every layer's statistics, sampled or not.

    Attribution (``attribution=True``) probes each leaf module: an ``aminmax`` of its output, of its
    positional inputs and of the gradient w.r.t. its inputs (through a view of each input); and
    each container below the root: an ``aminmax`` of its inputs and output. Where the host learns
    found_inf at the step (the default loop: the scaler reads it to skip), the probes are off
    and a step costs exactly what it costs without a monitor (aten ops, casts, host syncs; the
    monitor keeps references to the root's inputs, the gradients of its outputs and the RNG
    state, host-side): on a non-finite step, skipped, so parameters and optimizer state are as
    before it, the monitor *replays* that step's forwards with the probes on (same inputs, same
    RNG, same autocast; buffers and RNG restored after) and runs their backward from the
    recorded output gradients with ``torch.autograd.grad`` (``.grad`` untouched). A fused
    optimizer on the CPU device is the same case: its found_inf already lies in host memory, and
    the monitor reads those four bytes (no aten op, nothing to wait for). With a fused optimizer
    on an accelerator, ``skip_nonfinite = false`` or mode none without skipping, the host never
    learns found_inf and the step is not replayable later, so the probes stay on every step (two
    small device ops per leaf, no host sync) and those steps wait on the device, read with the
    next sampled step (at the latest every 1000 steps). The first step a monitor sees is probed (it
    learns which case it is in). Modules with ``inplace=True`` get no input probe (an in-place
    op on a probed input would lose it); a leaf whose output holds inf on purpose (an additive
    mask) would be named first: pass ``attribution=False`` or keep the mask out of a module.

    Example:
        >>> import tempfile, os, torch, ampbridge
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> amp = ampbridge.torch.apply(model, "mixed_float16")
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> with amp.monitor(path, every=10):
        ...     for _ in range(3):
        ...         _ = amp.step(model(torch.ones(2, 4)).mean() * 1e-3, opt)
        >>> log = ampbridge.diagnostics.runlog.read_log(path)
        >>> log.header["layers"], [s["step"] for s in log.steps], sorted(log.steps[0]["layers"])
        (['0', '1'], [0], ['0', '1'])
    """

    def __init__(self, path: str | Path, model: Any, *, every: int = 1, attribution: bool = True):
        amp = model  # the TorchAmp of ``apply``: its scaler feeds the monitor
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be an integer >= 1 (statistics on every N-th step); received {every!r}")
        self.path = Path(path)
        self.every = every
        self.attribution = bool(attribution)
        self.path.open("w", encoding="utf-8").close()  # an unwritable path fails here, not mid-run
        self._amp = amp
        named = list(amp.model.named_modules())
        modules = dict(named)
        # the parameters each layer owns (a shared one counts at its first module, as in layers())
        seen: set[int] = set()
        self._owned: list[tuple[str, list[nn.Parameter]]] = []
        for path_, module in named:
            own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for p in own)
            own = [p for p in own if p.is_floating_point() and not isinstance(p, nn.parameter.UninitializedParameter)]
            if own:
                self._owned.append((path_, own))
        # attribution candidates: modules that run no sub-module (a MultiheadAttention never calls
        # its out_proj: it is the candidate, not out_proj)
        bypassed = bypassed_modules(amp.model)
        whole = set(bypassed.values())
        self._candidates = [p for p, m in named
                            if p not in bypassed and (next(m.children(), None) is None or p in whole)]
        index = {p: i for i, p in enumerate(self._candidates)}
        # block and container boundaries: their outputs are probed after the leaves (a value can go
        # non-finite in a container's own code, e.g. a residual add); indices after the candidates'
        leaves = set(self._candidates)
        self._probed = self._candidates + [p for p, m in named if p and p not in leaves and p not in bypassed]
        # candidates' own parameters first: their flags are the attribution fallback
        owned_by = [(index.get(p, -1), q) for p, params in self._owned for q in params]
        self._grad_params = sorted(owned_by, key=lambda t: t[0] < 0)
        self._order: list[str] = []
        self._order_seen: set[str] = set()
        self._order_hooks = [m.register_forward_pre_hook(functools.partial(self._first_call, p)) for p, m in named]
        self._modules = modules
        self._hooks: list[Any] = []  # the probes, while on
        self._capture_hooks: list[Any] = []  # the root's recorders, while probes are off
        self._calls: list[_Call] = []
        self._calls_lost = False  # more forwards than _CALLS_LIMIT since the last step
        self._views: list[torch.Tensor] | None = None  # probed inputs, collected during a replay
        self._warned_replay = False
        if self.attribution:
            self._probes_on()  # the first step: found_inf may never reach the host
        self._acc = torch.float32 if amp.device_type == "mps" else torch.float64  # mps has no float64
        self._flags = _Flags()
        self._loss: torch.Tensor | None = None
        self._stats: tuple[torch.Tensor, list[tuple[str, int]]] | None = None
        self._took_grads = False
        self._still_scaled: list[Any] = []  # this step's fused optimizers, whose gradients stay scaled
        self._pending: list[_Pending] = []
        self._writer: Any = None
        self._seen: tuple[int, int, int] = (0, -1, -1)  # steps seen, the first and last step number (the closing record)
        self.closed = False
        self._fp8_probe: Any = None  # torchao Float8Linear hooks, on only before a recorded step
        self._fp8_now: dict[str, Any] | None = None  # the recorded step's float8 records, for _flush
        self._arm_fp8()  # the first step a monitor sees: its number is learnt at its end
        amp.scaler.observer = self

    def __repr__(self) -> str:
        return f"Monitor({str(self.path)!r}, every={self.every}, attribution={self.attribution}" + (
            ", closed)" if self.closed else ")")

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __deepcopy__(self, memo: dict[int, Any]) -> "Monitor":
        return self  # a deep copy of the model (an EMA twin) keeps feeding this log

    def __getstate__(self) -> None:
        raise TypeError("an ampbridge.torch.Monitor writes a file of this process: close it (monitor.close()) "
                        "before pickling the model")

    def close(self) -> None:
        """Read any steps still on the device, write them, close the file, remove the hooks."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._pending:
                self._flush()
            self._header()
            seen, first, last = self._seen
            self._writer.end(seen, first_step=first if seen else None, last_step=last if seen else None)
        finally:
            for handle in self._order_hooks + self._hooks + self._capture_hooks:
                handle.remove()
            if self._fp8_probe is not None:
                self._fp8_probe.remove()
            self._order_hooks, self._hooks, self._capture_hooks, self._calls = [], [], [], []
            if self._amp.scaler.observer is self:
                self._amp.scaler.observer = None
            if self._writer is not None:
                self._writer.close()

    # --- probes on (every step: found_inf never reaches the host) or off (replay a non-finite step)

    def _probes_on(self) -> None:
        for handle in self._capture_hooks:
            handle.remove()
        self._capture_hooks, self._calls = [], []
        self._hooks = self._install_probes()

    def _probes_off(self) -> None:
        for handle in self._hooks:
            handle.remove()
        root = self._amp.model
        # prepended: the inputs as the caller passed them, before any other hook rewrites them
        self._hooks = []
        self._capture_hooks = [root.register_forward_pre_hook(self._record_call, prepend=True, with_kwargs=True),
                               root.register_forward_hook(self._record_outputs)]

    def _replayable(self) -> bool:
        """False under FSDP: a replayed forward and backward would all-gather and reduce-scatter
        (on every rank, or hang); the probes stay on there."""
        try:
            from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        except ImportError:  # a torch built without distributed
            return True
        return not any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in self._amp.model.modules())

    def _install_probes(self) -> list[Any]:
        handles = []
        for i, p in enumerate(self._probed):
            m = self._modules[p]
            handles.append(m.register_forward_pre_hook(functools.partial(self._check_inputs, i)))
            if i < len(self._candidates) and not getattr(m, "inplace", False):
                handles.append(m.register_forward_pre_hook(functools.partial(self._probe_inputs, i)))
            handles.append(m.register_forward_hook(functools.partial(self._check_output, i)))
        return handles

    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        # host-side copies (no aten op, no device sync: CUDA's is the philox seed and offset)
        if self._amp.device_type == "cpu":
            return torch.random.default_generator.get_state(), None
        device = getattr(torch, self._amp.device_type, None)
        accel = device.get_rng_state() if device is not None and hasattr(device, "get_rng_state") and \
            getattr(device, "is_initialized", lambda: True)() else None
        return torch.random.default_generator.get_state(), accel

    def _set_rng(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.random.default_generator.set_state(state[0])
        if state[1] is not None:
            getattr(torch, self._amp.device_type).set_rng_state(state[1])

    def _record_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # not a replay's own forward, nor a deep copy's (it keeps the hook)
        if not torch.is_grad_enabled() or self._views is not None or module is not self._amp.model:
            return
        if len(self._calls) >= _CALLS_LIMIT:
            self._calls_lost = True
            del self._calls[0]
        device = self._amp.device_type
        self._calls.append(_Call(args, dict(kwargs) if kwargs else _NO_KWARGS, self._rng_state(),
                                 (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)), {}))

    def _record_outputs(self, module: nn.Module, args: Any, out: Any) -> None:
        if not torch.is_grad_enabled() or not self._calls or self._views is not None or module is not self._amp.model:
            return
        grads = self._calls[-1].grads
        # a pre-hook on the node that made the output: what a tensor hook is underneath, at half the
        # host time (this runs on every forward)
        for k, t in enumerate((out,) if type(out) is torch.Tensor else _tensor_leaves(out)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                if t.grad_fn is None:  # a leaf handed back as an output
                    t.register_hook(functools.partial(self._record_output_grad, grads, k))
                else:
                    t.grad_fn.register_prehook(functools.partial(self._record_node_grad, grads, k, t.output_nr))

    @staticmethod
    def _record_output_grad(grads: dict[int, torch.Tensor], k: int, grad: torch.Tensor) -> None:
        grads[k] = grad

    @staticmethod
    def _record_node_grad(grads: dict[int, torch.Tensor], k: int, index: int, node_grads: tuple[Any, ...]) -> None:
        if node_grads[index] is not None:
            grads[k] = node_grads[index]

    def _replay(self, calls: list[_Call]) -> _Flags:
        """The probes' flags of a skipped step, by running its forwards (and backwards from the
        recorded output gradients) again; parameters, ``.grad``, buffers and RNG as before."""
        flags = self._flags = _Flags()
        model = self._amp.model
        views: list[torch.Tensor] = []
        self._views = views
        handles = self._install_probes()
        rng_now = self._rng_state()
        buffers = [(m, name, b, b.clone()) for m in model.modules() for name, b in m.named_buffers(recurse=False)]
        try:
            if self._calls_lost:
                raise RuntimeError(f"more than {_CALLS_LIMIT} forwards of the model in one step")
            for call in calls:
                self._set_rng(call.rng)
                enabled, dtype = call.autocast
                with torch.enable_grad(), torch.autocast(self._amp.device_type, dtype=dtype, enabled=enabled):
                    out = model(*call.args, **call.kwargs)
                leaves = _tensor_leaves(out)
                seeds = [(leaves[k], g) for k, g in call.grads.items()
                         if k < len(leaves) and isinstance(leaves[k], torch.Tensor) and leaves[k].requires_grad]
                if seeds and views:  # autograd.grad: nothing accumulates into .grad (nor fires DDP's hooks)
                    torch.autograd.grad([t for t, _ in seeds], views, [g for _, g in seeds], allow_unused=True)
                views.clear()
        except Exception as error:  # attribution falls back to the parameter gradients
            flags = _Flags()
            if not self._warned_replay:
                self._warned_replay = True
                warnings.warn(f"ampbridge monitor: could not replay the non-finite step to find the first "
                              f"non-finite layer ({type(error).__name__}: {error}); first_nonfinite comes from the "
                              f"parameter gradients only", AmpBridgeWarning, stacklevel=2)
        finally:
            for handle in handles:
                handle.remove()
            self._views = None
            self._set_rng(rng_now)
            with torch.no_grad():
                for m, name, b, saved in buffers:
                    b.copy_(saved)
                    if getattr(m, name, None) is not b:  # the forward replaced it: put the original back
                        setattr(m, name, b)
            self._flags = _Flags()
        return flags

    # --- hooks (kept small: they run on every forward and backward)

    def _first_call(self, path: str, module: nn.Module, args: Any) -> None:
        if path not in self._order_seen:
            self._order_seen.add(path)
            self._order.append(path)

    def _probe_inputs(self, index: int, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        # a view per input: its gradient is exactly this call's contribution (torch's full backward
        # hooks do the same with a custom Function, which forbids in-place ops on the module's
        # outputs, as in `out += identity`); the same tensor passed twice stays one tensor
        if not torch.is_grad_enabled():
            return None
        views: dict[int, torch.Tensor] | None = None
        new: list[Any] = []
        for k, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.requires_grad and a.layout is torch.strided and a.is_floating_point():
                if views is None:
                    views, new = {}, list(args)
                v = views.get(id(a))
                if v is None:
                    v = a.view_as(a)
                    v.register_hook(functools.partial(self._check_input_grad, index))
                    views[id(a)] = v
                    if self._views is not None:
                        self._views.append(v)
                new[k] = v
        return tuple(new) if views else None

    def _check_input_grad(self, index: int, grad: torch.Tensor) -> None:
        if grad.numel():
            flags = self._flags
            _extremes(grad, flags.bwd_vals, flags.bwd_who, index)

    def _check_inputs(self, index: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        # the forward inputs' extremes, flagged ~index: a module whose inputs were already non-finite
        # is never the origin (positional tensors only: an additive mask is usually a keyword)
        if not torch.is_grad_enabled():
            return
        flags = self._flags
        with torch.no_grad():
            for t in args:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                    _extremes(t, flags.fwd_vals, flags.fwd_who, ~index)

    def _check_output(self, index: int, module: nn.Module, args: Any, out: Any) -> None:
        if not torch.is_grad_enabled():
            return
        flags = self._flags
        with torch.no_grad():  # a flag, not part of the graph (it would keep the output alive)
            if isinstance(out, torch.Tensor):
                if out.is_floating_point() and out.numel():
                    _extremes(out, flags.fwd_vals, flags.fwd_who, index)
                return
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                    _extremes(t, flags.fwd_vals, flags.fwd_who, index)

    # --- fed by the scaler (the StepObserver interface)

    def on_loss(self, outputs: Any) -> None:
        # a reference (detached only when read: a detach is an aten op on every step)
        self._loss = outputs if isinstance(outputs, torch.Tensor) and outputs.numel() == 1 else None

    def on_grads(self, scale: torch.Tensor | None, step: int) -> None:
        if self._took_grads:  # once per step, before the first unscale
            return
        self._took_grads = True
        if step % self.every == 0:
            self._stats = self._layer_stats(scale)

    def on_kept_scaled(self, optimizer: Any) -> None:
        # the optimizer, not its parameters: they are only looked up on a non-finite step
        self._still_scaled.append(optimizer)

    def _layer_stats(self, scale: torch.Tensor | None, unscaled: bool = False, still_scaled: Sequence[Any] = ()
                     ) -> tuple[torch.Tensor, list[tuple[str, int]]] | None:
        """Per layer on the device: finite count, max |g/S|, sum (g/S)^2, zeros, below the smallest
        subnormal once unscaled (zeros included), zero once unscaled, beyond the compute max (scaled).

        ``unscaled``: the gradients were already divided by ``scale`` (the scaler's in-place
        unscale; exact for a power-of-two scale, and non-finite values stay non-finite), so the
        scaled values are ``g * S``; except the parameters of the optimizers in ``still_scaled``
        (a fused optimizer's check reads its gradients without unscaling them)."""
        from ...core.dtypes import formats

        plan, facts, acc = self._amp.plan, formats(), self._acc
        scaled = {id(p) for opt in still_scaled for group in opt.param_groups for p in group["params"]}
        fallback = facts[self._amp.active_policy.compute_dtype]
        rows, meta = [], []
        for path, params in self._owned:
            grads = [_dense(p.grad) for p in params if p.grad is not None]
            n = sum(g.numel() for g in grads)
            if not n:
                continue
            fmt = facts.get(plan[path].compute_dtype, fallback) if path in plan else fallback
            flat = grads[0].reshape(-1) if len(grads) == 1 else torch.cat([g.reshape(-1) for g in grads])
            a = flat.to(acc, copy=True).abs_()
            zero = (a == 0).sum()
            finite = (a < math.inf).sum()  # a = |g|: false for inf and nan
            a.nan_to_num_(0.0, 0.0, 0.0)
            if unscaled and not any(id(p) in scaled for p in params):
                over = (a * scale.to(acc) > fmt.max).sum() if scale is not None else (a > fmt.max).sum()
            else:
                over = (a > fmt.max).sum()
                if scale is not None:
                    a.div_(scale.to(acc))
            rows.append(torch.stack([finite, a.max(), torch.dot(a, a), zero, (a < fmt.smallest_subnormal).sum(),
                                     (a == 0).sum(), over]).to(acc))
            meta.append((path, n))
        return (torch.stack(rows), meta) if rows else None

    def _arm_fp8(self) -> None:
        """Before a recorded step: hooks on the torchao float8 layers (none on other steps)."""
        from .fp8_stats import CurrentScalingProbe, float8_modules

        torchao, self._fp8_delayed = float8_modules(self._amp.model)
        self._fp8_probe = CurrentScalingProbe(torchao) if torchao else None

    def _take_fp8(self, step: int) -> dict[str, Any] | None:
        """A recorded step's float8 records (torchao's from the hooks, delayed modules' from their
        buffers), the hooks off; and on again if the next step is recorded."""
        from .fp8_stats import delayed_stats

        probe, self._fp8_probe = self._fp8_probe, None
        out = None
        if step % self.every == 0:
            out = probe.take() if probe is not None else {}
            out.update({path: delayed_stats(m) for path, m in getattr(self, "_fp8_delayed", {}).items()})
        elif probe is not None:
            probe.remove()
        if (step + 1) % self.every == 0:
            self._arm_fp8()
        return out or None

    def on_step(self, record: StepRecord) -> None:
        """The scaler's update(), before the scale moves; ``record.known``: found_inf if the host read it."""
        step, found, known, scale, skip = record
        self._fp8_now = None  # zero cost on the other steps: no hook ran, nothing is read
        if self._fp8_probe is not None or step % self.every == 0 or (step + 1) % self.every == 0:
            self._fp8_now = self._take_fp8(step)
        if known is None and skip:  # a fused optimizer skipped on the device
            known = _flag_in_host_memory(found)
        flags, loss, stats, calls, still_scaled, replayable = self._end_of_step(step, known)
        if known is False and stats is None:
            self._calls_lost = False
            return  # the common step: nothing read, nothing written
        if known and self.attribution and replayable:
            flags = self._replay(calls)
        self._calls_lost = False
        if known and stats is None:
            # a non-finite step the host already knows of, its gradients still here (unscaled by
            # now): per-layer statistics on every such step, at no cost to the finite ones
            stats = self._layer_stats(scale, unscaled=True, still_scaled=still_scaled)
        device = scale.device if scale is not None else torch.device(self._amp.device_type)
        norms, param_who = (self._param_extremes(device) if (known is not False and self.attribution) or found is None
                            else (None, []))
        entry = self._step_entry(record._replace(known=known), loss, device, flags, norms, param_who)
        if known is None and stats is None and len(self._pending) < _PENDING_LIMIT:
            if self._pending:  # a static graph calls the same modules each step: keep one list
                last = self._pending[-1]
                entry = entry._replace(fwd_who=last.fwd_who if last.fwd_who == entry.fwd_who else entry.fwd_who,
                                       bwd_who=last.bwd_who if last.bwd_who == entry.bwd_who else entry.bwd_who)
            self._pending.append(entry)
            return
        self._flush(entry, known, stats)

    def _end_of_step(self, step: int, known: bool | None) -> tuple[Any, ...]:
        """Take this step's collected state (leaving a fresh one), count the step, and turn the
        probes on where the host will not learn found_inf (off where a replay can find the layer)."""
        self._took_grads = False
        still_scaled, self._still_scaled = self._still_scaled, []
        self._seen = (self._seen[0] + 1, step if not self._seen[0] else self._seen[1], step)
        if self._order_hooks:  # the first forward showed the order
            for handle in self._order_hooks:
                handle.remove()
            self._order_hooks = []
        flags, self._flags = self._flags, _Flags()
        loss, self._loss = self._loss, None
        stats, self._stats = self._stats, None
        calls, self._calls = self._calls, []
        replayable = bool(self._capture_hooks)
        if self.attribution:
            if known is None and not self._hooks:
                self._probes_on()
            elif known is not None and self._hooks and self._replayable():
                self._probes_off()
        return flags, loss, stats, calls, still_scaled, replayable

    def _param_extremes(self, device: torch.device) -> tuple[torch.Tensor | None, list[int]]:
        """Each gradient's extremes on the device (non-finite iff the gradient is), and whose they are."""
        grads = [(i, _dense(p.grad)) for i, p in self._grad_params if p.grad is not None and p.grad.numel()]
        if not grads:
            return None, []
        if device.type == "cuda":  # one multi-tensor kernel
            norms = torch.stack(torch._foreach_norm([g for _, g in grads], math.inf)).to(self._acc)
            return norms, [i for i, _ in grads if i >= 0]
        values: list[torch.Tensor] = []  # elsewhere torch loops anyway, and aminmax is the cheap reduction
        who: list[int] = []
        for i, g in grads:
            _extremes(g, values, who, i)
        return torch.stack(values).to(self._acc), [i for i in who if i >= 0]

    def _step_entry(self, record: StepRecord, loss: torch.Tensor | None, device: torch.device, flags: _Flags,
                    norms: torch.Tensor | None, param_who: list[int]) -> _Pending:
        """The step's device values, read later as one vector (the host tells non-finite maxima apart)."""
        step, found, known, scale, skip = record
        acc = self._acc
        if loss is not None:
            loss = loss.detach()
        # found: the scaler's flag (> 0), or without one whether any gradient's extreme is non-finite
        # (nan and inf propagate into min/max; a sum of the extremes would overflow float32, mps's
        # accumulator, on large finite gradients)
        if found is None:
            found = ((~torch.isfinite(norms)).any() if norms is not None
                     else torch.zeros((), dtype=torch.bool, device=device))
        parts = [torch.stack([found.to(device, acc).reshape(()),
                              loss.to(device, acc).reshape(()) if loss is not None else
                              torch.full((), math.nan, dtype=acc, device=device),
                              scale.to(acc).reshape(()) if scale is not None else
                              torch.ones((), dtype=acc, device=device)])]
        fwd_who: list[int] = []
        bwd_who: list[int] = []
        if self.attribution and known is not False:
            if flags.fwd_vals:
                parts.append(torch.stack(flags.fwd_vals).to(acc))
                fwd_who = flags.fwd_who
            if flags.bwd_vals:
                parts.append(torch.stack(flags.bwd_vals).to(acc))
                bwd_who = flags.bwd_who
            if param_who:
                assert norms is not None
                parts.append(norms[:len(param_who)])  # the candidates' own parameters come first
        return _Pending(step, skip, torch.cat(parts), fwd_who, bwd_who, param_who)

    def _flush(self, now: _Pending | None = None, known: bool | None = None,
               stats: tuple[torch.Tensor, list[tuple[str, int]]] | None = None) -> None:
        """One transfer: every pending step, and this one with its statistics."""
        entries = self._pending + ([now] if now is not None else [])
        self._pending = []
        blocks = [e.values for e in entries] + ([stats[0].reshape(-1)] if stats is not None else [])
        host = _to_host(torch.cat(blocks))
        self._header()
        offset = 0
        for e in entries:
            count = e.values.numel()
            values, offset = host[offset:offset + count], offset + count
            if e is now and known is not None:
                found = known
            else:
                found = values[0] > 0
            layers = self._decode_stats(host[offset:], stats[1]) if e is now and stats is not None else None
            if not found and layers is None:
                continue  # a finite step that only waited to be read
            loss = values[1] if math.isfinite(values[1]) else None
            first = self._origin(values[3:], e, loss is not None) if found and self.attribution else None
            fp8 = self._fp8_now if e is now and layers is not None else None
            self._writer.step(e.step, loss=loss, loss_scale=values[2], found_inf=found, skipped=found and e.skip,
                              layers=layers or {}, first_nonfinite=first, fp8=fp8)

    def _decode_stats(self, values: list[float], meta: list[tuple[str, int]]) -> dict[str, dict[str, float]]:
        out = {}
        for k, (path, n) in enumerate(meta):
            finite, max_abs, sumsq, zero, below, zero_unscaled, over = values[7 * k:7 * k + 7]
            nonfinite = n - finite
            out[path] = {
                "grad_max_abs": max_abs if finite else float("nan"),
                "grad_rms": math.sqrt(sumsq / finite) if finite else float("nan"),
                "zero": zero / n,
                "nonfinite": nonfinite / n,
                # zero once unscaled = zero, non-finite (set to 0) or flushed by the division
                "underflow": (below - zero_unscaled) / n,
                "overflow": over / n,
            }
        return out

    def _origin(self, maxima: list[float], e: _Pending, finite_loss: bool) -> dict[str, str]:
        bad = [not math.isfinite(x) for x in maxima]
        nf, nb = len(e.fwd_who), len(e.bwd_who)
        for k in range(nf):
            if bad[k]:
                return self._forward_origin(e.fwd_who[k])
        if not finite_loss:  # the loss comes after every layer's output and before every gradient
            return {"path": "", "where": "loss"}
        for k in range(nb):
            if bad[nf + k]:
                return {"path": self._candidates[e.bwd_who[k]], "where": "gradient"}
        # a parameter gradient overflowed while no input gradient did: the first such layer in
        # backward order (the one called last in the forward)
        last_call = {i: k for k, i in enumerate(e.fwd_who) if i >= 0}
        if not last_call:  # no forward flags (a step that could not be replayed): the first forward's order
            first = {p: k for k, p in enumerate(self._order)}
            last_call = {i: first.get(p, -1) for i, p in enumerate(self._candidates)}
        hit = {e.param_who[k] for k in range(len(e.param_who)) if bad[nf + nb + k]}
        if hit:
            return {"path": self._candidates[max(hit, key=lambda i: last_call.get(i, -1))], "where": "gradient"}
        return {"path": "", "where": "unreproduced"}  # the replay found nothing non-finite

    def _forward_origin(self, who: int) -> dict[str, str]:
        """The first non-finite forward value (in call order): a module's output (its inputs were
        finite: they were checked before it ran), or a module's inputs, made non-finite by the
        code of the innermost probed container around it (the model's own code or its inputs: the root)."""
        if who >= 0:
            return {"path": self._probed[who], "where": "output"}
        path = self._probed[~who]
        while "." in path:
            path = path.rsplit(".", 1)[0]
            if path in self._modules:
                return {"path": path, "where": "output"}
        return {"path": "", "where": "input"}

    def _header(self) -> None:
        if self._writer is not None:
            return
        from ...core.io import policy_to_dict
        from ...diagnostics.runlog import RunLogWriter

        policy = self._amp.active_policy
        self._writer = RunLogWriter(self.path, framework="torch", compute_dtype=policy.compute_dtype,
                                    layers=self._forward_order(), policy=policy_to_dict(policy),
                                    min_scale=self._amp.scaler.config.min_scale,
                                    extra={"every": self.every, "attribution": self.attribution,
                                           # what the policy already pins: report's advice never repeats it
                                           "pinned": {r.path: r.rule for r in self._amp.plan.rows
                                                      if r.path and r.rule != "default"
                                                      and r.compute_dtype == "float32" != policy.compute_dtype}})

    def _forward_order(self) -> list[str]:
        """The Plan's paths in the order the first forward called them; modules it did not call
        (MultiheadAttention's out_proj) right after their parent's subtree."""
        paths = [r.path for r in self._amp.plan.rows if r.path]
        known = set(paths)
        order = [p for p in self._order if p in known]
        placed = set(order)
        for p in paths:
            if p in placed:
                continue
            parent = p.rsplit(".", 1)[0] if "." in p else ""
            at = max((j for j, q in enumerate(order) if not parent or q == parent or q.startswith(parent + ".")),
                     default=len(order) - 1)
            order.insert(at + 1, p)
            placed.add(p)
        return order

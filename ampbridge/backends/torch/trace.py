"""What one forward really computed in: the dtypes observed per module (a dispatch mode and
module hooks) written onto the Plan's rows (``trace(model, policy, *inputs)``, ``amp.trace``).

"""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...core.plan import NO_OP, Plan, idle_rules, join_notes, not_run, with_note
from ...core.policy import Policy
from ...errors import AmpBridgeWarning
from ..common import environment, room_above
from .environment import device_type_of
from .forward import installed
from .plan import realise_plan
from .environment import DTYPE_NAMES, DTYPES

_COMPUTE_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_trilinear", "native_layer_norm",
                "native_group_norm", "native_batch_norm", "_native_batch_norm_legit", "_softmax", "_log_softmax",
                "embedding", "_embedding_bag", "mkldnn_rnn_layer", "_fused_rms_norm", "gelu",
                "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_flash_attention", "_cudnn_rnn", "cudnn_batch_norm", "_prelu_kernel",
                # MoE experts (transformers' Mixtral, Qwen2-MoE): no autocast rule on CPU casts them
                "_grouped_mm", "grouped_mm", "_native_multi_head_attention")
_IGNORED_OPS = ("_to_copy", "copy_", "detach", "empty", "zeros", "ones", "full", "empty_like", "zeros_like",
                "arange", "lift_fresh")


def trace(model: nn.Module, policy: Policy | str | Path, *example_inputs: Any, warn: bool = True,
          device_type: str | None = None, **example_kwargs: Any) -> Plan:
    """The Plan with each row's dtypes as one forward on the example inputs ran them (on an applied
    copy, without gradients; the model itself is untouched).

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Softmax(-1))
        >>> trace(m, "mixed_bfloat16", torch.ones(1, 2))["1"].compute_dtype
        'bfloat16'
    """
    apply = room_above(__package__, "apply")  # its TorchAmp runs the forward

    if not example_inputs and not example_kwargs:
        raise TypeError("trace(model, policy, *example_inputs) needs example inputs; plan(model, policy) is "
                        "the static Plan")
    if isinstance(model, torch.jit.ScriptModule) or installed(model) is not None:
        raise apply.ModelNotSupportedError("trace(model, policy, *example_inputs) traces an eager, un-applied model; "
                                     "for an applied one call amp.trace(*example_inputs)")
    policy, env_notes = environment(policy, "torch", warn=False)  # what apply would run
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpBridgeWarning)
        apply._check_model(twin)
        amp = apply.TorchAmp(twin, policy, device_type_of(twin, device_type), notes=env_notes)
    # the unmatched-rule warnings belong to the caller, once
    realise_plan(model, amp.active_policy, amp.device_type, warn=warn)
    return trace_forward(amp, example_inputs, example_kwargs)


class _Recording:
    """What one forward of ``amp.model`` computed, per module path: the dtypes of its main ops, the
    region (autocast dtype) its children saw, its last floating op, what it returned, whether it ran."""

    def __init__(self, amp: Any) -> None:
        self.amp = amp
        self.paths = {id(m): p for p, m in amp.model.named_modules()}
        self.stack: list[str] = []
        self.main: dict[str, list[str]] = defaultdict(list)  # path -> dtypes of its main ops
        self.ops: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))  # path -> op -> dtypes
        self.acted: set[str] = set()  # paths during whose forward (theirs or their children's) a floating op ran
        self.last: dict[str, str] = {}  # path -> dtype of its last floating op
        self.regions: dict[str, str] = {}  # path -> region seen by its children
        self.delivered: dict[str, str] = {}  # path -> dtype of its (first floating) output
        self.ran: set[str] = set()

    def _region_now(self) -> str:
        device = self.amp.device_type
        if torch.is_autocast_enabled(device):
            return DTYPE_NAMES.get(torch.get_autocast_dtype(device), "float32")
        return "float32"

    def pre(self, module: nn.Module, _args: Any) -> None:
        path = self.paths.get(id(module))
        if path is None:
            return
        if self.stack:
            self.regions.setdefault(self.stack[-1], self._region_now())
        self.stack.append(path)
        self.ran.add(path)

    def post(self, module: nn.Module, _args: Any, out: Any) -> None:
        path = self.paths.get(id(module))
        if path is not None and self.stack:
            self.stack.pop()
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(first, torch.Tensor) and first.is_floating_point() and first.dtype in DTYPE_NAMES:
                self.delivered.setdefault(path, DTYPE_NAMES[first.dtype])

    def op(self, name: str, out: Any) -> None:
        if not self.stack or name in _IGNORED_OPS:
            return
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor) and first.is_floating_point():
            dtype = DTYPE_NAMES.get(first.dtype, str(first.dtype).replace("torch.", ""))
            self.last[self.stack[-1]] = dtype
            self.acted.update(self.stack)
            if name in _COMPUTE_OPS:
                self.main[self.stack[-1]].append(dtype)
                self.ops[self.stack[-1]][name].add(dtype)

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """One forward without gradients; the model's buffers and the RNG as they were before."""
        from torch.utils._python_dispatch import TorchDispatchMode

        recording = self

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                recording.op(func.overloadpacket.__name__, out)
                return out

        amp, model = self.amp, self.amp.model
        saved = {n: b.detach().clone() for n, b in model.named_buffers()}
        hooks = [nn.modules.module.register_module_forward_pre_hook(self.pre),
                 nn.modules.module.register_module_forward_hook(self.post, always_call=True)]
        rng_devices = [] if amp.device_type == "cpu" else None  # None: every device of that type
        rng_type = "cuda" if amp.device_type == "cpu" else amp.device_type
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=rng_devices, device_type=rng_type), Recorder():
                model(*args, **kwargs)
        finally:
            for h in hooks:
                h.remove()
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(saved[n])

    def observed(self, path: str) -> str | None:
        """The dtype the module at ``path`` computed in (``a+b`` where its main ops ran in several)."""
        if path in self.regions and not self.main.get(path):
            return self.regions[path]
        if self.main.get(path):
            dtypes = set(self.main[path])
            return self.main[path][0] if len(dtypes) == 1 else "+".join(sorted(dtypes))
        return self.last.get(path)


def _traced_row(row: Any, rec: _Recording, realisation: Any) -> Any:
    """``row`` as the recorded forward ran it: its compute dtype, what it returned, a note saying so."""
    path = row.path
    if path not in rec.ran:
        return row if path in realisation.bypassed else not_run(row)  # its parent uses it
    if path not in rec.acted:  # an eval-mode Dropout returns its input: nothing was observed
        return with_note(row, join_notes(row.note, NO_OP))
    row = _other_ops(row, rec.ops.get(path, {}))
    observed = rec.observed(path)
    follows = path in realisation.input_following
    # what the module returned (a container carrying a promoted stream: its last op's dtype)
    delivered = rec.delivered
    returned = delivered.get(path) if delivered.get(path, row.output_dtype) != row.output_dtype else None
    if (observed is None or (observed == row.compute_dtype and not follows)) and returned is None:
        return row
    changes: dict[str, Any] = {}
    if observed in DTYPES and observed != row.compute_dtype:
        changes["compute_dtype"] = observed
    if path in delivered and (follows or returned):  # mixed compute ("float16+float32"): one output dtype
        changes["output_dtype"] = delivered[path]
    reason = row.note.split(" (")[0] if follows and row.note else row.note
    said = [f"ran in {observed}"] if observed is not None and (observed != row.compute_dtype or follows) else []
    said += [f"returned {returned}"] if returned and not follows else []
    return with_note(row, join_notes(reason, "traced: " + ", ".join(said)) if said else reason, **changes)


def trace_forward(amp: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
    """The Plan of one observed forward of the applied model (``TorchAmp.trace`` and :func:`trace`)."""
    # amp: the TorchAmp (whose trace() calls this; apply imports this room, not the other way)
    rec = _Recording(amp)
    rec.run(args, kwargs)
    rows = [_traced_row(row, rec, amp.realisation) for row in amp.plan.rows]
    traced = Plan(tuple(rows), amp.plan.policy, "torch", amp.plan.unmatched_rules,
                  amp.plan.notes + ("traced: compute dtypes observed in one forward",))
    idle = idle_rules(traced, rec.ran)
    return replace(traced, notes=traced.notes + tuple(idle)) if idle else traced


def _other_ops(row: Any, ops: dict[str, set[str]]) -> Any:
    """The row with ``other_ops`` set where some of its main ops ran in a dtype that is not the one
    the row computes in (after the trace) while others ran in it (a mixed row keeps its compute)."""
    if not ops:
        return row
    dtypes = {d for seen in ops.values() for d in seen}
    if len(dtypes) < 2:  # one dtype: the row's compute column says it (the trace replaces it)
        return row
    other = tuple(sorted(f"{op} {d}" for op, seen in ops.items() for d in seen if d != row.compute_dtype))
    return replace(row, other_ops=other) if other else row


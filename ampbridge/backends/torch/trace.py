"""What one forward really computed in: the dtypes observed per module (a dispatch mode and
module hooks) written onto the Plan's rows (``trace(model, policy, *inputs)``, ``amp.trace``).

Holds ``trace`` and ``_trace``.
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
from .environment import _device_type_of
from .forward import _installed
from .plan import _realise
from .environment import _NAMES, DTYPES

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
    if isinstance(model, torch.jit.ScriptModule) or _installed(model) is not None:
        raise apply.ModelNotSupportedError("trace(model, policy, *example_inputs) traces an eager, un-applied model; "
                                     "for an applied one call amp.trace(*example_inputs)")
    policy, env_notes = environment(policy, "torch", warn=False)  # what apply would run
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpBridgeWarning)
        apply._check_model(twin)
        amp = apply.TorchAmp(twin, policy, _device_type_of(twin, device_type), notes=env_notes)
    # the unmatched-rule warnings belong to the caller, once
    _realise(model, amp.active_policy, amp.device_type, warn=warn)
    return _trace(amp, example_inputs, example_kwargs)


def _trace(amp: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
    # amp: the TorchAmp (whose trace() calls this; apply imports this room, not the other way)
    from torch.utils._python_dispatch import TorchDispatchMode

    model = amp.model
    paths = {id(m): p for p, m in model.named_modules()}
    stack: list[str] = []
    main: dict[str, list[str]] = defaultdict(list)  # path -> dtypes of its main ops
    ops: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))  # path -> main op -> dtypes
    acted: set[str] = set()  # paths during whose forward (theirs or their children's) a floating op ran
    last: dict[str, str] = {}  # path -> dtype of its last floating op
    regions: dict[str, str] = {}  # path -> region seen by its children
    delivered: dict[str, str] = {}  # path -> dtype of its (first floating) output
    ran: set[str] = set()

    def region_now() -> str:
        if torch.is_autocast_enabled(amp.device_type):
            return _NAMES.get(torch.get_autocast_dtype(amp.device_type), "float32")
        return "float32"

    def pre(module: nn.Module, _args: Any) -> None:
        path = paths.get(id(module))
        if path is None:
            return
        if stack:
            regions.setdefault(stack[-1], region_now())
        stack.append(path)
        ran.add(path)

    def post(module: nn.Module, _args: Any, out: Any) -> None:
        path = paths.get(id(module))
        if path is not None and stack:
            stack.pop()
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            if isinstance(first, torch.Tensor) and first.is_floating_point() and first.dtype in _NAMES:
                delivered.setdefault(path, _NAMES[first.dtype])

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if stack and name not in _IGNORED_OPS:
                first = out[0] if isinstance(out, (tuple, list)) and out else out
                if isinstance(first, torch.Tensor) and first.is_floating_point():
                    dtype = _NAMES.get(first.dtype, str(first.dtype).replace("torch.", ""))
                    last[stack[-1]] = dtype
                    acted.update(stack)
                    if name in _COMPUTE_OPS:
                        main[stack[-1]].append(dtype)
                        ops[stack[-1]][name].add(dtype)
            return out

    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    hooks = [nn.modules.module.register_module_forward_pre_hook(pre),
             nn.modules.module.register_module_forward_hook(post, always_call=True)]
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
    rows = []
    for row in amp.plan.rows:
        path = row.path
        if path not in ran:
            rows.append(row if path in amp._realisation.bypassed else not_run(row))  # its parent uses it
            continue
        if path not in acted:  # an eval-mode Dropout returns its input: nothing was observed
            rows.append(with_note(row, join_notes(row.note, NO_OP)))
            continue
        row = _other_ops(row, ops.get(path, {}))
        if path in regions and not main.get(path):
            observed = regions[path]
        elif main.get(path):
            observed = main[path][0] if len(set(main[path])) == 1 else "+".join(sorted(set(main[path])))
        else:
            observed = last.get(path)
        follows = path in amp._realisation.input_following
        # what the module returned (a container carrying a promoted stream: its last op's dtype)
        returned = delivered.get(path) if delivered.get(path, row.output_dtype) != row.output_dtype else None
        if (observed is None or (observed == row.compute_dtype and not follows)) and returned is None:
            rows.append(row)
            continue
        changes: dict[str, Any] = {}
        if observed in DTYPES and observed != row.compute_dtype:
            changes["compute_dtype"] = observed
        if path in delivered and (follows or returned):  # mixed compute ("float16+float32"): one output dtype
            changes["output_dtype"] = delivered[path]
        reason = row.note.split(" (")[0] if follows and row.note else row.note
        said = [f"ran in {observed}"] if observed is not None and (observed != row.compute_dtype or follows) else []
        said += [f"returned {returned}"] if returned and not follows else []
        rows.append(with_note(row, join_notes(reason, "traced: " + ", ".join(said)) if said else reason, **changes))
    traced = Plan(tuple(rows), amp.plan.policy, "torch", amp.plan.unmatched_rules,
                  amp.plan.notes + ("traced: compute dtypes observed in one forward",))
    idle = idle_rules(traced, ran)
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


"""The Plan: the core's rows, corrected by what torch autocast really does with each module on
the device, and the specs that make the rows true.

Holds ``plan`` (the contract's verb: static, traced by ``trace`` when example inputs are given),
``Realisation`` and ``realise_plan``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...core.plan import BY_MODEL, Layer, Plan, PlanRow, build_plan, join_notes, stream_notes, with_note
from ...core.policy import Policy
from ..common import environment, room_above
from ...errors import AmpBridgeError, UnsupportedOptionError
from .environment import (LOW_DTYPES, DTYPE_NAMES, DTYPES, device_type_of, resolve_for_device, cpu_lstm_runs,
                          cpu_lstm_takes_float32_inputs)
from .forward import ForwardSpec
from . import fp8
from .layers import class_name, module_entries, Kept, kept_in_float32, layers

# --- what autocast does with each module, per device ---------------------------------------------
#
# "cast": autocast runs its main ops (matmul, conv) in the region's dtype;
# "float32": autocast runs it in float32 whatever the region (the op is on autocast's fp32 list);
# "input": autocast leaves its ops alone: it runs in its input's dtype;
# "weights": an embedding lookup: it runs in its weights' dtype;
# "region": a container: its children decide; "custom": a leaf with parameters ampbridge does not know.
# CPU: observed (tests/backend_torch/test_plan.py re-checks every class). CUDA: torch's autocast op
# reference (layer_norm, group_norm, rms_norm, softmax, log_softmax, pow are on its fp32 list), the
# dispatcher's AutocastCUDA registrations (checked by the same test), cudnn's RNN autocast wrapper.

def _behaviour(module: nn.Module, device_type: str) -> str:
    from torch.nn.modules.batchnorm import _NormBase
    from torch.nn.modules.conv import _ConvNd

    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "weights"
    cast: tuple[type, ...] = (nn.Linear, _ConvNd, nn.MultiheadAttention, nn.RNNBase, nn.RNNCellBase, nn.PReLU)
    if device_type == "cpu":
        if isinstance(module, cast):
            return "cast"
        if isinstance(module, (_NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm,
                               nn.CrossMapLRN2d, nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d,
                               nn.Bilinear)):
            return "input"
    else:
        if isinstance(module, cast + (nn.Bilinear,)):
            return "cast"
        if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm, nn.CrossMapLRN2d,
                               nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d)):
            return "float32"
        if isinstance(module, _NormBase):
            return "input"
    if next(module.children(), None) is not None:
        return "region"
    if next(module.parameters(recurse=False), None) is not None:
        return "custom"
    return "input"


def bypassed_modules(model: nn.Module) -> dict[str, str]:
    """Modules whose forward their parent never calls (it uses their parameters directly)."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            for name, _ in module.named_modules():
                if name:
                    out[f"{path}.{name}" if path else name] = path
    return out


#: the compute dtypes under which transformers keeps a module in float32 (``_get_dtype_plan``)
_KEPT_UNDER = {False: ("float16",), True: ("float16", "bfloat16")}


def _author_layers(model: nn.Module, policy: Policy) -> tuple[list[Layer], dict[str, Kept], list[str]]:
    """The model's layers, those its author keeps in float32 marked ``fixed`` (the Plan's ``set by
    the model``), as transformers would: ``_keep_in_fp32_modules`` where the module would otherwise
    compute in float16, ``_keep_in_fp32_modules_strict`` in float16 or bfloat16 (the compute dtype
    its row has without the author's choice stands for ``from_pretrained``'s ``dtype``)."""
    described = layers(model)
    kept, notes = kept_in_float32(model)
    if not kept:
        return described, kept, notes
    without = build_plan(described, policy, framework="torch", warn=False)
    described = [replace(layer, fixed=("float32", "float32"))
                 if layer.path in kept and without[layer.path].compute_dtype in _KEPT_UNDER[kept[layer.path].strict]
                 else layer for layer in described]
    return described, kept, notes


def _code_caller(path: str, modules: Mapping[str, nn.Module]) -> str | None:
    """The path of the module whose own ``forward`` calls the one at ``path``, or None where an
    ``nn.Sequential`` feeds it (the next module casts its inputs itself, as autocast or ampbridge's
    input cast does). ``nn.ModuleList``/``nn.ModuleDict`` have no forward: their owner calls.

    Example:
        >>> m = nn.Module(); m.blocks = nn.ModuleList([nn.Sequential(nn.Linear(2, 2))])
        >>> modules = dict(m.named_modules())
        >>> _code_caller("blocks.0", modules), _code_caller("blocks.0.0", modules)
        ('', None)
    """
    while path:
        path = path.rsplit(".", 1)[0] if "." in path else ""
        parent = modules.get(path)
        if isinstance(parent, nn.Sequential):
            return None
        if not isinstance(parent, (nn.ModuleList, nn.ModuleDict)):
            return path
    return None


def _widest(names: Iterable[str]) -> str:
    names = set(names)
    if len(names) == 1:
        return names.pop()
    return "float32"  # float16 and bfloat16 do not contain each other


# --- planning ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Realisation:
    """The Plan of one (phase) policy, and how each module is run to make it true."""

    plan: Plan
    policy: Policy
    specs: Mapping[str, ForwardSpec]  # path ("" = the root) -> spec
    storage: Mapping[int, tuple[nn.Parameter, torch.dtype]] = field(default_factory=dict)
    input_following: frozenset[str] = frozenset()  # rows whose dtype follows their input
    promoted: frozenset[str] = frozenset()  # rows whose own code promotes the stream (output not cast)
    bypassed: frozenset[str] = frozenset()  # rows whose forward their parent never calls (it uses their parameters)


def realise_plan(model: nn.Module, policy: Policy, device_type: str, *, warn: bool = True,
             notes: Sequence[str] = ()) -> Realisation:
    entries = module_entries(model)
    modules = dict(entries)
    described, kept, kept_notes = _author_layers(model, policy)
    raw = build_plan(described, policy, framework="torch", warn=warn)
    rules = dict(policy.rules)
    bypassed = bypassed_modules(model)
    # rows whose output meets their caller's stream of another dtype: the same rule in every backend.
    # The caller's output is not cast (hand-written autocast casts nothing at a module's boundary):
    # torch promotes the stream and carries it on, so the caller's output follows the data flow
    streams = stream_notes(policy, lambda path: _code_caller(path, modules))
    storage = _storage(raw, modules)
    grouped = _grouped_experts(modules, storage)  # MoE experts computing in their weights' dtype
    stream_of = {row.path: streams(_as_grouped(row, grouped, modules, device_type)) for row in raw.rows}
    widened: dict[str, set[str]] = defaultdict(set)  # caller -> the pinned output dtypes meeting its stream
    for row in raw.rows:
        if stream_of[row.path]:
            widened[_code_caller(row.path, modules) or ""].add(grouped.get(row.path, row.output_dtype))

    walk = _Walk(policy, device_type, raw, modules, storage, bypassed, stream_of, widened,
                 kept, _low_below(raw))
    final = _grouped_rows([_realise_row(walk, row) for row in raw.rows], grouped, walk.input_following)
    input_following, specs, storage = walk.input_following, walk.specs, walk.storage
    final = _sequential_outputs(final, modules, rules, input_following)
    plan_notes = _plan_notes(policy, list(notes) + kept_notes, input_following)
    out = Plan(tuple(final), policy, "torch", raw.unmatched_rules, tuple(plan_notes))
    return Realisation(out, policy, specs, storage, frozenset(input_following),
                        frozenset(p for p in widened if p and p in modules), frozenset(bypassed))


def _grouped_experts(modules: Mapping[str, nn.Module], storage: Mapping[int, tuple[nn.Parameter, torch.dtype]]
                     ) -> dict[str, str]:
    """MoE experts that transformers runs through ``grouped_mm`` (Mixtral, Qwen2-MoE...), by path ->
    the dtype they compute in: their weights'. ``torch._grouped_mm`` has no autocast rule (CPU or CUDA),
    and transformers casts the experts' input to the weights' dtype before it, so under autocast
    they compute in float32 where their weights are stored in float32."""
    out = {}
    for path, module in modules.items():
        config = getattr(module, "config", None)
        if not hasattr(module, "is_concatenated") or getattr(config, "_experts_implementation", None) != "grouped_mm":
            continue  # "eager" and "batched_mm" run F.linear / bmm, which autocast casts
        stored = {DTYPE_NAMES[storage[id(p)][1]] for p in module.parameters(recurse=False) if id(p) in storage}
        if len(stored) == 1:
            out[path] = stored.pop()
    return out


def _as_grouped(row: PlanRow, grouped: Mapping[str, str], modules: Mapping[str, nn.Module], device_type: str
                ) -> PlanRow:
    """The row with the dtype grouped-mm experts compute in, for them and for the modules inside
    them that follow their input (what their callers' streams meet)."""
    experts = next((p for p in grouped if row.path == p or row.path.startswith(p + ".")), None)
    if experts is None or (row.path != experts and _behaviour(modules[row.path], device_type) != "input"):
        return row
    return replace(row, compute_dtype=grouped[experts], output_dtype=grouped[experts])


#: the note of a row of grouped-mm MoE experts, and of the input-following modules inside them
_GROUPED = ("transformers runs these experts through grouped_mm, which autocast does not cast: their input is cast "
            "to the weights' dtype, so they compute in {dtype}")
_GROUPED_INSIDE = "fed by {experts}'s grouped_mm output ({dtype})"


def _grouped_rows(rows: list[PlanRow], grouped: Mapping[str, str], following: set[str]) -> list[PlanRow]:
    """The rows of grouped-mm experts compute and emit in their weights' dtype (the parameter share
    counts them so); the modules inside them that follow their input (the activation) too."""
    if not grouped:
        return rows
    out = []
    for row in rows:
        experts = next((p for p in grouped if row.path == p or row.path.startswith(p + ".")), None)
        dtype = grouped.get(experts) if experts is not None else None
        if dtype is None or (row.path != experts and row.path not in following) or (
                row.compute_dtype, row.output_dtype) == (dtype, dtype):
            out.append(row)
            continue
        note = _GROUPED.format(dtype=dtype) if row.path == experts else _GROUPED_INSIDE.format(
            experts=experts.rsplit(".", 1)[-1], dtype=dtype)
        reason = row.note.split(" (")[0] if row.path != experts and row.note else row.note
        out.append(with_note(row, join_notes(reason, note), compute_dtype=dtype, output_dtype=dtype))
    return out


@dataclass
class _Walk:
    """What the walk over the Plan's rows reads (the model's modules, the raw Plan, the facts found
    before it) and what it collects (each module's spec, each region's root, the rows that follow
    their input's dtype)."""

    policy: Policy
    device_type: str
    raw: Plan
    modules: Mapping[str, nn.Module]
    storage: Mapping[int, tuple[nn.Parameter, torch.dtype]]
    bypassed: Mapping[str, str]
    stream_of: Mapping[str, str | None]
    widened: Mapping[str, set[str]]
    kept: Mapping[str, Kept]
    low_below: set[str]
    specs: dict[str, ForwardSpec] = field(default_factory=dict)
    region_root: dict[str, str] = field(default_factory=dict)
    input_following: set[str] = field(default_factory=set)


def _low_below(raw: Plan) -> set[str]:
    """Every path with a row at or below it that computes or emits in a lower precision.

    Regions: a module whose compute dtype differs from its parent's region runs its own. Without
    autocast (a float32 region) torch cannot mix dtypes, so where a lower-precision rule sits inside
    one, the region's leaves get their floating inputs cast to float32.
    """
    low_below: set[str] = set()
    for row in raw.rows:
        if row.output_dtype != "float32" or row.compute_dtype != "float32":
            parts = row.path.split(".")
            low_below.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    return low_below


def _bypassed_row(walk: _Walk, row: PlanRow) -> PlanRow:
    """A module whose parameters its parent's own forward uses (it is never called): the parent's dtype."""
    owner = walk.bypassed[row.path]
    parent = walk.raw[owner]
    if row.compute_dtype != parent.compute_dtype:
        raise UnsupportedOptionError(
            f"{row.rule} ({row.pattern}) sets {row.path!r} to compute in {row.compute_dtype}, but "
            f"{class_name(walk.modules[owner])} {owner!r} uses its parameters in its own "
            f"forward (it never calls {row.path!r}); match {owner!r} instead")
    return with_note(row, f"its parameters are used by {owner}'s forward, which "
                          f"runs in {parent.compute_dtype}", output_dtype=parent.compute_dtype)


def _stored_elsewhere(module: nn.Module, row: PlanRow, own_stored: set[Any]) -> tuple[str, str] | None:
    """The dtype the module's parameters are kept in where it is not the row's, and why (None: the row's)."""
    from torch.nn.modules.batchnorm import _NormBase

    stored = {DTYPE_NAMES[d] for d in own_stored}
    if len(stored) != 1 or stored == {row.param_dtype}:
        return None
    name = stored.pop()
    if isinstance(module, _NormBase) and module.track_running_stats:
        return name, (f"parameters kept in {name}: torch's batch_norm needs them in its float32 running "
                      "statistics' dtype")
    return name, f"parameters kept in {name}: shared with another module that needs it"


def _casts(walk: _Walk, row: PlanRow, module: nn.Module, behaviour: str) -> tuple[bool, bool, Any, set[Any]]:
    """How the module at ``row.path`` is entered: whether it opens its own autocast region, whether its
    inputs are cast, the dtype its own parameters are presented in for the call (None: as stored), and
    the dtypes its own parameters are stored in. Records the row's region root in ``walk.region_root``."""
    path, compute, policy = row.path, row.compute_dtype, walk.policy
    is_root = path == ""
    parent_path = path.rsplit(".", 1)[0] if "." in path else ""
    enclosing = policy.compute_dtype if is_root else walk.raw[parent_path].compute_dtype
    own_float = [p for p in module.parameters(recurse=False)
                 if p.is_floating_point() and not isinstance(p, nn.parameter.UninitializedParameter)]
    own_stored = {walk.storage[id(p)][1] for p in own_float if id(p) in walk.storage}
    own_low = any(d in LOW_DTYPES for d in own_stored)
    region_change = compute != enclosing and not is_root
    walk.region_root[path] = path if region_change else walk.region_root.get(parent_path, "")
    mixed_float32 = (compute == "float32" and not region_change and walk.region_root[path] in walk.low_below
                     and next(module.children(), None) is None and behaviour != "weights")
    present_as = None  # own parameters presented in the compute dtype for the call
    if own_low and any(d != DTYPES[compute] for d in own_stored) and (
            compute == "float32" or behaviour not in ("cast", "float32")):
        present_as = DTYPES[compute]
    cast_inputs = region_change or mixed_float32 or (own_low and behaviour in ("input", "custom"))
    if is_root:  # the caller's region is the policy's: a rule on the root changes it
        cast_inputs = compute != policy.compute_dtype or (own_low and behaviour in ("input", "custom"))
    return region_change, cast_inputs, present_as, own_stored


def _realise_row(walk: _Walk, row: PlanRow) -> PlanRow:
    """One row as torch runs it; the module's spec (how it is run) goes into ``walk.specs``."""
    policy, device_type, modules = walk.policy, walk.device_type, walk.modules
    bypassed, stream_of, widened, kept = walk.bypassed, walk.stream_of, walk.widened, walk.kept
    specs, input_following, rules = walk.specs, walk.input_following, dict(policy.rules)
    module = modules[row.path]
    behaviour = _behaviour(module, device_type)
    path = row.path
    stream = stream_of[path]
    if path in bypassed:
        return _bypassed_row(walk, row)
    is_root = path == ""  # its region, input and output casts are the root spec (below)
    compute = row.compute_dtype
    region_change, cast_inputs, present_as, own_stored = _casts(walk, row, module, behaviour)
    rule = rules.get(row.rule)
    explicit_output = rule is not None and rule.output_dtype is not None
    natural, natural_out, note, follows = _natural(row, module, behaviour, device_type, present_as, cast_inputs,
                                                   own_stored)
    # cpu bilinear cannot mix dtypes and autocast leaves it alone: it gets its input's dtype
    follow_params = (device_type == "cpu" and isinstance(module, nn.Bilinear) and not cast_inputs
                     and present_as is None and compute != "float32")
    wrap = region_change or cast_inputs or present_as is not None or follow_params or (
        explicit_output and row.output_dtype != natural_out)
    if is_root:
        wrap = False
        specs[""] = ForwardSpec("", device_type, DTYPES[compute], DTYPES[compute] if cast_inputs else None,
                          DTYPES[policy.output_dtype], present_as, policy.matmul_precision, root=True)
    changes: dict[str, Any] = {}
    notes_here = [n for n in (stream and stream + _TORCH_STREAM.format(caller=_code_caller(path, modules) or "the model"),
                              note) if n]
    if path in widened and not is_root:  # its own code promotes the stream; its output is not cast
        wider = _widest(widened[path] | {compute})
        notes_here.append(_CALLER_NOTE.format(dtype=wider))
        natural_out, follows = wider, True
    if row.rule == BY_MODEL and path in kept:
        notes_here.insert(0, kept[path].declared)
    stored = _stored_elsewhere(module, row, own_stored)
    if stored is not None:
        changes["param_dtype"], note_here = stored
        notes_here.append(note_here)
    if wrap:
        # the output is cast only where a rule asks for an output dtype: a pinned module emits what
        # it computes, as under autocast(enabled=False) by hand
        specs[path] = ForwardSpec(path, device_type, DTYPES[compute] if region_change else None,
                            DTYPES[compute] if cast_inputs else None,
                            DTYPES[row.output_dtype] if explicit_output and not follows else None, present_as,
                            params_follow_input=follow_params)
    if natural != compute and behaviour != "region":
        changes["compute_dtype"] = natural
    if natural_out != row.output_dtype and not explicit_output and (behaviour != "region" or follows):
        changes["output_dtype"] = natural_out
    if follows:
        input_following.add(path)
    if is_root:  # the model's outputs: the policy's output_dtype, whatever a rule says
        changes["output_dtype"] = policy.output_dtype
        if policy.output_dtype != changes.get("compute_dtype", compute):
            notes_here.append(f"model outputs cast to output_dtype {policy.output_dtype}")
    return with_note(row, "; ".join(notes_here) or None, **changes) if notes_here or changes else row



def _storage(raw: Plan, modules: Mapping[str, nn.Module]) -> dict[int, tuple[nn.Parameter, torch.dtype]]:
    """Each parameter in the dtype its module's row asks for (the widest, if shared), by ``id``."""
    requests: dict[int, list[tuple[str, str]]] = defaultdict(list)
    params: dict[int, nn.Parameter] = {}
    from torch.nn.modules.batchnorm import _NormBase

    for row in raw.rows:
        module = modules[row.path]
        wanted = row.param_dtype
        if isinstance(module, _NormBase) and module.track_running_stats and wanted != "float32":
            wanted = "float32"  # see the row's note below
        for p in module.parameters(recurse=False):
            requests[id(p)].append((row.path, wanted))
            params[id(p)] = p
    storage: dict[int, tuple[nn.Parameter, torch.dtype]] = {}
    for pid, asks in requests.items():
        chosen = _widest(d for _, d in asks)
        p = params[pid]
        if p.is_floating_point() or isinstance(p, nn.parameter.UninitializedParameter):
            if isinstance(p, nn.parameter.UninitializedParameter):
                if chosen != "float32":
                    path = asks[0][0]
                    raise AmpBridgeError(f"{path!r} ({class_name(modules[path])}) has uninitialised lazy "
                                         f"parameters; run one forward to materialise them before applying "
                                         f"param_dtype={chosen!r}")
                continue
            storage[pid] = (p, DTYPES[chosen])
    return storage


def _plan_notes(policy: Policy, plan_notes: list[str], input_following: set[str]) -> list[str]:
    """The Plan's own notes: the matmul precision, the rows that follow the data flow."""
    if policy.matmul_precision != "highest":
        plan_notes.append(f"matmul_precision {policy.matmul_precision}: torch.set_float32_matmul_precision"
                          f"({policy.matmul_precision!r}) inside amp.model, amp.autocast() and amp.step(), "
                          f"restored after (float32 matmuls may use "
                          f"{'TF32' if policy.matmul_precision == 'high' else 'bfloat16'} on hardware that has it)")
    if input_following:
        plan_notes.append(f"{len(input_following)} row(s) follow the data flow (their input's dtype where autocast "
                          "leaves the ops alone, a custom module's own ops); "
                          "ampbridge.torch.plan(model, policy, *example_inputs) traces the exact dtypes")
    return plan_notes


def _sequential_outputs(rows: list[PlanRow], modules: Mapping[str, nn.Module], rules: Mapping[str, Any],
                        following: set[str]) -> list[PlanRow]:
    """An ``nn.Sequential`` returns what its last module returns (nothing casts it, as with autocast
    by hand, unless its rule sets ``output_dtype``): its row's output is its last child's."""
    by_path = {row.path: i for i, row in enumerate(rows)}
    for i in range(len(rows) - 1, -1, -1):  # children come after their parent: fill them first
        row, module = rows[i], modules[rows[i].path]
        rule = rules.get(row.rule)
        if not isinstance(module, nn.Sequential) or len(module) == 0 or (rule is not None and rule.output_dtype):
            continue
        last = f"{row.path}.{list(module._modules)[-1]}" if row.path else list(module._modules)[-1]
        if last not in by_path or row.path == "":
            continue
        out = rows[by_path[last]].output_dtype
        if last in following:
            following.add(row.path)
        if out != row.output_dtype:
            rows[i] = with_note(row, join_notes(row.note, f"returns its last module's output ({out})"),
                                output_dtype=out)
    return rows


#: added to the shared stream note on a torch row: what torch does with the promoted stream
_TORCH_STREAM = ("; in torch {caller} returns the promoted stream uncast, as hand-written autocast does (Keras "
                 "casts each layer's inputs to its own dtype instead)")
_CALLER_NOTE = ("output follows the data flow: the output of a pinned module, or of MoE experts computing in their "
                "weights' dtype, promotes this module's stream ({dtype} "
                "where it reaches the output) and nothing casts it back, as with autocast by hand")


def _natural(row: PlanRow, module: nn.Module, behaviour: str, device_type: str, present_as: torch.dtype | None,
             cast_inputs: bool, own_stored: set[torch.dtype]) -> tuple[str, str, str, bool]:
    """What the module really does: (compute dtype, output dtype, note, output follows the input)."""
    compute = row.compute_dtype
    cls = class_name(module)
    if behaviour == "weights":
        weights = DTYPE_NAMES[present_as] if present_as is not None else (
            DTYPE_NAMES[next(iter(own_stored))] if len(own_stored) == 1 else row.param_dtype)
        if weights != compute:
            return weights, weights, (f"autocast does not cast embedding lookups: it runs in its weights' dtype "
                                      f"({weights})"), False
        return compute, compute, "", False
    if compute == "float32":
        return compute, compute, "", False
    if isinstance(module, nn.RMSNorm) and behaviour == "input":
        fed = f"({compute})" if cast_inputs else f"({compute} when fed by a {compute} layer)"
        return "float32", compute, f"torch's rms_norm computes in float32 and returns its input's dtype {fed}", \
            not cast_inputs
    if behaviour == "float32":
        return "float32", "float32", f"{device_type} autocast runs {cls} in float32", False
    if behaviour == "input" and not cast_inputs:
        also = ("; its parameters are presented in that dtype (torch's bilinear cannot mix dtypes)"
                if isinstance(module, nn.Bilinear) and present_as is None else "")
        return compute, compute, (f"follows its input's dtype: {device_type} autocast leaves {cls} alone "
                                  f"({compute} when fed by a {compute} layer){also}"), True
    if behaviour == "custom" and not cast_inputs:  # its own code decides: the data flow, not the row
        return compute, compute, (f"custom module: autocast runs its matmuls and convolutions in {compute}; its "
                                  f"other ops and its output follow autocast's per-op rules and the module's own "
                                  f"casts (a float32 softmax stays float32)"), True
    if behaviour == "cast" and device_type == "cpu" and isinstance(module, (nn.GRU, nn.RNNCellBase)) \
            and not cast_inputs:
        return compute, compute, (f"the gates' matmuls run in {compute}; the output keeps its input's dtype "
                                  f"({compute} when fed by a {compute} layer)"), True
    if behaviour == "cast" and isinstance(module, nn.LSTM) and device_type == "cpu" and \
            not cpu_lstm_takes_float32_inputs(compute):
        if not cpu_lstm_runs(compute, compute):
            return compute, compute, (f"cpu LSTM cannot run under {compute} autocast on this CPU (oneDNN has no "
                                      f"{compute} LSTM here, whatever its inputs): pin it (keep_float32)"), False
        if cast_inputs:  # its own rule's region casts them: nothing left for the user to do
            return compute, compute, (f"inputs cast to {compute} (cpu LSTM under {compute} autocast needs them "
                                      f"on this CPU: oneDNN)"), False
        return compute, compute, (f"cpu LSTM under {compute} autocast needs {compute} inputs on this CPU "
                                  f"(oneDNN); pin it or feed {compute}"), False
    return compute, compute, "", False


# --- plan (what apply would run; traced with example inputs) --------------------------------

def plan(model: nn.Module, policy: Policy | str | Path, *example_inputs: Any, warn: bool = True,
         device_type: str | None = None, **example_kwargs: Any) -> Plan:
    """The Plan of a model under a policy (what ``apply`` would run).

    With example inputs it is :func:`~ampbridge.backends.torch.trace.trace`'s: one forward runs (on
    a copy, applied, without gradients) and every row shows the dtype its module really computed in.

    Example:
        >>> import torch
        >>> p = plan(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Softmax(-1)), "mixed_bfloat16")
        >>> p["1"].note
        "follows its input's dtype: cpu autocast leaves Softmax alone (bfloat16 when fed by a bfloat16 layer)"
    """
    if example_inputs or example_kwargs:
        trace = room_above(__package__, "trace").trace
        return trace(model, policy, *example_inputs, warn=warn, device_type=device_type, **example_kwargs)
    policy, env_notes = environment(policy, "torch", warn=False)  # what apply would run
    script = isinstance(model, torch.jit.ScriptModule)
    device_type = (device_type or "cpu") if script else device_type_of(model, device_type)
    resolved, notes = resolve_for_device(policy.at(step=0, epoch=0), device_type)
    notes = list(env_notes) + notes
    if not script:
        return fp8.mark_rows(realise_plan(model, resolved, device_type, warn=warn, notes=notes).plan, device_type)

    def model_output(row: PlanRow) -> PlanRow:
        out = resolved.output_dtype
        if row.path or row.output_dtype == out:
            return row
        note = f"model outputs cast to output_dtype {out}" if out != row.compute_dtype else None
        return with_note(row, note, output_dtype=out)

    built = build_plan(layers(model), resolved, framework="torch", adjust=model_output, warn=warn)
    return Plan(built.rows, built.policy, "torch", built.unmatched_rules,
                tuple(notes) + ("a TorchScript module: rows as requested (autocast's per-op behaviour "
                                "is not inspected)",))

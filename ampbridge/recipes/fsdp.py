"""FSDP mixed-precision settings as plain data (FSDP2 MixedPrecisionPolicy, FSDP1 MixedPrecision).

Holds to_fsdp (write only; ``ampbridge.torch.fsdp_policy`` builds the torch objects from it).
"""

from __future__ import annotations

from typing import Any

from ..core.policy import Policy
from .convert import Conversion, _require_concrete, _Writer, loss_scale_view

# --- FSDP (the framework-free part: dtype names and the modules that need their own wrap) ------------

def to_fsdp(policy: Policy, plan: Any = None) -> Conversion:
    """Policy -> FSDP2 ``MixedPrecisionPolicy`` / FSDP1 ``MixedPrecision`` settings as plain data.

    The torch helper builds the torch objects from this; nothing here imports torch.
    ``result`` is ``{"root": GROUP, "pinned": [GROUP, ...]}``: ``root`` configures the root
    ``fully_shard(model, mp_policy=...)`` / ``FSDP(model, mixed_precision=...)``; each ``pinned``
    group is a set of modules (a ``keep_float32`` entry or an ``[[override]]``, in rule order,
    later wins) that must be wrapped on their own with their own settings, because FSDP casts
    per wrapped unit. Every GROUP is a dict::

        label          "root", "keep_float32[0]", "override[1]", ...
        patterns       the rule's ampbridge patterns ("kind:norm", "lm_head", ...); () for root
        paths          given a Plan: the module paths to wrap (the topmost layers the rule decides
                       whose dtypes differ from what encloses them); else None
        compute_dtype  the dtype the group computes in
        param_dtype    the dtype its parameters must hold before wrapping (FSDP keeps that as the
                       sharded copy, the master weights)
        output_dtype   the dtype its outputs leave in
        fsdp2          MixedPrecisionPolicy(**fsdp2): param_dtype (the compute dtype FSDP casts
                       the unsharded parameters to), reduce_dtype, output_dtype, cast_forward_inputs
        fsdp1          MixedPrecision(**fsdp1): param_dtype, reduce_dtype, buffer_dtype,
                       keep_low_precision_grads, cast_forward_inputs, cast_root_forward_inputs,
                       module_classes_to_ignore (pass as _module_classes_to_ignore=(): ampbridge,
                       not FSDP1's BatchNorm default, decides which modules stay in float32)
        fsdp1_output_dtype  FSDP1 has no output cast: when this differs from the group's compute
                       dtype, cast the outputs with a forward hook

    All dtypes are canonical names ("bfloat16"). ``reduce_dtype`` is the policy's everywhere;
    buffers follow the compute dtype. Loss scaling is separate (``to_grad_scaler`` gives the
    arguments of torch's ``ShardedGradScaler``, which takes the same ones).

    Example:
        >>> import ampbridge
        >>> c = to_fsdp(ampbridge.preset("mixed_bfloat16").replace(keep_float32=("kind:norm",)))
        >>> c.result["root"]["fsdp2"]
        {'param_dtype': 'bfloat16', 'reduce_dtype': 'float32', 'output_dtype': 'float32', 'cast_forward_inputs': True}
        >>> [(g["label"], g["patterns"], g["fsdp2"]["param_dtype"]) for g in c.result["pinned"]]
        [('keep_float32[0]', ('kind:norm',), 'float32')]
    """
    _require_concrete(policy, "FSDP")
    p = policy
    w = _Writer("fsdp", p)
    _fsdp_notes(w, p)
    root = _fsdp_group(p, "root", (), p.compute_dtype, p.param_dtype, p.output_dtype, True)
    pinned = []
    for label, rule in p.rules:
        compute = rule.compute_dtype or p.compute_dtype
        pinned.append(_fsdp_group(p, label, tuple(rule.match), compute, rule.param_dtype or p.param_dtype,
                                  rule.output_dtype or compute, False))
    if plan is not None:
        _fsdp_paths(plan, root, pinned)
    return w.done({"root": root, "pinned": pinned})


def _fsdp_notes(w: _Writer, p: Policy) -> None:
    # what FSDP's mixed precision does not carry: a named loss or a note pointing to the tool that does
    if p.phases:
        w.loss("phase", len(p.phases), "FSDP's mixed precision is fixed when the model is wrapped; the top-level "
               "settings were written (wrap again with policy.at(epoch=N) to change phase)")
    if p.matmul_precision != "highest":
        w.note(f"matmul_precision={p.matmul_precision!r} is torch.set_float32_matmul_precision, outside FSDP")
    if p.fp8.enabled:
        w.note("[fp8] is torchao's convert_to_float8_training (ampbridge.torch.apply), done before wrapping, outside "
               "FSDP's mixed precision: write it with to_torchao()")
    if loss_scale_view(p.loss_scale, p.compute_dtype)["mode"] != "none":
        w.note("loss scaling is separate from FSDP: use torch's ShardedGradScaler with to_grad_scaler()'s arguments")


def _fsdp_group(p: Policy, label: str, patterns: tuple[str, ...], compute: str, param: str, output: str,
                root: bool) -> dict:
    """One GROUP of :func:`to_fsdp`'s result (its fields are listed there)."""
    return {
        "label": label, "patterns": patterns, "paths": None,
        "compute_dtype": compute, "param_dtype": param, "output_dtype": output,
        "fsdp2": {"param_dtype": compute, "reduce_dtype": p.reduce_dtype, "output_dtype": output,
                  "cast_forward_inputs": True},
        "fsdp1": {"param_dtype": compute, "reduce_dtype": p.reduce_dtype, "buffer_dtype": compute,
                  "keep_low_precision_grads": False, "cast_forward_inputs": not root,
                  "cast_root_forward_inputs": True, "module_classes_to_ignore": ()},
        "fsdp1_output_dtype": output,
    }


def _fsdp_paths(plan: Any, root: dict, pinned: list[dict]) -> None:
    by_label = {g["label"]: g for g in pinned}
    for g in pinned:
        g["paths"] = []
    chosen: dict[str, tuple[str, str, str]] = {}
    rows = sorted((r for r in plan.rows if r.rule != "default" and r.inherited_from is None),
                  key=lambda r: (r.path.count(".") if r.path else -1, r.path))
    for row in rows:
        dtypes = (row.compute_dtype, row.param_dtype, row.output_dtype)
        enclosing = next((chosen[a] for a in sorted(chosen, key=len, reverse=True)
                          if a == "" or row.path.startswith(a + ".")), None)
        # a default row's output is its compute dtype; the root's own output is the policy's
        around = enclosing or (root["compute_dtype"], root["param_dtype"], root["compute_dtype"])
        if dtypes != around and row.rule in by_label:
            chosen[row.path] = dtypes
            by_label[row.rule]["paths"].append(row.path)
    for g in pinned:
        g["paths"] = tuple(g["paths"])

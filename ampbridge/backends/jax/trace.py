"""What one forward really ran in: ``trace(model, policy, *example_inputs)`` applies the policy, traces one
forward (``jax.make_jaxpr``: nothing is computed or compiled) and writes the observed dtypes onto
the static Plan's rows.

Compute is read from the jaxpr: each module call runs inside a named scope ``ampbridge-trace:<path>``
and the dtype of its own matmuls/convolutions (norms: ``rsqrt``; embeddings: ``gather``) is what it
computed in. Output is the dtype of what the call delivered (after ampbridge's output cast).

Holds ``trace``.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp

from ...core.plan import NO_OP, Plan, join_notes, not_run, traced_plan, traced_row, with_note
from ...core.policy import Policy
from .apply import Applied, apply
from .plan import plan as _static_plan

_MARK = "ampbridge-trace:"
#: the ops that say what a module computes in, per kind (None: every module)
_ACTED = "\x00acted"  # _ran's key for the paths that ran any op
_MAIN = {"dot_general": None, "conv_general_dilated": None, "rsqrt": "norm", "gather": "embedding"}


def trace(model: Any, policy: Policy | str, *example_inputs: Any, warn: bool = True, **kwargs: Any) -> Plan:
    """The Plan of a Flax model (linen or NNX) with each row's compute and output dtype as one
    traced forward on ``example_inputs`` ran them; the model itself is untouched.

    Rows changed by the trace say ``traced: ran ...``; modules that did not run say so.

    Example:
        >>> import jax.numpy as jnp, flax.linen as nn, ampbridge
        >>> p = trace(nn.Sequential([nn.Dense(4), nn.LayerNorm()]),
        ...           ampbridge.Policy(compute_dtype="bf16", keep_float32=("kind:norm",)), jnp.ones((1, 3)))
        >>> p["layers_0"].compute_dtype, p["layers_1"].output_dtype
        ('bfloat16', 'float32')
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(model, nnx.Module):
        static = _static_plan(model, policy, warn=warn)
        ran, delivered = _trace_nnx(apply(model, static.policy), example_inputs, kwargs)
    else:
        static = _static_plan(model, policy, *example_inputs, warn=warn, **kwargs)
        applied = model if isinstance(model, Applied) else apply(model, static.policy)
        ran, delivered = _trace_linen(applied, example_inputs, kwargs)
    acted = {m for _, m in ran.pop(_ACTED, ())}
    rows = []
    for row in static.rows:
        if row.path not in delivered and row.path not in ran:
            rows.append(not_run(row))
            continue
        if row.path not in acted:  # a deterministic Dropout returns its input: no op ran
            rows.append(with_note(row, join_notes(row.note, NO_OP)))
            continue
        # Flax's float32 norm statistics: the static row says so, the rsqrt would only repeat it
        ops = {d for prim, d in ran.get(row.path, ()) if _MAIN[prim] in (None, row.kind)
               and not (prim == "rsqrt" and row.float32_inside)}
        rows.append(traced_row(row, ops, delivered.get(row.path)))
    return traced_plan(static, rows, ran=set(delivered) | set(ran))


def _trace_linen(applied: Applied, inputs: tuple, kwargs: dict) -> tuple[dict, dict]:
    import flax.linen as nn

    def probe(next_fun: Any, args: tuple, kw: dict, context: Any) -> Any:
        # entered before ampbridge's interceptor, so it runs inside it: the scope holds the module's own ops
        if context.method_name == "setup":
            return next_fun(*args, **kw)
        with jax.named_scope(_MARK + ".".join(str(p) for p in context.module.path)):
            return next_fun(*args, **kw)

    variables = jax.eval_shape(lambda: applied.init(jax.random.key(0), *inputs, **kwargs))

    def forward(v: Any) -> Any:
        with nn.intercept_methods(probe):
            return applied.apply(v, *inputs, **kwargs)

    ran = _ran(jax.make_jaxpr(forward)(variables).jaxpr)
    delivered: dict[str, set[str]] = {}
    for seen in applied.observe(variables, *inputs, **kwargs):
        delivered.setdefault(seen.path, set()).update(seen.outputs)
    return ran, delivered


def _trace_nnx(applied: Any, inputs: tuple, kwargs: dict) -> tuple[dict, dict]:
    """Each module of the applied copy gets a recording subclass (outermost, over ampbridge's call)."""
    from flax import nnx

    delivered: dict[str, set[str]] = {}
    for keypath, module in nnx.iter_graph(applied):
        if not isinstance(module, nnx.Module) or "__call__" not in dir(type(module)):
            continue
        path = ".".join(str(k) for k in keypath)
        cls = type(module)

        def __call__(self: Any, *args: Any, _path: str = path, **kw: Any) -> Any:
            with jax.named_scope(_MARK + _path):
                out = super(type(self), self).__call__(*args, **kw)
            delivered.setdefault(_path, set()).update(_floats(out))
            return out

        object.__setattr__(module, "__class__", type(cls.__name__, (cls,), {"__call__": __call__,
                                                                             "__module__": cls.__module__}))
    graphdef, state = nnx.split(applied)

    def forward(state: Any) -> Any:
        return nnx.merge(graphdef, state)(*inputs, **kwargs)

    return _ran(jax.make_jaxpr(forward)(state).jaxpr), delivered


def _eqns(jaxpr: Any) -> Any:
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _eqns(inner if hasattr(inner, "eqns") else inner.jaxpr)


def _ran(jaxpr: Any) -> dict[str, list[tuple[str, str]]]:
    """path -> (primitive, dtype) of the main ops that module ran itself (not its submodules); under
    :data:`_ACTED`, the paths during whose call (theirs or a submodule's) any op ran at all."""
    ran: dict[str, list[tuple[str, str]]] = {_ACTED: []}
    for eqn in _eqns(jaxpr):
        marks = [s[len(_MARK):] for s in str(eqn.source_info.name_stack).split("/") if s.startswith(_MARK)]
        ran[_ACTED].extend(("", m) for m in marks)
        if eqn.primitive.name not in _MAIN:
            continue
        if marks:
            ran.setdefault(marks[-1], []).append((eqn.primitive.name, str(eqn.outvars[0].aval.dtype)))
    return ran


def _floats(tree: Any) -> set[str]:
    return {str(x.dtype) for x in jax.tree_util.tree_leaves(tree)
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)}



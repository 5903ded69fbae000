"""Realising the Plan: :func:`apply` (a linen module gives an :class:`Applied`, an NNX module a
converted copy).

Holds: Applied, apply.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from ...core.matching import join_path
from ...core.plan import Layer, Plan, PlanRow, build_plan, gc_paused
from ...core.policy import Policy
from ...errors import AmpBridgeError, UnsupportedOptionError
from .cast import cast_tree
from .environment import DTYPES, FRAMEWORK, MATMUL_PRECISION, linen_module, phase_policy, resolve_policy
from .layers import Facts, Resolver
from .linen import (
    Observed,
    is_frozen,
    linen_plan,
    LinenInterceptor,
    needs_classes,
    param_paths,
    keep_state_dtypes,
    trace_state,
)
from .nnx import apply_nnx, nnx_copy, nnx_layers


class Applied:
    """A linen module under a policy: ``init`` and ``apply`` run every module per its Plan row.

    ``init`` creates parameters in their row's ``param_dtype`` (pinned ones float32); ``apply``
    casts parameters per module (inside your loss function, so gradients reach the stored ones),
    runs each module in its compute dtype and returns outputs in the policy's ``output_dtype``.
    ``plan(*x)`` is the Plan; ``observe(variables, *x)`` the dtypes every call actually saw;
    ``at(epoch=...)`` the same model under the phase in force.
    """

    def __init__(self, module: Any, policy: Policy | str, *, _phase: tuple | None = None,
                 _schedule: Policy | None = None, _notes: tuple[str, ...] = (), _known: dict | None = None):
        nn = linen_module()
        if not isinstance(module, nn.Module):
            raise TypeError(f"ampbridge.jax.Applied needs a flax.linen.Module; received {type(module).__name__}")
        if _schedule is None:
            schedule, notes = resolve_policy(policy)
            _phase = (0, 0)
        else:
            schedule, notes = _schedule, _notes
        self.module = module
        self.schedule = schedule  # the whole policy, phases included
        self.policy = phase_policy(schedule, *(_phase or (None, None)))  # the phase in force
        self.notes = notes
        self._resolver = Resolver(self.policy)
        # path -> (kind, class, facts), learnt while tracing; shared by the phases of one model
        self._known: dict[str, tuple[str | None, str, Facts]] = {} if _known is None else _known
        # path -> the dtypes its author fixed, under this phase: a dtype the model hands down (ResNet's
        # dtype=self.dtype) is the one ampbridge runs its module in, so the answer can differ by phase
        self._fixed: dict[str, tuple[str, str] | None] = {}
        self._lock = threading.Lock()
        self._phases: dict[int | None, Applied] = {}

    def __repr__(self) -> str:
        return (f"Applied({type(self.module).__name__}, compute={self.policy.compute_dtype}, "
                f"params={self.policy.param_dtype}, output={self.policy.output_dtype})")

    # -- phases --
    def at(self, *, step: int | None = None, epoch: int | None = None) -> "Applied":
        """The model under the phase in force at ``step``/``epoch`` (cached per phase)."""
        index = self.schedule.phase_index(step=step, epoch=epoch) if self.schedule.phases else None
        with self._lock:
            hit = self._phases.get(index)
        if hit is None:
            hit = Applied(self.module, self.schedule, _phase=(step, epoch), _schedule=self.schedule,
                          _notes=self.notes, _known=self._known)
            with self._lock:
                self._phases[index] = hit
        return hit

    def phase_model(self, policy: Policy) -> "Applied":
        """The same module under one phase's resolved ``policy`` (no phases of its own), sharing what
        tracing learnt of the tree: a :class:`Schedule`'s model of that phase."""
        return Applied(self.module, policy, _phase=(None, None), _schedule=policy, _notes=self.notes,
                       _known=self._known)

    # -- what the monitor reads --
    @property
    def resolver(self) -> Resolver:
        """The path -> Plan row resolver the method interceptor runs with (the monitor's watch shares it)."""
        return self._resolver

    def known_paths(self) -> list[str]:
        """The module paths traced so far, in first-call order."""
        return list(self._known)

    # -- the Flax API --
    def _interceptor(self, observer: Callable | None = None) -> Any:
        self._resolver.settle(self._known)  # inferred kinds as the whole tree settles them
        return LinenInterceptor(self._resolver, record=self._known, observer=observer, fixed=self._fixed)

    @contextlib.contextmanager
    def _scope(self, interceptor: Any):
        nn = linen_module()
        with jax.default_matmul_precision(MATMUL_PRECISION[self.policy.matmul_precision]):
            with nn.intercept_methods(interceptor):
                yield

    def _learn_tree(self, rngs: Any, args: tuple, method: Any, kwargs: dict) -> None:
        """Before the first ``init`` of a policy with ``kind:`` rules: trace ``init`` once (nothing
        computed) to learn the module tree, so a container's inferred kind is settled by what it
        holds (:func:`~ampbridge.core.kinds.settle_kinds`) before any parameter is made."""
        if self._known or not any(m.startswith("kind:") for _, rule in self.policy.rules for m in rule.match):
            return
        recorder = LinenInterceptor(self._resolver, record=self._known, memo={}, fixed=self._fixed)

        def run() -> Any:
            recorder.top_trace = trace_state()
            with linen_module().intercept_methods(recorder):
                return self.module.init(rngs, *args, method=method, **kwargs)

        with gc_paused():
            jax.eval_shape(run)

    def init(self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any) -> Any:
        """``module.init`` with parameters created in each row's ``param_dtype``.

        Warns (:class:`ampbridge.UnmatchedRuleWarning`) once for each rule no module matched.
        """
        self._learn_tree(rngs, args, method, kwargs)
        with self._scope(self._interceptor()):
            variables = self.module.init(rngs, *args, method=method, **kwargs)
        self._warn_unmatched()
        return self.cast_params(variables)

    def _warn_unmatched(self) -> None:
        if getattr(self, "_warned_unmatched", False) or not (self.policy.rules or self.policy.kinds):
            return
        self._warned_unmatched = True
        layers = [Layer(path, kind, cls, 0, getattr(facts, "kind_source", None))
                  for path, (kind, cls, facts) in self._known.items()]
        build_plan(layers, self.policy, framework=FRAMEWORK, warn=True)

    def init_with_output(self, rngs: Any, *args: Any, method: Any = None, **kwargs: Any) -> tuple[Any, Any]:
        self._learn_tree(rngs, args, method, kwargs)
        with self._scope(self._interceptor()):
            out, variables = self.module.init_with_output(rngs, *args, method=method, **kwargs)
        self._warn_unmatched()
        return cast_tree(out, DTYPES[self.policy.output_dtype]), self.cast_params(variables)

    def apply(self, variables: Any, *args: Any, rngs: Any = None, method: Any = None,
              mutable: Any = False, **kwargs: Any) -> Any:
        """``module.apply`` following the Plan; outputs in ``output_dtype``.

        With ``mutable``, the updated collections come back as the module made them: each leaf that
        came in keeps the dtype it came in with, a new one the dtype its module created it in
        (``batch_stats`` float32, a ``decode=True`` cache the compute dtype of the keys it holds).
        """
        before = variables
        variables = self._compute_variables(variables, args, kwargs, rngs=rngs, method=method,
                                            mutable=mutable)
        with self._scope(self._interceptor()):
            result = self.module.apply(variables, *args, rngs=rngs, method=method, mutable=mutable,
                                       **kwargs)
        out_dtype = DTYPES[self.policy.output_dtype]
        if mutable is not False:
            out, state = result
            return cast_tree(out, out_dtype), keep_state_dtypes(state, before)
        return cast_tree(result, out_dtype)

    __call__ = apply

    def observe(self, variables: Any, *args: Any, rngs: Any = None, method: Any = None,
                mutable: Any = False, **kwargs: Any) -> list[Observed]:
        """Trace ``apply`` (abstractly: nothing runs) and return what every module call saw."""
        seen: list[Observed] = []
        cast_vars = self._compute_variables(variables, args, kwargs, rngs=rngs, method=method,
                                            mutable=mutable)

        def run(v: Any) -> Any:
            with self._scope(self._interceptor(seen.append)):
                return self.module.apply(v, *args, rngs=rngs, method=method, mutable=mutable, **kwargs)

        jax.eval_shape(run, cast_vars)
        return seen

    # -- parameters --
    def rows_for_paths(self, paths: Iterable[str]) -> dict[str, PlanRow]:
        """The Plan rows of ``paths`` as traced so far (an untraced prefix: no kind, no class)."""
        self._resolver.settle(self._known)
        rows = {}
        for path in paths:
            parts = path.split(".") if path else []
            chain = []
            for depth in range(len(parts) + 1):
                prefix = ".".join(parts[:depth])
                kind, cls, facts = self._known.get(prefix, (None, "", None))
                # not traced under this phase yet (cast_params without inputs): as first traced
                fixed = self._fixed[prefix] if prefix in self._fixed else getattr(facts, "fixed", None)
                chain.append((prefix, kind, cls, fixed))
            rows[path] = self._resolver.row(tuple(chain))
        return rows

    def _ensure_known(self, variables: Any, args: tuple, kwargs: dict, paths: set[str] | None = None,
                      **apply_kw: Any) -> None:
        if paths is None:
            paths = param_paths(variables.get("params", {}) if isinstance(variables, Mapping) else {})
        if all(p in self._known and p in self._fixed for p in paths):
            return
        # learn the module tree (classes, kinds, the author's dtypes) by tracing once; nothing is computed
        recorder = LinenInterceptor(self._resolver, record=self._known, memo={}, fixed=self._fixed)

        def run() -> Any:
            nn = linen_module()
            recorder.top_trace = trace_state()
            with nn.intercept_methods(recorder):
                # mutable: collections the variables lack (a params-only checkpoint of a model whose [fp8]
                # layers keep scales in _overwrite_with_gradient) are created in the trace, not an error
                return self.module.apply(variables, *args, **{"mutable": True, **apply_kw}, **kwargs)

        with gc_paused():
            jax.eval_shape(run)

    def _compute_variables(self, variables: Any, args: tuple, kwargs: dict, **apply_kw: Any) -> Any:
        if not isinstance(variables, Mapping) or "params" not in variables:
            return variables
        params = variables["params"]
        paths = param_paths(params)
        self._ensure_known(variables, args, kwargs, paths, **apply_kw)
        rows = self.rows_for_paths(paths)
        return {**variables, "params": self._cast_by_row(params, rows, "compute_dtype")}

    @staticmethod
    def _cast_by_row(params: Any, rows: Mapping[str, PlanRow], role: str) -> Any:
        def walk(node: Any, names: tuple[str, ...]) -> Any:
            path = join_path(*names)
            out = {}
            for key, value in node.items():
                if isinstance(value, Mapping):
                    out[key] = walk(value, names + (str(key),))
                else:
                    out[key] = cast_tree(value, DTYPES[getattr(rows[path], role)])
            return out

        return walk(params, ())

    @gc_paused()
    def cast_params(self, variables: Any, *example_inputs: Any, **kwargs: Any) -> Any:
        """Variables with every parameter in its row's ``param_dtype``; other collections as they are.

        Use it on a float32 checkpoint, or at a phase boundary where ``param_dtype`` changes. The
        module tree is known once ``init``/``apply``/``plan`` ran; otherwise pass example inputs
        (traced, not computed) when the policy has ``kind:``/``type:`` rules.
        """
        if not isinstance(variables, Mapping):
            return variables
        out = dict(variables)  # batch_stats, caches: the dtypes their modules created them in
        if "params" in variables:
            params = variables["params"]
            paths = param_paths(params)
            unknown = [p for p in paths if p not in self._known]
            if unknown and example_inputs:
                self._ensure_known(variables, example_inputs, kwargs, paths)
            elif unknown and needs_classes(self.policy):
                raise ValueError(
                    f"cast_params: the module tree is not known yet (e.g. {unknown[0]!r}), and this policy's "
                    "kind:/type: rules need it; call init/apply/plan first or pass example inputs: "
                    "amp.cast_params(variables, x)")
            rows = self.rows_for_paths(paths)
            out["params"] = self._cast_by_row(params, rows, "param_dtype")
        return type(variables)(out) if type(variables) is not dict and is_frozen(variables) else out

    # -- the Plan --
    def plan(self, *example_inputs: Any, rngs: Any = None, method: Any = None, warn: bool = True,
             **kwargs: Any) -> Plan:
        """The Plan of this module under the phase in force (``example_inputs`` as for ``init``)."""
        return linen_plan(self.module, self.policy, example_inputs, rngs=rngs, method=method, warn=warn,
                           notes=self.notes, known=self._known, **kwargs)


# --- public: apply ----------------------------------------------------------------------------

def apply(model: Any, policy: Policy | str) -> Any:
    """Run a Flax model under a policy.

    A ``flax.linen.Module`` gives an :class:`Applied` (``init``/``apply``/``plan``); a
    ``flax.nnx.Module`` gives a copy of it whose calls follow the Plan (the original is left as it
    was). A policy with ``[[phase]]`` tables starts in its first phase; see :class:`Schedule`.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, ampbridge
        >>> amp = apply(nn.Dense(3), ampbridge.preset("mixed_bfloat16"))
        >>> v = amp.init(jax.random.key(0), jnp.ones((1, 2)))
        >>> v["params"]["kernel"].dtype, amp.apply(v, jnp.ones((1, 2))).dtype
        (dtype('float32'), dtype('float32'))
    """
    linen = sys.modules.get("flax.linen")
    nnx = sys.modules.get("flax.nnx")
    if isinstance(model, Applied):
        raise ModelNotSupportedError(
            "ampbridge.jax.apply was given an applied model (what apply returned); apply the policy to its "
            "module instead: ampbridge.jax.apply(amp.module, policy)")
    if linen is not None and isinstance(model, linen.Module):
        return Applied(model, policy)
    if nnx is not None and isinstance(model, nnx.Module):
        with gc_paused():  # one walk of the copy serves the refusal and the conversion
            copy = nnx_copy(model)
            described = nnx_layers(copy)
        _refuse_applied_nnx(described.instances)
        resolved, notes = resolve_policy(policy)
        if resolved.uses_fp8:
            raise UnsupportedOptionError("the [fp8] table is not realised on flax.nnx models (Flax's fp8_ops are "
                                         "linen modules); use a linen model, or leave [fp8] out")
        return apply_nnx(copy, phase_policy(resolved), notes, described)
    raise TypeError(f"ampbridge.jax.apply needs a flax.linen.Module or a flax.nnx.Module; received "
                    f"{type(model).__module__}.{type(model).__qualname__}. For plain pytrees "
                    "(equinox, haiku) use ampbridge.jax.cast(tree, policy)")


class ModelNotSupportedError(AmpBridgeError, TypeError):
    """``apply`` was given a model it cannot realise a policy on (an applied one, or part of one)."""


def _refuse_applied_nnx(instances: Mapping[str, Any]) -> None:
    """An NNX model ``apply`` returned (or a module of one) runs its own Plan already: applying to it
    again would wrap its calls twice. ``instances``: path -> module of the model (or its copy: the
    same classes), the module itself first."""
    for path, value in instances.items():
        if "_ampbridge_original" in vars(type(value)):
            where = "this module" if not path else f"its module {path!r}"
            raise ModelNotSupportedError(
                f"{where} belongs to a model ampbridge.jax.apply returned (it runs that Plan already); apply the "
                "policy to the original module (apply returns a copy and leaves the original as it was)")

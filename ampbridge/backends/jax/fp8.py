"""FP8 on Flax (linen): the ``[fp8]`` table realised with Flax's own ``fp8_ops`` (delayed scaling) or
ampbridge's own current scaling (:mod:`.fp8_current`: Flax has none).

A linen layer the Plan marks float8 (``Dense``, ``DenseGeneral``, ``Einsum``: the layers with a
``dot_general_cls`` field) runs with ``dot_general_cls`` set, for its call, to Flax's
``Fp8DirectDotGeneralOp`` (``Fp8Einsum`` for ``Einsum``) with the table's ``amax_history`` as
``amax_history_length``: exactly the model
written by hand with those classes, scales and amax histories in the ``_overwrite_with_gradient``
collection (``flax.training.train_state.TrainState.apply_gradients`` overwrites them with their
"gradients"). That is the reference's *delayed* scaling (:mod:`ampbridge.core.fp8`); Flax quantizes
each step with the updated scale. On CPU XLA emulates the float8 dot.

``scaling = "current"`` sets ``dot_general_cls`` to :class:`.fp8_current.CurrentScalingDotGeneral`
(torchao's tensorwise dynamic scaling, stateless), with the table's formats and margin.

Refused by name, under delayed scaling: ``amax_compute = "most_recent"``, ``margin`` other than 0
(Flax's ``fp8_ops`` compute the scale with margin 0), formats other than e4m3 forward / e5m2
backward (``fp8_scaled_dot_general`` hard-codes them); under both, a matched module without
``dot_general_cls``. NNX models are not realised (refused by name).

Holds ``REALISED_BY``, ``check``, ``dot_general_cls``, ``fp8_call`` and ``mark_rows``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from collections.abc import Iterator
from typing import Any

from ...core.plan import Plan, PlanRow
from ...core.policy import Policy
from ...errors import UnsupportedOptionError

REALISED_BY = {"delayed": "Flax fp8_ops", "current": "ampbridge current scaling"}
_FIELD = "dot_general_cls"


def mark_rows(plan: Plan) -> Plan:
    """``plan`` with each float8 row's ``fp8_by`` filled in."""
    if not any(r.fp8 for r in plan.rows):
        return plan
    from ...diagnostics.doctor import emulation_note
    from ...diagnostics.hardware import Device
    from .environment import device

    # current scaling's op dots float32 dequantised values on every device: emulated everywhere
    note = {"delayed": emulation_note(device(), "jax"), "current": emulation_note(Device("cpu"), "jax")}
    return replace(plan, rows=tuple(replace(r, fp8_by=REALISED_BY[r.fp8_scaling] + note[r.fp8_scaling])
                                    if r.fp8 else r for r in plan.rows))


def check(policy: Policy) -> None:
    """Refuse, by name, the [fp8] settings Flax's fp8_ops cannot carry."""
    fp8 = policy.fp8
    if not fp8.enabled:
        return
    if fp8.scaling == "current":
        return  # ampbridge's own op: any format, any margin
    if fp8.amax_compute == "most_recent":
        raise UnsupportedOptionError('fp8.amax_compute = "most_recent" is not realised on Flax: its fp8_ops take '
                                     'the history\'s max (amax_compute = "max")')
    if fp8.margin != 0:
        raise UnsupportedOptionError(f"fp8.margin = {fp8.margin} is not realised on Flax: its fp8_ops compute "
                                     f"the scale with margin 0; write margin = 0")
    for key, wanted in (("forward", "e4m3"), ("backward", "e5m2")):
        if getattr(fp8, key) != wanted:
            raise UnsupportedOptionError(f"fp8.{key} = {getattr(fp8, key)!r} is not realised on Flax: its fp8_ops "
                                         f"dot_general casts to float8_e4m3fn forward and float8_e5m2 backward")


def dot_general_cls(module: Any, row: PlanRow, policy: Policy) -> Any:
    """The dot_general class (with the table's settings) ``module`` runs with, or None when not float8."""
    if not row.fp8:
        return None
    from flax.linen import fp8_ops

    from .fp8_current import CurrentScalingDotGeneral

    if isinstance(module, fp8_ops.Fp8DotGeneralBase):
        return None  # the op ampbridge itself put under a matched layer
    if _FIELD not in getattr(type(module), "__dataclass_fields__", {}):
        raise UnsupportedOptionError(
            f"fp8.match puts {row.path or '(root)'!r} ({row.class_name}) in float8, but Flax's fp8_ops replace "
            f"the dot_general of Dense, DenseGeneral and Einsum only; match those (kind:linear or their paths)")
    fp8 = policy.fp8
    if fp8.scaling == "current":
        return functools.partial(CurrentScalingDotGeneral, fp8.forward, fp8.backward, fp8.margin)
    op = fp8_ops.Fp8Einsum if type(module).__name__ == "Einsum" else fp8_ops.Fp8DirectDotGeneralOp
    return functools.partial(op, amax_history_length=policy.fp8.amax_history)


@contextlib.contextmanager
def fp8_call(module: Any, cls: Any) -> Iterator[None]:
    """``module.dot_general_cls = cls`` for one call (bound clones only), then restored."""
    if cls is None:
        yield
        return
    old = getattr(module, _FIELD)
    object.__setattr__(module, _FIELD, cls)
    try:
        yield
    finally:
        object.__setattr__(module, _FIELD, old)

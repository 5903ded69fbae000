"""optax ``apply_if_finite`` arguments in and out (plain data: no optax import).

Holds from_optax and to_optax: ``optax.apply_if_finite(inner, max_consecutive_errors)`` is
``[loss_scale] mode = "none", skip_nonfinite = true, max_consecutive_skips = N`` (optax scales no
loss; it skips a non-finite update, and applies it after N skipped in a row until a finite one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.loss_scale import LossScaleState
from ..core.policy import LossScaleConfig, Policy
from ..errors import PolicyError, Problem
from .convert import Conversion, _construct, _get_int, _policy_of, _Reader, _Writer, loss_scale_view

_OPTAX_KEYS = ("max_consecutive_errors", "notfinite_count")


def from_optax(kwargs: Mapping[str, Any]) -> Conversion:
    """``optax.apply_if_finite`` arguments (and, optionally, its state's ``notfinite_count``) ->
    LossScaleConfig (+ state).

    Example:
        >>> c = from_optax({"max_consecutive_errors": 5, "notfinite_count": 2})
        >>> c.result.max_consecutive_skips, c.result.mode, c.state.nonfinite_streak
        (5, 'none', 2)
    """
    r = _Reader("optax")
    if not isinstance(kwargs, Mapping):
        raise PolicyError([Problem("apply_if_finite arguments must be a mapping", value=kwargs)])
    r.check_keys(kwargs, _OPTAX_KEYS, (), "optax.apply_if_finite's arguments")
    if "max_consecutive_errors" not in kwargs:
        r.problem(("max_consecutive_errors",), "is required (apply_if_finite has no default)",
                  accepted="an integer from 0 to 2147483647")
    limit = _get_int(r, kwargs, "max_consecutive_errors", (), 0, low=0, what="an integer from 0 to 2147483647")
    count = _get_int(r, kwargs, "notfinite_count", (), 0, low=0, what="an integer >= 0")
    r.origins["loss_scale.max_consecutive_skips"] = "max_consecutive_errors"
    r.note("optax scales no loss: mode 'none'; ampbridge.jax.optimizer with this policy is apply_if_finite")
    r.note("optax's total_notfinite counts every non-finite update; ampbridge's state counts the skipped ones")
    cfg = _construct(r, lambda: LossScaleConfig(mode="none", skip_nonfinite=True, max_consecutive_skips=limit))
    return r.done(cfg, ("loss_scale",), LossScaleState(scale=1.0, nonfinite_streak=count))


def to_optax(policy: Policy | LossScaleConfig) -> Conversion:
    """Policy (or LossScaleConfig) -> ``apply_if_finite`` arguments, or None (no skipping to write).

    Example:
        >>> to_optax(LossScaleConfig(mode="none", max_consecutive_skips=3)).result
        {'max_consecutive_errors': 3}
    """
    p = _policy_of(policy, "to_optax")
    w = _Writer("optax", p)
    w.loss_scale_only(policy, "optax")
    view = loss_scale_view(p.loss_scale, p.compute_dtype if p.compute_dtype != "auto" else "float32")
    if view["mode"] != "none":
        w.loss("loss_scale.mode", view["mode"], "optax's apply_if_finite scales no loss; use "
               "ampbridge.jax.optimizer (or jmp) for the loss scale")
    if not view["skip_nonfinite"]:
        w.note("skip_nonfinite = false: no apply_if_finite (every update applied)")
        return w.done(None)
    w.realised.add("max_consecutive_skips")
    limit = view.get("max_consecutive_skips")
    if limit is None:
        limit = 2**31 - 1
        w.note("no max_consecutive_skips (always skip): written as max_consecutive_errors = 2**31 - 1; optax's "
               "notfinite_count stops there (safe_increment), so it never applies a non-finite update either")
    return w.done({"max_consecutive_errors": limit})

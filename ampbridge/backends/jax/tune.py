"""``tune`` for Flax (linen and NNX): a few optax steps in float32 and under the policy, through
``apply``, ``optimizer``, ``numerics`` and ``Monitor``; the search is ``ampbridge.diagnostics.tune``."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from ...core.policy import Policy
from ...diagnostics.runlog import RunLog, read_log
from ...diagnostics.tune import TOLERANCE, StepCycle, TuneResult, tune_policy
from ..common import as_policy
from .apply import apply
from .loss_scale import optimizer as scaled_optimizer
from .monitor import Monitor, numerics

__all__ = ["tune"]


def _args(inputs: Any) -> tuple[Any, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _run(module: Any, policy: Policy, variables: Mapping[str, Any], cycle: StepCycle,
         loss_fn: Callable[[Any, Any], Any], make_tx: Callable[[], Any], path: Path) -> RunLog:
    """One run: parameters cast by ``apply`` (new arrays: the caller's stay as they are), every step logged."""
    import optax

    amp = apply(module, policy)
    first = _args(cycle.batches[0][0])
    cast = amp.cast_params(dict(variables), *first)
    params = cast["params"]
    rest = {k: v for k, v in cast.items() if k != "params"}  # other collections: held as they are
    tx = scaled_optimizer(make_tx(), policy)
    opt_state = tx.init(params)

    def loss_of(p: Any, inputs: Any, target: Any) -> Any:
        return loss_fn(amp.apply({"params": p, **rest}, *inputs), target)

    @jax.jit
    def step(params: Any, opt_state: Any, inputs: Any, target: Any) -> Any:
        _, grads, stats = numerics(amp, loss_of, opt_state)(params, inputs, target)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats

    with Monitor(path, amp, *first, every=1) as monitor:
        for i, (inputs, target) in enumerate(cycle.batches):
            params, opt_state, stats = step(params, opt_state, tuple(jnp.asarray(a) for a in _args(inputs)),
                                            jnp.asarray(target))
            monitor.record(i, stats)
    return read_log(path)


def _run_nnx(model: Any, policy: Policy, cycle: StepCycle, loss_fn: Callable[[Any, Any], Any],
             make_tx: Callable[[], Any], path: Path) -> RunLog:
    """One NNX run on the copy ``apply`` makes (its own Variables: the user's model keeps its values)."""
    from flax import nnx

    work = apply(model, policy)
    opt = nnx.Optimizer(work, scaled_optimizer(make_tx(), policy), wrt=nnx.Param)

    @nnx.jit
    def step(work: Any, opt: Any, inputs: Any, target: Any) -> Any:
        _, grads, stats = numerics(work, lambda m: loss_fn(m(*inputs), target), opt)(work)
        opt.update(work, grads)
        return stats

    with Monitor(path, work, every=1) as monitor:
        for i, (inputs, target) in enumerate(cycle.batches):
            stats = step(work, opt, tuple(jnp.asarray(a) for a in _args(inputs)), jnp.asarray(target))
            monitor.record(i, stats)
    return read_log(path)


def _is_nnx(model: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)


def tune(model: Any, policy: Policy | str | Path, variables: Any, batches: Iterable[Any],
         loss_fn: Callable[[Any, Any], Any] | None = None, *, steps: int = 8, dtypes: Iterable[str] | None = None,
         optimizer: Callable[[], Any] | None = None, progress: Callable[[str], None] | None = None,
         tolerance: float = TOLERANCE) -> TuneResult:
    """The pins ``policy`` needs on a Flax model, from ``steps`` optax steps on copies.

    linen: ``tune(module, policy, variables, batches, loss_fn)``; NNX: ``tune(model, policy,
    batches, loss_fn)`` (an NNX model holds its variables). ``batches``: ``(inputs, target)`` pairs
    (``inputs`` an array, or a tuple passed positionally); ``loss_fn(outputs, target)`` the scalar
    loss; ``optimizer()`` each run's optax transformation (default ``optax.adam(1e-3)``;
    ampbridge's loss scaling wraps it). linen: collections other than ``params`` are held constant;
    every run works on its own cast copy of ``variables``. NNX: every run trains the copy
    ``ampbridge.jax.apply`` makes (its own Variables). The user's model and variables stay as they were.
    """
    nnx_model = _is_nnx(model)
    if nnx_model:  # (model, policy, batches, loss_fn): the third and fourth arguments move up
        if loss_fn is not None:
            raise TypeError("tune on an NNX model takes (model, policy, batches, loss_fn): the model holds its "
                            "variables; received a fifth argument")
        batches, loss_fn = variables, batches
    elif not isinstance(variables, Mapping) or "params" not in variables:
        raise TypeError("tune takes the module's variables, a mapping with 'params' (what module.init returns); "
                        f"received {type(variables).__name__}")
    elif loss_fn is None:
        raise TypeError("tune on a linen module takes (module, policy, variables, batches, loss_fn); loss_fn is missing")
    if not callable(loss_fn):
        raise TypeError(f"tune: loss_fn must be callable, loss_fn(outputs, target); received {type(loss_fn).__name__}")
    cycle = StepCycle.of(batches, steps)

    def make_tx() -> Any:
        import optax

        return optimizer() if optimizer is not None else optax.adam(1e-3)

    with tempfile.TemporaryDirectory(prefix="ampbridge-tune-") as tmp:
        count = iter(range(1 << 30))

        def run(p: Policy) -> RunLog:
            path = Path(tmp) / f"run{next(count)}.jsonl"
            if nnx_model:
                return _run_nnx(model, p, cycle, loss_fn, make_tx, path)
            return _run(model, p, variables, cycle, loss_fn, make_tx, path)

        return tune_policy(as_policy(policy), run, dtypes=dtypes, framework="jax", steps=steps, progress=progress,
                           tolerance=tolerance)

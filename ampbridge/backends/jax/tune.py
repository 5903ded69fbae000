"""``tune`` for Flax linen: a few optax steps in float32 and under the policy, through ``apply``,
``optimizer``, ``numerics`` and ``Monitor``; the search is ``ampbridge.diagnostics.tune``."""

from __future__ import annotations

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


def tune(model: Any, policy: Policy | str | Path, variables: Mapping[str, Any], batches: Iterable[Any],
         loss_fn: Callable[[Any, Any], Any], *, steps: int = 8, dtypes: Iterable[str] | None = None,
         optimizer: Callable[[], Any] | None = None, progress: Callable[[str], None] | None = None,
         tolerance: float = TOLERANCE) -> TuneResult:
    """The pins ``policy`` needs on a linen module ``model`` with ``variables``, from ``steps`` optax steps.

    ``batches``: ``(inputs, target)`` pairs (``inputs`` an array, or a tuple passed positionally);
    ``loss_fn(outputs, target)`` the scalar loss; ``optimizer()`` each run's optax transformation
    (default ``optax.adam(1e-3)``; ampbridge's loss scaling wraps it). Collections other than
    ``params`` are held constant. JAX arrays are immutable and every run works on its own cast
    copy: ``variables`` stay as they were.
    """
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise TypeError("tune takes the module's variables, a mapping with 'params' (what module.init returns); "
                        f"received {type(variables).__name__}")
    cycle = StepCycle.of(batches, steps)

    def make_tx() -> Any:
        import optax

        return optimizer() if optimizer is not None else optax.adam(1e-3)

    with tempfile.TemporaryDirectory(prefix="ampbridge-tune-") as tmp:
        count = iter(range(1 << 30))

        def run(p: Policy) -> RunLog:
            return _run(model, p, variables, cycle, loss_fn, make_tx, Path(tmp) / f"run{next(count)}.jsonl")

        return tune_policy(as_policy(policy), run, dtypes=dtypes, framework="jax", steps=steps, progress=progress,
                           tolerance=tolerance)

"""``tune`` for tf.keras 2: a few ``fit`` steps of a clone of the model in float32 and under the policy,
through ``apply``, ``optimizer`` and ``Monitor``; the search is ``ampbridge.diagnostics.tune``.

tf_keras's ``Monitor`` names the layer whose own *gradients* went non-finite; a forward that went
non-finite needs the layer whose *output* did first, so a run whose loss is non-finite is probed
here: the first batch with a non-finite loss goes through a model that returns every top-level
layer's output (with the run's final weights: a skipped step changes none), and the first non-finite
one in forward order is the layer named (its inputs are the outputs before it, all finite). Layers
inside a nested model are not probed one by one: the nested model is named as a whole."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import tf_keras

from ...core.policy import Policy
from ...diagnostics.runlog import RunLog, read_log
from ...diagnostics.tune import TOLERANCE, StepCycle, TuneResult, tune_policy
from ..common import as_policy, clone_keras_model, stack_batches
from .apply import apply
from .loss_scale import optimizer as scaled_optimizer
from .monitor import Monitor

__all__ = ["tune"]




def _first_nonfinite_output(model: Any, inputs: Any) -> str | None:
    """The first top-level layer, in forward order, whose output on ``inputs`` is non-finite (None:
    none is, or the model's graph cannot be probed: a subclassed model)."""
    layers = [layer for layer in model.layers if not isinstance(layer, tf_keras.layers.InputLayer)]
    try:
        probe = tf_keras.Model(model.inputs, [layer.output for layer in layers])
    except Exception:  # no symbolic outputs to read
        return None
    outputs = probe(inputs, training=False)
    for layer, out in zip(layers, outputs if len(layers) > 1 else [outputs]):
        parts = out if isinstance(out, (list, tuple)) else [out]
        if not all(np.isfinite(np.asarray(p, dtype=np.float64)).all() for p in parts):
            return layer.name
    return None


def _attributed(log: RunLog, model: Any, cycle: StepCycle) -> RunLog:
    """The log with ``first_nonfinite`` at ``output`` where the forward went non-finite (see above)."""
    bad = [s for s in log.steps if not (isinstance(s.get("loss"), float) and np.isfinite(s["loss"]))
           and (s.get("first_nonfinite") or {}).get("where") != "output"]
    if not bad:
        return log
    first = bad[0]["step"]
    path = _first_nonfinite_output(model, np.asarray(cycle.batches[first % cycle.steps][0]))
    if path is None:
        return log
    steps = [dict(s, first_nonfinite={"path": path, "where": "output"}) if s is bad[0] else s for s in log.steps]
    return RunLog(log.header, steps, log.source, log.end, log.problem)


def tune(model: Any, policy: Policy | str | Path, data: Iterable[Any], loss: Any, *, steps: int = 8,
         dtypes: Iterable[str] | None = None, optimizer: Callable[[], Any] | None = None,
         seed: int = 0, progress: Callable[[str], None] | None = None,
         tolerance: float = TOLERANCE) -> TuneResult:
    """The pins ``policy`` needs on a tf_keras ``model``, found from ``steps`` ``fit`` steps on clones.

    As Keras 3's ``ampbridge.keras.tune``: ``data`` ``(x, y)`` batches of one size (the first
    ``steps``, cycled if there are fewer); ``loss`` what ``compile`` accepts; ``optimizer()`` each
    run's inner tf_keras optimizer (default Adam, lr 1e-3; ``ampbridge.tf_keras.optimizer`` wraps
    it). Every run clones the model (``clone_model`` and its weights; ``apply`` rebuilds the clone):
    the model and its weights stay as they were. Each run starts with
    ``tf_keras.utils.set_random_seed(seed)``.

    Example:
        >>> import numpy as np, tf_keras, ampbridge
        >>> small = tf_keras.initializers.Constant(0.01)  # fixed weights: float16 gradients that fit its range
        >>> m = tf_keras.Sequential([tf_keras.Input((4,)), tf_keras.layers.Dense(1, name="head", kernel_initializer=small)])
        >>> data = [(np.ones((8, 4), "float32"), np.zeros((8, 1), "float32"))]
        >>> ampbridge.tf_keras.tune(m, "mixed_float16", data, "mse", steps=2).added
        ()
    """
    if not isinstance(model, tf_keras.Model):
        raise TypeError(f"tune takes a tf_keras model; received {type(model).__qualname__}")
    cycle = StepCycle.of(data, steps)
    x, y, batch_size = stack_batches(cycle.batches, "tf_keras")
    make_opt = optimizer or (lambda: tf_keras.optimizers.Adam(1e-3))
    with tempfile.TemporaryDirectory(prefix="ampbridge-tune-") as tmp:
        count = iter(range(1 << 30))

        def run(p: Policy) -> RunLog:
            path = Path(tmp) / f"run{next(count)}.jsonl"
            work = apply(clone_keras_model(tf_keras, model), p, warn=False)
            work.compile(optimizer=scaled_optimizer(make_opt(), p), loss=loss)
            tf_keras.utils.set_random_seed(seed)
            with Monitor(path, work, every=1) as monitor:
                work.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
            return _attributed(read_log(path), work, cycle)

        return tune_policy(as_policy(policy), run, dtypes=dtypes, framework="tf_keras", steps=steps,
                           progress=progress, tolerance=tolerance)

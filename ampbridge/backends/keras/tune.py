"""``tune`` for Keras: a few ``fit`` steps of a clone of the model in float32 and under the policy,
through ``apply``, ``optimizer`` and ``MonitorCallback``; the search is ``ampbridge.diagnostics.tune``."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import keras

from ...core.policy import Policy
from ...diagnostics.runlog import RunLog, read_log
from ...diagnostics.tune import TOLERANCE, StepCycle, TuneResult, tune_policy
from ..common import as_policy, clone_keras_model, stack_batches
from .apply import apply
from .loss_scale import optimizer as scaled_optimizer
from .monitor import MonitorCallback

__all__ = ["tune"]




def tune(model: Any, policy: Policy | str | Path, data: Iterable[Any], loss: Any, *, steps: int = 8,
         dtypes: Iterable[str] | None = None, optimizer: Callable[[], Any] | None = None,
         seed: int = 0, progress: Callable[[str], None] | None = None,
         tolerance: float = TOLERANCE) -> TuneResult:
    """The pins ``policy`` needs on ``model``, found from ``steps`` ``fit`` steps on clones.

    ``data``: ``(x, y)`` batches of one size (the first ``steps``, cycled if there are fewer);
    ``loss``: what ``compile`` accepts. ``optimizer()`` builds each run's inner optimizer (default
    Adam, lr 1e-3; ampbridge's loss scaling wraps it). The model is cloned
    (``keras.models.clone_model`` and its weights) for every run: it and its weights stay as they were.
    Each run starts with ``keras.utils.set_random_seed(seed)`` (the same dropout in every run; this
    seeds Python's, NumPy's and the Keras backend's global generators).
    """
    cycle = StepCycle.of(data, steps)
    x, y, batch_size = stack_batches(cycle.batches, "Keras")
    make_opt = optimizer or (lambda: keras.optimizers.Adam(1e-3))
    with tempfile.TemporaryDirectory(prefix="ampbridge-tune-") as tmp:
        count = iter(range(1 << 30))

        def run(p: Policy) -> RunLog:
            path = Path(tmp) / f"run{next(count)}.jsonl"
            work = apply(clone_keras_model(keras, model), p, warn=False)
            work.compile(optimizer=scaled_optimizer(make_opt(), p), loss=loss)
            callback = MonitorCallback(path, every=1)
            keras.utils.set_random_seed(seed)
            work.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
            callback.close()
            return read_log(path)

        return tune_policy(as_policy(policy), run, dtypes=dtypes, framework="keras", steps=steps, progress=progress,
                           tolerance=tolerance)

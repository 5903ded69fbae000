"""The numerics monitor for tf.keras 2: per-layer gradient statistics and non-finite steps, written as
the shared run log (``ampbridge.diagnostics.runlog``; ``ampbridge report`` reads it), as a ``fit`` callback.

Names: ``Monitor``; ``_layer_row`` (one layer's statistics in TensorFlow ops).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras

from ...core.dtypes import formats
from ...core.io import policy_to_dict
from ...diagnostics.runlog import STAT_KEYS, RunLogWriter
from ...errors import UnsupportedOptionError
from .layers import walk
from .plan import plan


def _layer_row(grads: list[Any], scale: Any, compute_dtype: str) -> Any:
    """``STAT_KEYS`` of one layer's unscaled gradients ``u`` (the scaled ones are ``u * scale``), as
    ``runlog.layer_stats`` defines them, in float32 TensorFlow ops (inside the train step)."""
    fmt = formats()[compute_dtype]
    u = tf.concat([tf.reshape(tf.cast(g, tf.float32), [-1]) for g in grads], 0)
    n = tf.cast(tf.maximum(tf.size(u), 1), tf.float32)
    finite = tf.math.is_finite(u)
    fu = tf.where(finite, u, tf.zeros_like(u))
    count = tf.reduce_sum(tf.cast(finite, tf.float32))
    nan = tf.constant(np.nan, tf.float32)
    frac = lambda mask: tf.reduce_sum(tf.cast(mask, tf.float32)) / n  # noqa: E731
    top = tf.reduce_max(tf.abs(fu))
    unit = tf.where(top > 0, fu / tf.where(top > 0, top, 1.0), fu)  # squares of huge gradients stay finite
    return tf.stack([
        tf.where(count > 0, top, nan),
        tf.where(count > 0, top * tf.sqrt(tf.reduce_sum(unit * unit) / tf.maximum(count, 1.0)), nan),
        frac(tf.equal(u, 0.0)),
        frac(tf.logical_not(finite)),
        frac(finite & tf.not_equal(u, 0.0) & (tf.abs(fu) < fmt.smallest_subnormal)),
        frac(finite & (tf.abs(fu) * scale > fmt.max)),
    ])


class Monitor(tf_keras.callbacks.Callback):
    """The numerics log of a tf_keras model trained with ``fit`` and :func:`~ampbridge.tf_keras.optimizer`.

    Pass it to ``fit(callbacks=[monitor])``, or call :meth:`record` after each step of a custom loop
    (``get_scaled_loss`` / ``get_unscaled_gradients`` / ``apply_gradients``; made before the loop's
    ``tf.function`` is traced). It writes a header, a record for every ``every``-th
    step (step 0 included) with each layer's gradient statistics, and a record for every step
    whose gradients were non-finite; ``fit``'s end writes a closing record (:meth:`close` too, and
    the ``with`` block's end).
    The statistics are computed inside the train step from the unscaled gradients the
    ``LossScaleOptimizer`` applies (its ``apply_gradients`` is wrapped on this instance; unsampled
    finite steps compute none of them); the step's loss from the model's ``compute_loss``.
    ``attribution``: a non-finite step names the last layer in forward order whose own
    gradients are non-finite (the first the backward pass reached; ``where: gradient``).
    Made once the model is applied, built and compiled; ``fit`` retraces its train step once.

    Example:
        >>> import os, tempfile, numpy as np, tf_keras, ampbridge
        >>> policy = ampbridge.preset("mixed_float16")
        >>> m = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2, name="dense")])
        >>> m = ampbridge.tf_keras.apply(m, policy)
        >>> m.compile(ampbridge.tf_keras.optimizer(tf_keras.optimizers.SGD(), policy), "mse")
        >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> with Monitor(path, m, every=10) as monitor:
        ...     _ = m.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0, callbacks=[monitor])
        >>> ampbridge.diagnostics.runlog.read_log(path).steps[0]["layers"]["dense"]["zero"]
        0.0
    """

    def __init__(self, path: Any, model: Any, *, every: int = 1, attribution: bool = True):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Monitor: every must be a positive integer (log every N-th step); received every={every!r}")
        if not isinstance(model, tf_keras.Model):
            raise TypeError(f"Monitor: expected a tf_keras model; received {type(model).__qualname__}")
        policy = getattr(model, "_ampbridge_policy", None)
        if policy is None:
            raise ValueError("Monitor: the model was not made by ampbridge.tf_keras.apply (the Plan it runs is unknown)")
        opt = getattr(model, "optimizer", None)
        if not isinstance(opt, tf_keras.mixed_precision.LossScaleOptimizer):
            raise UnsupportedOptionError("Monitor needs the model compiled with a LossScaleOptimizer (it reads the scale): "
                                         "ampbridge.tf_keras.optimizer(inner, policy); received "
                                         f"{type(opt).__name__}")
        if not model.built:
            raise ValueError("Monitor: build the model first (call it on data, or give it an Input)")
        # the model's strategy (a Monitor made outside strategy.scope() too): its variables are made there
        strategy = model.distribute_strategy
        self._replicas = strategy.num_replicas_in_sync
        self.path, self.every, self.attribution, self.model_ = path, every, attribution, model
        self.policy = policy.at(step=0, epoch=0)
        rows = plan(model, self.policy, warn=False).rows
        self._groups = self._variables_by_layer(model, {r.path: r.compute_dtype for r in rows})
        self.layers = [r.path for r in rows if r.path]
        self._seen, self._first, self._last, self._skipped, self._ended_at = 0, None, None, 0, None
        # under several replicas: the statistics come from the all-reduced gradients (every replica holds the
        # same: the first one's is written); the loss is each replica's share of the global loss (summed)
        first, total = tf.VariableAggregation.ONLY_FIRST_REPLICA, tf.VariableAggregation.SUM
        with tf.init_scope(), strategy.scope():
            self._sample = tf.Variable(True, trainable=False, name="ampbridge_monitor_sample", aggregation=first)
            self._found_inf = tf.Variable(False, trainable=False, name="ampbridge_monitor_found_inf", aggregation=first)
            self._loss = tf.Variable(np.nan, dtype=tf.float32, trainable=False, name="ampbridge_monitor_loss",
                                     aggregation=total)
            self._stats = tf.Variable(np.zeros((max(len(self._groups), 1), len(STAT_KEYS)), np.float32),
                                      trainable=False, name="ampbridge_monitor_stats", aggregation=first)
        self._wrap(model, opt)
        self._scale_used = float(opt.loss_scale.numpy())  # a custom loop's first step (fit's reads it again)
        cfg = self.policy.resolved_loss_scale
        self._skips = cfg.skip_nonfinite
        self._writer = RunLogWriter(path, framework="tf_keras", compute_dtype=self.policy.compute_dtype,
                                    layers=self.layers, policy=policy_to_dict(self.policy), min_scale=cfg.min_scale,
                                    extra={"every": every, "attribution": attribution,
                                           "pinned": {r.path: r.rule for r in rows if r.path and r.rule != "default"
                                                      and r.compute_dtype == "float32" != self.policy.compute_dtype}})

    @staticmethod
    def _variables_by_layer(model: Any, dtypes: dict[str, str]) -> list[tuple[str, str, set[int]]]:
        """``(path, compute dtype, ids of the trainable variables the layer itself owns)``, tree order."""
        owner: dict[int, str] = {}
        for path, layer in walk(model):  # parents first: a deeper layer takes its own variables over
            for v in layer.trainable_weights:
                owner[id(v)] = path
        groups = []
        for path, _ in walk(model):
            ids = {i for i, p in owner.items() if p == path}
            if ids:
                groups.append((path, dtypes.get(path, "float32"), ids))
        return groups

    def _wrap(self, model: Any, opt: Any) -> None:
        """Wrap this optimizer's ``apply_gradients`` and this model's ``compute_loss`` (instance
        attributes: the classes and other instances stay as they are) and drop the traced step."""
        apply_gradients, compute_loss = opt.apply_gradients, model.compute_loss

        def observed_apply(grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
            grads_and_vars = list(grads_and_vars)
            seen = grads_and_vars
            aggregate = not (args[0] if args else kwargs.get("skip_gradients_aggregation", False)) and kwargs.get(
                "experimental_aggregate_gradients", True)
            if self._replicas > 1 and aggregate:
                # what the optimizer applies: the gradients all-reduced, as its apply_gradients does it next
                seen = opt.inner_optimizer.aggregate_gradients(grads_and_vars)
            self._observe(list(seen), opt.loss_scale)
            return apply_gradients(grads_and_vars, *args, **kwargs)

        def observed_loss(*args: Any, **kwargs: Any) -> Any:
            loss = compute_loss(*args, **kwargs)
            self._loss.assign(tf.cast(loss, tf.float32))
            return loss

        opt.apply_gradients, model.compute_loss = observed_apply, observed_loss
        model.train_function = None  # fit traces its step again, with the wrappers

    def _observe(self, grads_and_vars: list[Any], scale: Any) -> None:
        grads = {id(v): g for g, v in grads_and_vars if g is not None}
        flat = list(grads.values())
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in flat]) if flat else tf.constant(True)
        self._found_inf.assign(tf.logical_not(finite))
        groups = [(dtype, [grads[i] for i in ids if i in grads]) for _, dtype, ids in self._groups]
        if not any(g for _, g in groups):
            return

        def compute() -> Any:
            rows = [_layer_row(g, scale, dtype) if g else tf.fill([len(STAT_KEYS)], np.nan) for dtype, g in groups]
            return tf.stack(rows)

        self._stats.assign(tf.cond(self._sample | tf.logical_not(finite), compute, self._stats.read_value))

    # --- the host side, once per step ---------------------------------------------------------------

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._sample.assign(self._seen % self.every == 0)
        self._scale_used = float(self.model_.optimizer.loss_scale.numpy())

    def record(self, loss: Any = None) -> None:
        """A custom loop's step: call it after each ``optimizer.apply_gradients`` (the step's loss
        given here, as the loop does not call ``compute_loss``). The step logs as in ``fit``."""
        if loss is not None:
            self._loss.assign(tf.cast(loss, tf.float32))
        self.on_train_batch_end(self._seen)
        self.on_train_batch_begin(self._seen)  # the next step's sampling and the scale it will use

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        step, found_inf = self._seen, bool(self._found_inf.numpy())
        self._seen += 1
        self._first = step if self._first is None else self._first
        self._last = step
        if not found_inf and step % self.every:
            return
        stats = self._stats.numpy()
        layers = {path: dict(zip(STAT_KEYS, map(float, stats[k]))) for k, (path, _, _) in enumerate(self._groups)}
        first = None
        if found_inf and self.attribution:
            bad = [path for path, _, _ in self._groups if not np.isfinite(layers[path]["nonfinite"])
                   or layers[path]["nonfinite"] > 0]
            first = {"path": bad[-1], "where": "gradient"} if bad else None
        skipped = found_inf and self._skips
        self._skipped += skipped
        self._writer.step(step, loss=float(self._loss.numpy()), loss_scale=self._scale_used, found_inf=found_inf,
                          skipped=skipped, layers=layers, first_nonfinite=first)

    def on_train_end(self, logs: Any = None) -> None:
        if not self._writer.closed and self._ended_at != self._seen:  # nothing new since the last: no second record
            self._ended_at = self._seen
            self._writer.end(self._seen, first_step=self._first, last_step=self._last, skipped=self._skipped)

    def close(self) -> None:
        """Write the closing record (the totals so far) and close the log."""
        self.on_train_end()
        self._writer.close()

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

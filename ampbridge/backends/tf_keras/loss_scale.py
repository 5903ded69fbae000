"""The loss scaler: Keras 2's ``tf_keras.mixed_precision.LossScaleOptimizer``, running Keras 2's
own dynamic algorithm where it is the policy's, and the core's reference algorithm otherwise.

Keras 2's dynamic loss scale (``_DynamicLossScaleState.update`` in
``tf_keras/src/mixed_precision/loss_scale_optimizer.py``, tf-keras 2.21) grows x2 after
``dynamic_growth_steps`` finite steps (not to inf), halves on a non-finite step with a floor of 1,
and skips that step: the reference algorithm with growth 2, backoff 0.5, hysteresis 1 and
``min_scale = 1``. Every other setting runs on ``ReferenceState``, which replaces that state
object inside the same optimizer (``fit``, ``get_scaled_loss`` / ``get_unscaled_gradients`` and
checkpoints work as with Keras 2's own).

Names: ``optimizer``, ``keras2_expressible``; ``ReferenceState``, ``_refusals``, ``_PolicyRecord``.
"""

from __future__ import annotations

import json
from typing import Any

import tensorflow as tf
import tf_keras
from tf_keras.src.mixed_precision import loss_scale_optimizer as _lso

from ...core.loss_scale import f32, initial_state, restart_count
from ...core.policy import LossScaleConfig, Policy
from ...errors import UnsupportedOptionError
from .environment import resolve_policy


def keras2_expressible(config: LossScaleConfig) -> bool:
    """Whether Keras 2's own ``LossScaleOptimizer(initial_scale, dynamic_growth_steps)`` runs
    ``config`` as the reference does: dynamic, x2, x0.5, no hysteresis, a floor of exactly 1, no
    ceiling, non-finite steps skipped.

    Example:
        >>> from ampbridge import LossScaleConfig
        >>> keras2_expressible(LossScaleConfig(mode="dynamic", initial_scale=1024.0, growth_interval=4, min_scale=1.0))
        True
        >>> keras2_expressible(LossScaleConfig(mode="dynamic"))  # no floor: Keras 2 stops halving at 1
        False
    """
    return (config.mode == "dynamic" and config.growth_factor == 2.0 and config.backoff_factor == 0.5
            and config.hysteresis == 1 and config.min_scale == 1.0 and config.max_scale is None
            and config.skip_nonfinite and restart_count(config) == 0 and config.max_consecutive_skips is None)


def _refusals(config: LossScaleConfig) -> list[str]:
    """The settings neither Keras 2 nor :class:`ReferenceState` realise, by name."""
    out = []
    if config.on_min_scale != "clamp":
        out.append(f"on_min_scale={config.on_min_scale!r} (accepted with tf_keras: 'clamp')")
    if config.max_consecutive_skips is not None:
        out.append(f"max_consecutive_skips={config.max_consecutive_skips} (accepted with tf_keras: unset)")
    if restart_count(config):
        out.append(f"first_growth_interval={config.first_growth_interval} (accepted with tf_keras: unset)")
    return out


class ReferenceState(_lso._DynamicLossScaleState):
    """Keras 2's loss-scale state object running the core's reference algorithm in TensorFlow ops:
    any growth and backoff factor, hysteresis, ``consecutive_hysteresis``, min and max scale, static
    and none modes, ``skip_nonfinite``. Its variables (``current_loss_scale``, ``good_steps``, plus
    ``hysteresis_left``, ``steps``, ``skipped``) are the optimizer's checkpoint children."""

    def __init__(self, config: LossScaleConfig):
        start = initial_state(config)
        super().__init__(start.scale, max(config.growth_interval, 1), multiplier=f32(config.growth_factor))
        self.config = config
        self.hysteresis_left = self._add_weight("hysteresis_left", dtype=tf.int64, initial_value=start.hysteresis_left)
        self.steps = self._add_weight("steps", dtype=tf.int64, initial_value=0)
        self.skipped = self._add_weight("skipped", dtype=tf.int64, initial_value=0)

    def _found_finite(self, grads: Any) -> Any:
        grads = tf.nest.flatten(grads)
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            # every replica holds the same all-reduced gradients (as Keras 2's own update reads them)
            strategy = tf.distribute.get_strategy()
            per_replica = strategy.extended.call_for_each_replica(_lso._is_all_finite, args=(grads,))
            return strategy.experimental_local_results(per_replica)[0]
        return _lso._is_all_finite(grads)

    def update(self, grads: Any) -> tuple[Any, Any]:
        cfg = self.config
        finite = self._found_finite(grads)
        scale, good, hyst = self.current_loss_scale, self.counter, self.hysteresis_left
        new_scale, new_good, new_hyst = tf.identity(scale), tf.identity(good), tf.identity(hyst)
        if cfg.mode == "dynamic":
            # the finite branch
            grown_good = good + 1
            hyst_f = tf.constant(cfg.hysteresis, tf.int64) if cfg.consecutive_hysteresis else hyst
            grow = tf.equal(grown_good, cfg.growth_interval)
            grown = scale * f32(cfg.growth_factor)
            if cfg.max_scale is not None:
                grown = tf.where(tf.math.is_finite(grown), tf.minimum(grown, f32(cfg.max_scale)), grown)
            scale_f = tf.where(grow & tf.math.is_finite(grown), grown, scale)
            if not cfg.consecutive_hysteresis:
                hyst_f = tf.where(grow, tf.constant(cfg.hysteresis, tf.int64), hyst_f)
            good_f = tf.where(grow, tf.constant(0, tf.int64), grown_good)
            # the non-finite branch
            back = hyst <= 1
            backed = scale * f32(cfg.backoff_factor)
            if cfg.min_scale is not None:
                backed = tf.maximum(backed, f32(cfg.min_scale))
            scale_n = tf.where(back, backed, scale)
            hyst_n = tf.where(back, hyst, hyst - 1)
            new_scale = tf.where(finite, scale_f, scale_n)
            new_good = tf.where(finite, good_f, tf.constant(0, tf.int64))
            new_hyst = tf.where(finite, hyst_f, hyst_n)
        update = tf.group(
            self.current_loss_scale.assign(new_scale), self.counter.assign(new_good),
            self.hysteresis_left.assign(new_hyst), self.steps.assign_add(1),
            self.skipped.assign_add(tf.cast(tf.logical_not(finite) & cfg.skip_nonfinite, tf.int64)))
        with tf.control_dependencies([update]):
            should_apply = tf.identity(finite) if cfg.skip_nonfinite else tf.constant(True)
        return None if tf.executing_eagerly() else update, should_apply


class _PolicyRecord(tf.Module):
    """The policy an optimizer was made with, as a string variable under the optimizer's checkpoint key
    ``ampbridge_policy``: a SavedModel (and ``tf.train.Checkpoint``) keeps it, so
    :func:`ampbridge.tf_keras.load_model` finds it; Keras 2 itself ignores it."""

    def __init__(self, policy: Policy):
        super().__init__(name="ampbridge_policy")
        with tf.init_scope():
            self.policy = tf.Variable(json.dumps(policy.to_dict()), dtype=tf.string, trainable=False, name="policy")


def optimizer(inner: Any, policy: Policy | str) -> Any:
    """``tf_keras.mixed_precision.LossScaleOptimizer`` wrapping ``inner`` (a tf_keras optimizer or its
    name) with the policy's loss-scale settings (its first phase's, ``auto`` resolved).

    Keras 2's own algorithm where :func:`keras2_expressible`; otherwise the same class with
    :class:`ReferenceState` in place of Keras 2's state. ``on_min_scale`` other than ``clamp``,
    ``max_consecutive_skips`` and ``first_growth_interval`` are refused by name.

    Example:
        >>> import ampbridge, tf_keras
        >>> from ampbridge import LossScaleConfig
        >>> p = ampbridge.preset("mixed_float16").replace(loss_scale=LossScaleConfig(
        ...     mode="dynamic", initial_scale=1024.0, growth_interval=4, min_scale=1.0))
        >>> opt = optimizer(tf_keras.optimizers.SGD(0.1), p)
        >>> type(opt).__name__, opt.initial_scale, opt.dynamic_growth_steps
        ('LossScaleOptimizerV3', 1024.0, 4)
    """
    policy, _ = resolve_policy(policy)
    active = policy.at(step=0, epoch=0)
    config = active.resolved_loss_scale
    refused = _refusals(config)
    if refused:
        raise UnsupportedOptionError(f"[loss_scale] {'; '.join(refused)}: Keras 2's LossScaleOptimizer "
                                     "and ampbridge's tf_keras scaler do not realise these")
    inner = tf_keras.optimizers.get(inner)
    if isinstance(inner, tf_keras.mixed_precision.LossScaleOptimizer):
        raise TypeError(f"optimizer() wraps a plain tf_keras optimizer; received a {type(inner).__name__}, "
                        "which already scales the loss (pass its inner_optimizer)")
    if active.reduce_dtype != active.param_dtype and tf.distribute.get_strategy().num_replicas_in_sync > 1:
        raise UnsupportedOptionError(
            f"reduce_dtype={active.reduce_dtype} with param_dtype={active.param_dtype}: Keras 2 all-reduces "
            "gradients in the variables' dtype; set reduce_dtype to the param_dtype")
    start = initial_state(config)
    opt = tf_keras.mixed_precision.LossScaleOptimizer(
        inner, dynamic=True, initial_scale=start.scale, dynamic_growth_steps=max(config.growth_interval, 1))
    return equip(opt, policy)


def equip(opt: Any, policy: Policy) -> Any:
    """``opt`` (a Keras 2 ``LossScaleOptimizer`` with the policy's initial scale and growth steps) made to
    run the policy: the reference state in place of Keras 2's where Keras 2's algorithm is not the
    policy's, and the policy recorded under the optimizer's checkpoint key ``ampbridge_policy``."""
    config = policy.at(step=0, epoch=0).resolved_loss_scale
    # a schedule whose phases change the settings runs on the reference state (PhaseCallback switches them)
    same = all(phase.policy.resolved_loss_scale == config for phase in policy.phases) and (
        not policy.phases or policy.replace(phases=()).resolved_loss_scale == config)
    if not (keras2_expressible(config) and same):
        state = ReferenceState(config)
        opt._loss_scale = state  # private: the state object Keras 2's apply_gradients asks (tf-keras 2.21)
        opt._track_trackable(state, "loss_scale", overwrite=True)
    opt._track_trackable(_PolicyRecord(policy), "ampbridge_policy", overwrite=True)
    return opt


def state_of(opt: Any) -> dict[str, float | int]:
    """The loss-scale state of an optimizer :func:`optimizer` made, as plain numbers (the core's
    ``LossScaleState`` fields that exist there: Keras 2's own state has scale and good steps only)."""
    inner_state = opt._loss_scale
    out: dict[str, float | int] = {"scale": float(opt.loss_scale.numpy()), "good_steps": int(opt.dynamic_counter.numpy())}
    if isinstance(inner_state, ReferenceState):
        out.update(hysteresis_left=int(inner_state.hysteresis_left.numpy()), steps=int(inner_state.steps.numpy()),
                   skipped=int(inner_state.skipped.numpy()))
    return out

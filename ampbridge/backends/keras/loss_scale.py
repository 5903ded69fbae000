"""The loss scaler: Keras's ``LossScaleOptimizer`` running the core's reference algorithm in
``keras.ops`` (and computing the monitor's record when one is attached), and its ``fit`` callback.

Names: ``LossScaleOptimizer``, ``optimizer``, ``LossScaleCallback``; ``_replicas``, ``_model_of``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import keras
import numpy as np
from keras import ops

from ...core.loss_scale import LossScaleState, f32, initial_state
from ...core.policy import LossScaleConfig, Policy
from ...errors import AmpBridgeWarning, LossScaleError, UnsupportedOptionError
from .environment import _backend, _phase0, resolve_policy
from .numerics import _HEAD_SIZE, _ROW_SIZE, _all, _grad_stats, _host, _MonitorSpec, _split_count

# --- the loss-scaling optimizer ---------------------------------------------------------------

def _config_from(value: LossScaleConfig | dict[str, Any]) -> LossScaleConfig:
    cfg = value if isinstance(value, LossScaleConfig) else LossScaleConfig(**value)
    if cfg.mode == "auto":
        raise ValueError("resolve loss_scale mode 'auto' first: LossScaleConfig.resolve(compute_dtype)")
    return cfg


def _concrete(x: Any) -> bool:
    """Whether ``x`` has a value now (eager), not inside a traced tf.function or jax.jit."""
    backend = _backend()
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    return True


@keras.saving.register_keras_serializable(package="ampbridge")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras's ``LossScaleOptimizer`` running ampbridge's reference loss-scale algorithm.

    Every setting of ``[loss_scale]`` is honoured (growth and backoff factors, interval,
    hysteresis, ``consecutive_hysteresis``, min/max, ``on_min_scale``, static and none modes,
    ``skip_nonfinite``), in backend-agnostic ``keras.ops``, for ``fit`` on every backend
    (``scale_loss`` / ``apply`` / ``stateless_apply``) and for custom loops. A skipped step
    leaves the weights and the inner optimizer's variables untouched. The state (all five
    reference fields, plus the count of overflows at ``min_scale``) is optimizer variables,
    so ``model.save`` / checkpoints carry it. Build one with :func:`optimizer`.

    ``on_min_scale = "warn" | "error"`` needs the host to look at the state after a step:
    eager steps check it themselves; under a compiled ``fit`` pass
    ``callbacks=[ampbridge.keras.LossScaleCallback()]`` (or a :class:`PhaseCallback`); a compiled
    custom loop sets ``optimizer.host_checked = True`` and calls ``optimizer.check_min_scale()``
    after each step. Tracing without either is an error rather than a silently ignored setting.
    """

    def __init__(self, inner_optimizer: Any, loss_scale: LossScaleConfig | dict[str, Any] | None = None,
                 policy: Policy | dict[str, Any] | None = None, name: str | None = None, **kwargs: Any):
        cfg = _config_from(loss_scale if loss_scale is not None else LossScaleConfig(mode="dynamic"))
        start = initial_state(cfg)
        super().__init__(inner_optimizer, initial_scale=start.scale,
                         dynamic_growth_steps=cfg.growth_interval, name=name, **kwargs)
        # the policy rides along (in get_config, so in .keras files) for load_model to re-apply
        self.policy = Policy.from_dict(policy) if isinstance(policy, dict) else policy
        self._config = cfg
        self.host_checked = False
        self._overflows_seen = 0
        self._jitted_apply = None
        self._monitor: _MonitorSpec | None = None  # set by ampbridge.keras.Monitor
        self._monitor_variables: list[Any] = []
        self._monitor_cache: tuple[tuple[int, ...], Any] | None = None

    # --- configuration ---

    @property
    def loss_scale_config(self) -> LossScaleConfig:
        """The resolved loss-scale settings in force."""
        return self._config

    def set_loss_scale_config(self, config: LossScaleConfig, *, reset: bool = False) -> None:
        """Switch settings (a phase boundary); the state moves by the core's rule
        (:func:`ampbridge.core.loss_scale.enter_phase`, the same in every backend): carried over
        between dynamic phases, within the new bounds; fresh, step counters kept, on ``reset`` or
        any other change. Rebuild traced train functions afterwards (:class:`PhaseCallback` does)."""
        from ...core.loss_scale import enter_phase

        config = _config_from(config)
        previous, before = self._config, self.state if self.built else None
        self._config = config
        self._jitted_apply = None  # the settings are baked into the compiled step
        self.initial_scale = initial_state(config).scale
        self.dynamic_growth_steps = config.growth_interval
        if before is not None:
            self.set_state(enter_phase(config, before, previous=previous, reset=reset))

    # --- state ---

    def build(self, var_list: Any) -> None:
        super().build(var_list)  # step_counter (= good_steps), dynamic_scale, inner optimizer
        from keras.src.utils import tracking

        @tracking.no_automatic_dependency_tracking
        def extra() -> None:
            start = initial_state(self._config)
            self.dynamic_scale.assign(np.float32(start.scale))
            for attr, init in (("hysteresis_left", start.hysteresis_left), ("loss_scale_steps", 0),
                               ("skipped_steps", 0), ("min_scale_overflows", 0)):
                setattr(self, attr, self.add_variable(
                    shape=(), dtype="int32", initializer=keras.initializers.Constant(init),
                    aggregation="none", name=attr))

        extra()
        if self._monitor is not None:
            self._build_monitor_variables()

    @property
    def _state_variables(self) -> list[Any]:
        # good_steps, scale, hysteresis_left, steps, skipped, overflows at min_scale
        return [self.step_counter, self.dynamic_scale, self.hysteresis_left, self.loss_scale_steps,
                self.skipped_steps, self.min_scale_overflows]

    @property
    def state(self) -> LossScaleState:
        """The loss-scale state as the core's :class:`ampbridge.LossScaleState` (reads values)."""
        if not self.built:
            return initial_state(self._config)
        own = [_host(v) for v in self._state_variables[:5]]
        return LossScaleState(scale=float(own[1]), good_steps=int(own[0]), hysteresis_left=int(own[2]),
                              steps=int(own[3]), skipped=int(own[4]))

    def set_state(self, state: LossScaleState) -> None:
        """Overwrite the loss-scale state (all five fields)."""
        if not self.built:
            raise ValueError("build the optimizer first: optimizer.build(model.trainable_variables)")
        for v, x in zip(self._state_variables[:5], (state.good_steps, np.float32(state.scale),
                                              state.hysteresis_left, state.steps, state.skipped)):
            v.assign(x)

    @property
    def scale(self) -> Any:
        """The current loss scale (a float32 tensor once built)."""
        return self.dynamic_scale if self.built else self.initial_scale

    def scale_loss(self, loss: Any) -> Any:
        if self._config.mode == "none":
            return loss
        return super().scale_loss(loss)

    # --- the algorithm, in keras.ops (the same numbers as ampbridge.core.loss_scale.next_state) ---

    def _next_state(self, own: list[Any], found_inf: Any) -> list[Any]:
        cfg = self._config
        good, scale, hyst, steps, skipped, overflows = own
        one = ops.cast(1, "int32")
        inf_i = ops.cast(found_inf, "int32")
        steps_new = ops.add(steps, one)
        skipped_new = ops.add(skipped, inf_i) if cfg.skip_nonfinite else skipped
        if cfg.mode != "dynamic":
            return [good, scale, hyst, steps_new, skipped_new, overflows]
        backoff_now = ops.logical_and(found_inf, ops.less_equal(hyst, 1))
        backed = ops.multiply(scale, np.float32(f32(cfg.backoff_factor)))
        if cfg.min_scale is not None:
            lo = np.float32(f32(cfg.min_scale))
            at_min = ops.logical_and(backoff_now, ops.equal(scale, lo))
            backed = ops.maximum(backed, lo)
        good_plus = ops.add(good, one)
        grow = ops.logical_and(ops.logical_not(found_inf), ops.equal(good_plus, cfg.growth_interval))
        candidate = ops.multiply(scale, np.float32(f32(cfg.growth_factor)))
        grown = candidate if cfg.max_scale is None else ops.minimum(candidate, np.float32(f32(cfg.max_scale)))
        grown = ops.where(ops.isfinite(candidate), grown, scale)
        scale_new = ops.where(found_inf, ops.where(backoff_now, backed, scale), ops.where(grow, grown, scale))
        good_new = ops.where(ops.logical_or(found_inf, grow), ops.zeros_like(good), good_plus)
        hyst_on_inf = ops.where(backoff_now, hyst, ops.subtract(hyst, one))
        refill = ops.full_like(hyst, cfg.hysteresis)
        hyst_on_ok = refill if cfg.consecutive_hysteresis else ops.where(grow, refill, hyst)
        hyst_new = ops.where(found_inf, hyst_on_inf, hyst_on_ok)
        new = [good_new, scale_new, hyst_new, steps_new, skipped_new, overflows]
        if cfg.min_scale is not None:
            if cfg.on_min_scale == "error":
                # the reference raises before changing anything: keep the step's state as it was
                new = [ops.where(at_min, old, n) for old, n in zip(own[:5], new[:5])] + [overflows]
            new[5] = ops.add(overflows, ops.cast(at_min, "int32"))
        return new

    def _unscale(self, grads: list[Any], scale: Any) -> list[Any]:
        if self._config.mode == "none":
            return list(grads)
        return [g if g is None or self._overwrite_variable_with_gradient(v) else ops.divide(g, scale)
                for g, v in zip(grads, self._trainable_variables)]

    def _needs_host_check(self) -> bool:
        return self._config.min_scale is not None and self._config.on_min_scale in ("warn", "error")

    def _guard_traced(self, x: Any) -> None:
        if self._needs_host_check() and not _concrete(x) and not self.host_checked:
            raise UnsupportedOptionError(
                f"loss_scale.on_min_scale={self._config.on_min_scale!r} needs a host-side check after each "
                "compiled step: pass callbacks=[ampbridge.keras.LossScaleCallback()] to fit (a PhaseCallback "
                "does it too), or run_eagerly=True; in a compiled custom loop set optimizer.host_checked = "
                "True and call optimizer.check_min_scale() after each step")

    def check_min_scale(self, overflows: Any = None) -> None:
        """Warn (once) or raise :class:`ampbridge.LossScaleError` if a step overflowed at
        ``min_scale`` since the last check (``on_min_scale`` decides). Reads a variable: a host
        sync; eager steps call it themselves."""
        if not self._needs_host_check() or not self.built:
            return
        if overflows is None:
            overflows = self.min_scale_overflows.value
        count = int(_host(overflows))
        if count <= self._overflows_seen:
            return
        first = self._overflows_seen == 0
        self._overflows_seen = count
        message = (f"loss scale overflowed at min_scale={self._config.min_scale} "
                   f"({count} time{'s' if count > 1 else ''} so far)")
        if self._config.on_min_scale == "error":
            raise LossScaleError(message + "; on_min_scale='error' stops the run")
        if first:
            warnings.warn(message + "; gradients still overflow at the floor", AmpBridgeWarning, stacklevel=3)

    # --- stateful apply (TensorFlow, torch; JAX goes through stateless_apply) ---

    def _apply_inner(self, grads: Any, trainable_variables: Any, scale: Any) -> None:
        self.inner_optimizer.apply(self._unscale(grads, scale), trainable_variables=trainable_variables)

    def _own_values(self) -> list[Any]:
        return [v.value for v in self._state_variables]

    def _assign_own(self, values: list[Any]) -> None:
        for v, x in zip(self._state_variables, values):
            v.assign(x)

    def _stateful_handle_finite_grads(self, grads: Any, trainable_variables: Any) -> None:
        own = self._own_values()
        self._apply_inner(grads, trainable_variables, own[1])
        self._assign_own(self._next_state(own, ops.convert_to_tensor(False)))

    def _stateful_handle_non_finite_grads(self) -> None:
        if not self._config.skip_nonfinite:
            raise UnsupportedOptionError("loss_scale.skip_nonfinite=false is not supported with a "
                                         "tf.distribute strategy that needs merge_call")
        self._assign_own(self._next_state(self._own_values(), ops.convert_to_tensor(True)))

    def _common_apply(self, grads: Any, trainable_variables: Any = None) -> None:
        flags = self._finite_flags(grads) if self._monitor is not None else None
        finite = self.check_finite(grads) if flags is None else _all(flags)
        self._guard_traced(finite)
        own = self._own_values()
        if flags is not None:
            variables = self._trainable_variables if trainable_variables is None else list(trainable_variables)
            head, stats = self.monitor_head, self.monitor_stats
            new_head, new_stats = self._monitor_values(grads, variables, own, finite, flags, stats.value)
        if self._config.skip_nonfinite:
            ops.cond(finite, lambda: self._apply_inner(grads, trainable_variables, own[1]), lambda: None)
        else:
            self._apply_inner(grads, trainable_variables, own[1])
        self._assign_own(self._next_state(own, ops.logical_not(finite)))
        if flags is not None:
            head.assign(new_head)
            stats.assign(new_stats)
        if self._needs_host_check() and _concrete(finite):
            self.check_min_scale()

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        if _backend() != "jax":
            return super().apply(grads, trainable_variables)
        # JAX: ops.cond is lax.cond, which cannot hold stateful assignments: go functional
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        variables = list(trainable_variables) if trainable_variables is not None else self._trainable_variables
        if self._jitted_apply is None:  # eager lax.cond re-traces every call: compile the step once
            import jax

            self._jitted_apply = jax.jit(functools.partial(self.stateless_apply, _host_checks_after=True))
        new_weights, new_state = self._jitted_apply([v.value for v in self.variables], list(grads),
                                                    [v.value for v in variables])
        for v, x in zip(variables, new_weights):
            v.assign(x)
        for v, x in zip(self.variables, new_state):
            v.assign(x)
        if self._needs_host_check() and _concrete(new_state[0]):
            self.check_min_scale()

    # --- stateless apply (JAX fit, and any functional use) ---

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any,
                        _host_checks_after: bool = False) -> Any:
        if not self.built:
            raise ValueError(f"To call `stateless_apply`, {self.__class__.__name__} must be built (i.e. its "
                             "variables must have been created). You can build it via "
                             "`optimizer.build(trainable_variables)`.")
        n = len(self._variables)
        own, inner = list(optimizer_variables[:n]), list(optimizer_variables[n:])
        where = [next(i for i, v in enumerate(self._variables) if v is s) for s in self._state_variables]
        flags = self._finite_flags(grads) if self._monitor is not None else None
        finite = self.check_finite(grads) if flags is None else _all(flags)
        if not _host_checks_after:
            self._guard_traced(finite)
        scale = own[where[1]]
        if flags is not None:
            at = [next(i for i, v in enumerate(self._variables) if v is m) for m in self._monitor_variables]
            own[at[0]], own[at[1]] = self._monitor_values(grads, self._trainable_variables, [own[i] for i in where],
                                                          finite, flags, own[at[1]])

        def step() -> Any:
            new_weights, new_inner = self.inner_optimizer.stateless_apply(
                inner, self._unscale(grads, scale), trainable_variables)
            return list(new_weights), list(new_inner)

        if self._config.skip_nonfinite:
            new_weights, new_inner = ops.cond(finite, step, lambda: (list(trainable_variables), inner))
        else:
            new_weights, new_inner = step()
        for i, x in zip(where, self._next_state([own[i] for i in where], ops.logical_not(finite))):
            own[i] = x
        return new_weights, own + list(new_inner)

    # --- the numerics monitor (see Monitor): statistics of the scaled gradients, in keras.ops ---

    def _build_monitor_variables(self) -> None:
        from keras.src.utils import tracking

        spec = self._monitor
        assert spec is not None

        @tracking.no_automatic_dependency_tracking
        def make() -> None:
            self.monitor_head = self.add_variable(shape=(_HEAD_SIZE,), dtype="float32", aggregation="none",
                                                  initializer="zeros", name="ampbridge_monitor_head")
            self.monitor_stats = self.add_variable(shape=(max(1, len(spec.stats)), _ROW_SIZE), dtype="float32",
                                                   aggregation="none", initializer="zeros",
                                                   name="ampbridge_monitor_stats")
            self._monitor_variables = [self.monitor_head, self.monitor_stats]

        make()

    def _attach_monitor(self, spec: "_MonitorSpec | None") -> None:
        """Start (a spec) or stop (None) computing the monitor's record in every step."""
        if self._monitor_variables and (spec is None or self._monitor is None
                                        or len(spec.stats) != len(self._monitor.stats)):
            for v in self._monitor_variables:  # by identity: Variable.__eq__ compares values
                del self._variables[next(i for i, x in enumerate(self._variables) if x is v)]
            self._monitor_variables = []
        self._monitor = spec
        self._monitor_cache = None
        self._jitted_apply = None  # the monitor is baked into the compiled step
        if spec is not None and self.built and not self._monitor_variables:
            self._build_monitor_variables()

    def _saved_variables(self) -> list[Any]:
        # the monitor's record is scratch space: checkpoints look the same with or without it
        return [v for v in self.variables if not any(v is m for m in self._monitor_variables)]

    def save_own_variables(self, store: Any) -> None:
        for i, variable in enumerate(self._saved_variables()):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store: Any) -> None:
        variables = self._saved_variables()
        if len(store.keys()) != len(variables):
            warnings.warn(f"Skipping variable loading for optimizer '{self.name}', because it has "
                          f"{len(variables)} variables whereas the saved optimizer has {len(store.keys())} "
                          "variables.", stacklevel=2)
            return
        for i, variable in enumerate(variables):
            variable.assign(store[str(i)])

    def _finite_flags(self, grads: list[Any]) -> list[Any]:
        return [ops.all(ops.isfinite(g)) if g is not None else None for g in grads]

    def _monitor_layout(self, variables: list[Any]) -> Any:
        """Per layer the positions of its gradients in ``grads``; per position its leaf index."""
        key = tuple(id(v) for v in variables)
        if self._monitor_cache is not None and self._monitor_cache[0] == key:
            return self._monitor_cache[1]
        spec = self._monitor
        assert spec is not None
        position = {vid: i for i, vid in enumerate(key)}
        stats = [(compute, tuple(position[v] for v in ids if v in position)) for _, compute, ids in spec.stats]
        leaves = [(position[v], leaf) for v, leaf in spec.leaf_of.items() if v in position]
        layout = (stats, leaves)
        self._monitor_cache = (key, layout)
        return layout

    def _monitor_values(self, grads: list[Any], variables: list[Any], own: list[Any], finite: Any,
                        flags: list[Any], old_stats: Any) -> tuple[Any, Any]:
        """This step's record: the head (step, scale used, found_inf, skipped, the last leaf in
        forward order whose own gradients are non-finite, sampled) and, on sampled steps, the
        per-layer statistics (else the previous ones, untouched)."""
        spec = self._monitor
        assert spec is not None
        stats_layout, leaves = self._monitor_layout(variables)
        scale, steps = ops.cast(own[1], "float32"), own[3]
        found_inf = ops.logical_not(finite)
        skipped = found_inf if self._config.skip_nonfinite else ops.zeros_like(found_inf)
        candidates = [ops.where(flags[pos], -1.0, float(leaf)) for pos, leaf in leaves if flags[pos] is not None]
        param_first = ops.max(ops.stack(candidates)) if candidates else ops.convert_to_tensor(-1.0)
        if _backend() == "torch":  # eager: decide on the host, no sync for ops.cond's predicate
            sampled: Any = spec.host_step % spec.every == 0
            spec.host_step += 1
        else:
            sampled = ops.equal(ops.mod(steps, spec.every), 0)

        def compute() -> Any:
            rows = [_grad_stats([grads[p] for p in positions if grads[p] is not None], scale, compute_dtype,
                                sizes=[int(np.prod(variables[p].shape)) for p in positions if grads[p] is not None])
                    for compute_dtype, positions in stats_layout]
            return ops.stack(rows) if rows else ops.zeros_like(old_stats)

        new_stats = (compute() if sampled else old_stats) if isinstance(sampled, bool) else ops.cond(
            sampled, compute, lambda: old_stats)
        step_hi, step_lo = _split_count(steps)
        head = ops.stack([step_hi, step_lo, scale, ops.cast(found_inf, "float32"), ops.cast(skipped, "float32"),
                          ops.cast(param_first, "float32"), ops.cast(sampled, "float32")])
        return head, new_stats

    # --- serialisation ---

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "loss_scale": {f: getattr(self._config, f) for f in (
                "mode", "initial_scale", "growth_factor", "backoff_factor", "growth_interval",
                "hysteresis", "consecutive_hysteresis", "min_scale", "max_scale", "on_min_scale",
                "skip_nonfinite")},
            "policy": self.policy.to_dict() if self.policy is not None else None,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> "LossScaleOptimizer":
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        return cls(inner, **config)


def optimizer(inner: Any, policy: Policy | str) -> LossScaleOptimizer:
    """Wrap a Keras optimizer (instance or name) in ampbridge's :class:`LossScaleOptimizer`.

    The loss-scale settings are the policy's (its first phase's, for a schedule), with mode
    ``auto`` resolved against the compute dtype. ``reduce_dtype`` only matters for a
    distributed all-reduce: with a multi-replica distribution active it must equal
    ``param_dtype`` (Keras reduces gradients in the variables' dtype), else it is an error.

    Example:
        >>> import keras, ampbridge
        >>> opt = optimizer(keras.optimizers.Adam(1e-3), ampbridge.preset("mixed_float16"))
        >>> opt.loss_scale_config.mode, opt.initial_scale
        ('dynamic', 65536.0)
    """
    policy, _ = resolve_policy(policy)
    active = _phase0(policy)
    inner = keras.optimizers.get(inner)
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise TypeError(f"optimizer() wraps a plain Keras optimizer; received a {type(inner).__name__}, "
                        "which already scales the loss (pass its inner_optimizer)")
    if active.reduce_dtype != active.param_dtype and _replicas() > 1:
        raise UnsupportedOptionError(
            f"reduce_dtype={active.reduce_dtype} with param_dtype={active.param_dtype}: Keras all-reduces "
            "gradients in the variables' dtype; set reduce_dtype to the param_dtype")
    return LossScaleOptimizer(inner, loss_scale=active.resolved_loss_scale, policy=policy)


def _replicas() -> int:
    distribution = keras.distribution.distribution()
    if distribution is not None:
        return max(1, int(np.prod(distribution.device_mesh.shape)))
    if _backend() == "tensorflow":
        import tensorflow as tf

        return int(tf.distribute.get_strategy().num_replicas_in_sync)
    return 1


# --- callbacks --------------------------------------------------------------------------------

def _model_of(callback: Any) -> Any:
    """The callback's model, without the JAX state sync that ``Callback.model`` performs on every
    access (it puts the traced state back into the variables, and the next step re-gathers it:
    callbacks that run every step read ``model._jax_state`` instead)."""
    return callback._model if _backend() == "jax" else callback.model


class LossScaleCallback(keras.callbacks.Callback):
    """Enforces ``on_min_scale = "warn" | "error"`` during a compiled ``fit``.

    After each batch it reads the count of overflows at ``min_scale`` (one host sync per
    step, only when those modes are set) and warns once or raises
    :class:`ampbridge.LossScaleError`.
    """

    def _optimizer(self) -> LossScaleOptimizer | None:
        opt = getattr(_model_of(self), "optimizer", None)
        return opt if isinstance(opt, LossScaleOptimizer) else None

    def on_train_begin(self, logs: Any = None) -> None:
        opt = self._optimizer()
        if opt is not None:
            opt.host_checked = True

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        opt = self._optimizer()
        if opt is None or not opt._needs_host_check() or not opt.built:
            return
        jax_state = getattr(_model_of(self), "_jax_state", None)
        if jax_state:
            index = next(i for i, v in enumerate(opt.variables) if v is opt.min_scale_overflows)
            opt.check_min_scale(jax_state["optimizer_variables"][index])
        else:
            opt.check_min_scale()

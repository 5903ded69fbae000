"""The loss scaler: Keras's ``LossScaleOptimizer`` running the core's reference algorithm in
``keras.ops`` (and computing the monitor's record when one is attached), and its ``fit`` callback.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings
import weakref
from typing import Any

import keras
import numpy as np
from keras import ops
from keras.src import api_export as _api_export

from ...core.loss_scale import INT32_MAX, LossScaleState, f32, initial_state, restart_count
from ...core.policy import LossScaleConfig, Policy
from ...errors import AmpBridgeWarning, LossScaleError, UnsupportedOptionError
from ..private_hooks import tested_range
from .distributed import agreed_finite, check_reduce_dtype, replicas, tf_apply
from .environment import active_backend, resolve_policy
from .numerics import LAYOUT, MonitorSpec, all_finite, finite_flags, grad_stats, host_value, split_count

# --- the loss-scaling optimizer ---------------------------------------------------------------

def _config_from(value: LossScaleConfig | dict[str, Any]) -> LossScaleConfig:
    cfg = value if isinstance(value, LossScaleConfig) else LossScaleConfig(**value)
    if cfg.mode == "auto":
        raise ValueError("resolve loss_scale mode 'auto' first: LossScaleConfig.resolve(compute_dtype)")
    return cfg


def _concrete(x: Any) -> bool:
    """Whether ``x`` has a value now (eager), not inside a traced tf.function or jax.jit."""
    backend = active_backend()
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
    ``skip_nonfinite``, ``first_growth_interval``, ``max_consecutive_skips``), in backend-agnostic
    ``keras.ops``, for ``fit`` on every backend
    (``scale_loss`` / ``apply`` / ``stateless_apply``) and for custom loops. A skipped step
    leaves the weights and the inner optimizer's variables untouched. The state (every reference
    field, plus the count of overflows at ``min_scale``) is optimizer variables,
    so ``model.save`` / checkpoints carry it. Build one with :func:`optimizer`.

    ``on_min_scale = "warn" | "error"`` needs the host to look at the state after a step:
    eager steps check it themselves; under a compiled ``fit`` pass
    ``callbacks=[ampbridge.keras.LossScaleCallback()]`` (or a :class:`PhaseCallback`); a compiled
    custom loop sets ``optimizer.host_checked = True`` and calls ``optimizer.check_min_scale()``
    after each step. Tracing without either is an error rather than a silently ignored setting.
    """

    def __init__(self, inner_optimizer: Any, initial_scale: float | None = None,
                 dynamic_growth_steps: int | None = None, name: str | None = None,
                 loss_scale: LossScaleConfig | dict[str, Any] | None = None,
                 policy: Policy | dict[str, Any] | None = None, **kwargs: Any):
        # Keras's own arguments mean what they mean there (initial_scale 2**15, growth every
        # dynamic_growth_steps finite steps, x2 / x0.5); loss_scale carries every other setting
        if loss_scale is None:
            cfg = LossScaleConfig(mode="dynamic", initial_scale=2.0**15 if initial_scale is None else initial_scale,
                                  growth_interval=2000 if dynamic_growth_steps is None else dynamic_growth_steps)
        else:
            cfg = _config_from(loss_scale)
            for key, given, own in (("initial_scale", initial_scale, initial_state(cfg).scale),
                                    ("dynamic_growth_steps", dynamic_growth_steps, cfg.growth_interval)):
                if given is not None and float(given) != float(own):
                    raise ValueError(f"LossScaleOptimizer received {key}={given!r} and loss_scale, whose value is "
                                     f"{own!r}; pass one of them")
        cfg = _config_from(cfg)
        start = initial_state(cfg)
        super().__init__(inner_optimizer, initial_scale=start.scale,
                         dynamic_growth_steps=cfg.growth_interval, name=name, **kwargs)
        # the policy rides along (in .keras files: get_config, or an asset) for load_model to re-apply
        self.policy = Policy.from_dict(policy) if isinstance(policy, dict) else policy
        self._config = cfg
        self._sync_format()
        self.host_checked = False
        self._overflows_seen = 0
        self._jitted_apply = None
        self._step_verified = False  # the first-step guard (_verified_apply) has passed
        self._handed: int | None = None  # gradients handed to the inner optimizer (first step only)
        self._monitor: MonitorSpec | None = None  # set by ampbridge.keras.Monitor
        self._finite_out: list[Any] | None = None  # set while MonitorCallback traces: the step's finite flag
        self._monitor_variables: list[Any] = []
        self._monitor_cache: tuple[tuple[int, ...], Any] | None = None
        # the state Keras's class has no variable for, as its own entry of a weights file (a
        # child Keras saves and loads by attribute): Keras's layout stays loadable by Keras
        object.__setattr__(self, "ampbridge_state", _ExtraState(self))

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
        self._sync_format()
        if before is not None:
            self.set_state(enter_phase(config, before, previous=previous, reset=reset))

    # --- state ---

    def build(self, var_list: Any) -> None:
        super().build(var_list)  # step_counter (= good_steps), dynamic_scale, inner optimizer
        if len(self._trainable_variables) != len(var_list):
            # Keras < 3.12's LossScaleOptimizer.build skips the base build, which records the
            # variables our unscaling pairs the gradients with: run it (3.12+ does it itself)
            super(keras.optimizers.LossScaleOptimizer, self).build(var_list)
        from keras.src.utils import tracking

        @tracking.no_automatic_dependency_tracking
        def extra() -> None:
            start = initial_state(self._config)
            self.dynamic_scale.assign(np.float32(start.scale))
            for attr, init in (("hysteresis_left", start.hysteresis_left), ("loss_scale_steps", 0),
                               ("skipped_steps", 0), ("min_scale_overflows", 0), ("nonfinite_streak", 0)):
                setattr(self, attr, self.add_variable(
                    shape=(), dtype="int32", initializer=keras.initializers.Constant(init),
                    aggregation="none", name=attr))

        extra()
        if self._monitor is not None:
            self._build_monitor_variables()

    def add_variable(self, *args: Any, **kwargs: Any) -> Any:
        # Keras's build creates step_counter (good_steps) at zero; with first_growth_interval it starts
        # elsewhere. Set as the initializer: an assign in build would be lost when a tf.function builds
        if kwargs.get("name") == "step_counter" and initial_state(self._config).good_steps:
            kwargs["initializer"] = keras.initializers.Constant(initial_state(self._config).good_steps)
        return super().add_variable(*args, **kwargs)

    @property
    def _state_variables(self) -> list[Any]:
        # good_steps, scale, hysteresis_left, steps, skipped, overflows at min_scale, nonfinite_streak
        return [self.step_counter, self.dynamic_scale, self.hysteresis_left, self.loss_scale_steps,
                self.skipped_steps, self.min_scale_overflows, self.nonfinite_streak]

    @property
    def state(self) -> LossScaleState:
        """The loss-scale state as the core's :class:`ampbridge.LossScaleState` (reads values)."""
        if not self.built:
            return initial_state(self._config)
        own = [host_value(v) for v in self._state_variables]
        return LossScaleState(scale=float(own[1]), good_steps=int(own[0]), hysteresis_left=int(own[2]),
                              steps=int(own[3]), skipped=int(own[4]), nonfinite_streak=int(own[6]))

    def set_state(self, state: LossScaleState) -> None:
        """Overwrite the loss-scale state (all its fields)."""
        if not self.built:
            raise ValueError("build the optimizer first: optimizer.build(model.trainable_variables)")
        own = self._state_variables
        for v, x in zip(own[:5] + own[6:], (state.good_steps, np.float32(state.scale), state.hysteresis_left,
                                            state.steps, state.skipped, state.nonfinite_streak)):
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

    def _grown(self, scale: Any) -> Any:
        """The scale after a growth (before ``max_scale``)."""
        return ops.multiply(scale, np.float32(f32(self._config.growth_factor)))

    def _next_state(self, own: list[Any], found_inf: Any, candidate: Any = None) -> list[Any]:
        """The state after a step; ``candidate`` is :meth:`_grown` of the scale where the caller has
        it (only read on finite steps)."""
        cfg = self._config
        good, scale, hyst, steps, skipped, overflows, streak = own
        one = ops.cast(1, "int32")
        steps_new = ops.add(steps, one)
        skipped_new = ops.add(skipped, ops.cast(self._skips(found_inf, streak), "int32"))
        if cfg.max_consecutive_skips is not None:  # saturates at int32's maximum (optax's safe_increment)
            bumped = ops.add(streak, ops.cast(ops.less(streak, INT32_MAX), "int32"))
            streak = ops.where(found_inf, bumped, ops.zeros_like(streak))
        if cfg.mode != "dynamic":
            return [good, scale, hyst, steps_new, skipped_new, overflows, streak]
        backoff_now = ops.logical_and(found_inf, ops.less_equal(hyst, 1))
        backed = ops.multiply(scale, np.float32(f32(cfg.backoff_factor)))
        if cfg.min_scale is not None:
            lo = np.float32(f32(cfg.min_scale))
            at_min = ops.logical_and(backoff_now, ops.equal(scale, lo))
            backed = ops.maximum(backed, lo)
        good_plus = ops.add(good, one)
        grow = ops.logical_and(ops.logical_not(found_inf), ops.equal(good_plus, cfg.growth_interval))
        candidate = self._grown(scale) if candidate is None else candidate
        grown = candidate if cfg.max_scale is None else ops.minimum(candidate, np.float32(f32(cfg.max_scale)))
        grown = ops.where(ops.isfinite(candidate), grown, scale)
        scale_new = ops.where(found_inf, ops.where(backoff_now, backed, scale), ops.where(grow, grown, scale))
        good_new = ops.where(found_inf, ops.full_like(good, restart_count(cfg)),
                             ops.where(grow, ops.zeros_like(good), good_plus))
        hyst_on_inf = ops.where(backoff_now, hyst, ops.subtract(hyst, one))
        refill = ops.full_like(hyst, cfg.hysteresis)
        hyst_on_ok = refill if cfg.consecutive_hysteresis else ops.where(grow, refill, hyst)
        hyst_new = ops.where(found_inf, hyst_on_inf, hyst_on_ok)
        new = [good_new, scale_new, hyst_new, steps_new, skipped_new, overflows, streak]
        if cfg.min_scale is not None:
            if cfg.on_min_scale == "error":
                # the reference raises before changing anything: keep the step's state as it was
                new = [ops.where(at_min, old, n) for old, n in zip(own, new)]
            new[5] = ops.add(overflows, ops.cast(at_min, "int32"))
        return new

    def _skips(self, found_inf: Any, streak: Any) -> Any:
        """Whether this step's update is skipped: non-finite, ``skip_nonfinite``, and fewer than
        ``max_consecutive_skips`` skipped in a row before it (where that is set)."""
        cfg = self._config
        if not cfg.skip_nonfinite:
            return ops.zeros_like(found_inf)
        if cfg.max_consecutive_skips is None:
            return found_inf
        return ops.logical_and(found_inf, ops.less(streak, cfg.max_consecutive_skips))

    def _takes(self, finite: Any, own: list[Any]) -> Any:
        """Whether this step's update is applied (the complement of :meth:`_skips`)."""
        if self._config.max_consecutive_skips is None:
            return finite
        return ops.logical_not(self._skips(ops.logical_not(finite), own[6]))

    def _unscale(self, grads: list[Any], scale: Any) -> list[Any]:
        if self._config.mode == "none":
            return list(grads)
        grads = list(grads)
        if len(grads) > len(self._trainable_variables):
            # zip would drop gradients: Keras 3.7-3.11 left _trainable_variables empty, and every
            # step updated nothing (docs/versions.md). Checked in Python, so traced steps pay nothing
            raise UnsupportedOptionError(
                f"ampbridge.keras.LossScaleOptimizer: {len(grads)} gradients for {len(self._trainable_variables)} "
                f"variables the optimizer was built with on {_framework_versions()}; build it with the "
                f"variables you step (ampbridge supports {tested_range('keras')})")
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
        count = int(host_value(overflows))
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
        unscaled = self._unscale(grads, scale)
        self._handed = len(unscaled)
        self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)

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
        if self._config.max_consecutive_skips is not None:
            raise UnsupportedOptionError("loss_scale.max_consecutive_skips is not supported with a "
                                         "tf.distribute strategy that needs merge_call")
        self._assign_own(self._next_state(self._own_values(), ops.convert_to_tensor(True)))

    def _common_apply(self, grads: Any, trainable_variables: Any = None) -> None:
        flags = self._finite_flags(grads) if self._monitor is not None else None
        finite = agreed_finite(all_finite(grads, flags))
        self._guard_traced(finite)
        own = self._own_values()
        if flags is not None:
            variables = self._trainable_variables if trainable_variables is None else list(trainable_variables)
            head, stats = self.monitor_head, self.monitor_stats
            new_head, new_stats = self._monitor_values(grads, variables, own, finite, flags, stats.value)
        if self._config.skip_nonfinite:
            ops.cond(self._takes(finite, own), lambda: self._apply_inner(grads, trainable_variables, own[1]),
                     lambda: None)
        else:
            self._apply_inner(grads, trainable_variables, own[1])
        self._assign_own(self._next_state(own, ops.logical_not(finite)))
        if flags is not None:
            head.assign(new_head)
            stats.assign(new_stats)
        if self._needs_host_check() and _concrete(finite):
            self.check_min_scale()

    def _tf_apply(self, grads: Any, trainable_variables: Any = None) -> None:
        # private: overrides keras LossScaleOptimizer._tf_apply (checked on Keras 3.13-3.15), which
        # takes the first replica's finite flag for all replicas; see distributed.tf_apply
        tf_apply(self, grads, trainable_variables)

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        if not self._step_verified:
            return self._verified_apply(grads, trainable_variables)
        if active_backend() != "jax":
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

    # --- the first-step guard: Keras changing its hooks must not mean steps that update nothing ---

    def _verified_apply(self, grads: Any, trainable_variables: Any) -> None:
        """The first ``apply``, checked once (docs/versions.md: on Keras 3.7-3.11 an older ampbridge ran
        every step and updated nothing). When traced (a compiled ``fit``), that the step reached
        ampbridge's hooks and handed the inner optimizer every gradient; when eager, also that a
        finite step advanced the inner optimizer's ``iterations`` (two reads, once). Raises
        :class:`ampbridge.errors.UnsupportedOptionError` naming the Keras version otherwise."""
        grads = list(grads)
        eager = bool(grads) and _concrete(grads[0])
        before = int(host_value(self.inner_optimizer.iterations)) if eager else None
        finite = bool(host_value(all_finite(grads))) if eager else None
        self._step_verified, self._handed = True, None
        try:
            self.apply(grads, trainable_variables)
        except BaseException:
            self._step_verified = False
            raise
        given = sum(g is not None for g in grads)
        problem = None
        if self._handed is None and not eager:  # traced: each branch of the step was traced once
            problem = "never reached ampbridge's apply hooks"
        elif self._handed is not None and given and not self._handed:
            problem = f"handed the inner optimizer 0 of {given} gradients"
        elif eager and finite and int(host_value(self.inner_optimizer.iterations)) == before:
            problem = "left the inner optimizer's iterations unchanged after a finite step"
        elif eager and not finite:
            self._step_verified = False  # a skipped step proves nothing: check the next one
        if problem is not None:
            self._step_verified = False
            raise UnsupportedOptionError(
                f"ampbridge.keras.LossScaleOptimizer: the first optimizer step {problem} on "
                f"{_framework_versions()}, so training would not update the weights; "
                f"ampbridge supports {tested_range('keras')}")

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
        finite = all_finite(grads, flags)
        if self._finite_out is not None:
            self._finite_out.append(finite)
        if not _host_checks_after:
            self._guard_traced(finite)
        scale = own[where[1]]
        if flags is not None:
            at = [next(i for i, v in enumerate(self._variables) if v is m) for m in self._monitor_variables]
            own[at[0]], own[at[1]] = self._monitor_values(grads, self._trainable_variables, [own[i] for i in where],
                                                          finite, flags, own[at[1]])

        def step() -> Any:
            unscaled = self._unscale(grads, scale)
            self._handed = len(unscaled)
            new_weights, new_inner = self.inner_optimizer.stateless_apply(inner, unscaled, trainable_variables)
            return list(new_weights), list(new_inner), self._grown(scale)

        # The growth candidate is computed in the step branch, as in Keras's own step: XLA's CPU
        # simplifier rewrites g / broadcast(s) into g * broadcast(1 / s) when s has no other use in
        # the branch (one gradient), 1-2 ulp off a division by a scale that is not a power of two
        # (docs/fuzzing.md); the growth multiply is that other use
        if self._config.skip_nonfinite:
            new_weights, new_inner, grown = ops.cond(self._takes(finite, [own[i] for i in where]), step,
                                                     lambda: (list(trainable_variables), inner, scale))
        else:
            new_weights, new_inner, grown = step()
        state = [own[i] for i in where]
        for i, x in zip(where, self._next_state(state, ops.logical_not(finite), candidate=grown)):
            own[i] = x
        return new_weights, own + list(new_inner)

    # --- the numerics monitor (see Monitor): statistics of the scaled gradients, in keras.ops ---

    def _build_monitor_variables(self) -> None:
        from keras.src.utils import tracking

        spec = self._monitor
        assert spec is not None

        @tracking.no_automatic_dependency_tracking
        def make() -> None:
            self.monitor_head = self.add_variable(shape=(LAYOUT.head,), dtype="float32", aggregation="none",
                                                  initializer="zeros", name="ampbridge_monitor_head")
            self.monitor_stats = self.add_variable(shape=(max(1, len(spec.stats)), LAYOUT.row), dtype="float32",
                                                   aggregation="none", initializer="zeros",
                                                   name="ampbridge_monitor_stats")
            self._monitor_variables = [self.monitor_head, self.monitor_stats]

        make()

    # the monitor's interface (ampbridge.keras.Monitor attaches, pauses and reads through these)

    @property
    def monitor_spec(self) -> "MonitorSpec | None":
        """What the attached monitor asks each step to record (None: no monitor, or paused)."""
        return self._monitor

    @property
    def monitor_variables(self) -> list[Any]:
        """The variables the step writes the monitor's record into (empty until built)."""
        return self._monitor_variables

    @contextlib.contextmanager
    def monitor_paused(self) -> Any:
        """Inside, steps run (and trace) as without a monitor; its variables stay, unused."""
        spec, self._monitor = self._monitor, None
        try:
            yield
        finally:
            self._monitor = spec

    def attach_monitor(self, spec: "MonitorSpec | None") -> None:
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

    def _keras_variables(self) -> list[Any]:
        """The variables Keras's own LossScaleOptimizer has, in its order (its checkpoint layout)."""
        extra = self._extra_variables() + self._monitor_variables
        return [v for v in self._variables if not any(v is x for x in extra)] + list(self.inner_optimizer.variables)

    def _extra_variables(self) -> list[Any]:
        if not hasattr(self, "min_scale_overflows"):  # not built yet
            return []
        return [self.hysteresis_left, self.loss_scale_steps, self.skipped_steps, self.min_scale_overflows,
                self.nonfinite_streak]

    def save_own_variables(self, store: Any) -> None:
        # Keras's layout when the file names Keras's class (the rest of the state is the asset)
        variables = self._keras_variables() if self._keras_format else self._saved_variables()
        for i, variable in enumerate(variables):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store: Any) -> None:
        n = len(store.keys())
        saved = self._saved_variables()
        # a file from before nonfinite_streak existed: every variable but that one
        older = [v for v in saved if v is not getattr(self, "nonfinite_streak", None)]
        variables = next((vs for vs in (saved, self._keras_variables() if self.built else [], older)
                          if len(vs) == n), None)
        if variables is None:
            warnings.warn(f"Skipping variable loading for optimizer '{self.name}', because it has "
                          f"{len(self._saved_variables())} variables whereas the saved optimizer has {n} "
                          "variables.", stacklevel=2)
            return
        for i, variable in enumerate(variables):
            variable.assign(store[str(i)])

    def save_assets(self, dir_path: Any) -> None:
        """Writes ``ampbridge_loss_scale.json``: the settings, the policy and the state Keras's own
        LossScaleOptimizer has no variable for (read back by :func:`ampbridge.keras.load_model`)."""
        with open(os.path.join(str(dir_path), LOSS_SCALE_ASSET), "w", encoding="utf-8") as f:
            json.dump(self._asset(), f)

    def load_assets(self, dir_path: Any) -> None:
        path = os.path.join(str(dir_path), LOSS_SCALE_ASSET)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                self._restore_asset(json.load(f))

    def _asset(self) -> dict[str, Any]:
        extra = dict(zip(_EXTRA_NAMES, (int(host_value(v)) for v in self._extra_variables()))) if self.built else None
        return {"format": 1, "loss_scale": self._loss_scale_dict(),
                "policy": self.policy.to_dict() if self.policy is not None else None, "state": extra}

    def _restore_asset(self, data: dict[str, Any]) -> None:
        config = LossScaleConfig(**data["loss_scale"])
        if config != self._config:
            self._config = config
            self._sync_format()
        if data.get("policy") is not None:
            self.policy = Policy.from_dict(data["policy"])
        if data.get("state") is not None and self.built:
            for v, name in zip(self._extra_variables(), _EXTRA_NAMES):
                if name in data["state"]:  # (nonfinite_streak is newer than the asset format)
                    v.assign(int(data["state"][name]))

    def _finite_flags(self, grads: list[Any]) -> list[Any]:
        return finite_flags(grads)

    def check_finite(self, grads: Any) -> Any:
        """Whether every gradient is finite: the backend's one check (``numerics.all_finite``), which
        the monitor uses too; Keras's ``_tf_apply`` and ``stateless_apply`` call this hook."""
        return all_finite(list(grads))

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
        skipped = self._skips(found_inf, own[6])
        candidates = [ops.where(flags[pos], -1.0, float(leaf)) for pos, leaf in leaves if flags[pos] is not None]
        param_first = ops.max(ops.stack(candidates)) if candidates else ops.convert_to_tensor(-1.0)
        if active_backend() == "torch":  # eager: decide on the host, no sync for ops.cond's predicate
            sampled: Any = spec.host_step % spec.every == 0
            spec.host_step += 1
        else:
            # a non-finite step is always sampled: its per-layer statistics name every bad layer
            sampled = ops.logical_or(ops.equal(ops.mod(steps, spec.every), 0), found_inf)

        def compute() -> Any:
            rows = [grad_stats([grads[p] for p in positions if grads[p] is not None], scale, compute_dtype,
                                sizes=[int(np.prod(variables[p].shape)) for p in positions if grads[p] is not None])
                    for compute_dtype, positions in stats_layout]
            return ops.stack(rows) if rows else ops.zeros_like(old_stats)

        new_stats = (compute() if sampled else old_stats) if isinstance(sampled, bool) else ops.cond(
            sampled, compute, lambda: old_stats)
        step_hi, step_lo = split_count(steps)
        head = ops.stack([step_hi, step_lo, scale, ops.cast(found_inf, "float32"), ops.cast(skipped, "float32"),
                          ops.cast(param_first, "float32"), ops.cast(sampled, "float32")])
        return head, new_stats

    # --- serialisation ---

    @property
    def _keras_format(self) -> bool:
        return type(self) is _KerasFormat

    def _sync_format(self) -> None:
        # Settings Keras's own LossScaleOptimizer runs the same way are saved under its name, so a
        # .keras file loads without ampbridge; any other setting needs this class to reload
        if type(self) in (LossScaleOptimizer, _KerasFormat):  # a user's subclass keeps its class
            self.__class__ = _KerasFormat if keras_expressible(self._config) else LossScaleOptimizer

    def _loss_scale_dict(self) -> dict[str, Any]:
        return {f: getattr(self._config, f) for f in (
            "mode", "initial_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
            "consecutive_hysteresis", "min_scale", "max_scale", "on_min_scale", "skip_nonfinite",
            "first_growth_interval", "max_consecutive_skips")}

    def get_config(self) -> dict[str, Any]:
        """Keras's four keys (``name``, ``inner_optimizer``, ``initial_scale``,
        ``dynamic_growth_steps``); ``loss_scale`` and ``policy`` too when the settings are ones
        Keras's own class cannot run (then the class saved is ampbridge's)."""
        config = {"name": self.name, "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
                  "initial_scale": float(initial_state(self._config).scale),
                  "dynamic_growth_steps": int(self._config.growth_interval)}
        if not self._keras_format:
            config["loss_scale"] = self._loss_scale_dict()
            config["policy"] = self.policy.to_dict() if self.policy is not None else None
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> "LossScaleOptimizer":
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"),
                                                      custom_objects=custom_objects)
        return cls(inner, **config)


def _framework_versions() -> str:
    """``keras 3.15.1 (tensorflow 2.21.0)``: the versions an error about them should name."""
    backend = active_backend()
    module = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}.get(backend)
    version = getattr(__import__(module), "__version__", "?") if module else "?"
    return f"keras {keras.__version__} ({backend} {version})"


LOSS_SCALE_ASSET = "ampbridge_loss_scale.json"


class _ExtraState(keras.layers.Layer):
    """The loss-scale state Keras's ``LossScaleOptimizer`` has no variable for (hysteresis left,
    steps, skipped, overflows at min_scale), saved as the optimizer's ``ampbridge_state`` entry of
    ``.keras`` and ``.weights.h5`` files when the optimizer uses Keras's layout."""

    def __init__(self, owner: Any):
        super().__init__(name="ampbridge_loss_scale_state")
        self._owner = weakref.ref(owner)

    def save_own_variables(self, store: Any) -> None:
        owner = self._owner()
        if owner is not None and owner.built and owner._keras_format:
            for name, v in zip(_EXTRA_NAMES, owner._extra_variables()):
                store[name] = v.numpy()

    def load_own_variables(self, store: Any) -> None:
        owner = self._owner()
        # (a file from before nonfinite_streak existed lacks only that one)
        if owner is not None and owner.built and all(name in store.keys() for name in _EXTRA_NAMES[:4]):
            for name, v in zip(_EXTRA_NAMES, owner._extra_variables()):
                if name in store.keys():
                    v.assign(store[name])
_EXTRA_NAMES = ("hysteresis_left", "steps", "skipped", "min_scale_overflows", "nonfinite_streak")


def keras_expressible(config: LossScaleConfig) -> bool:
    """Whether Keras's own ``LossScaleOptimizer`` runs ``config`` as ampbridge does: dynamic,
    x2 growth, x0.5 backoff, no hysteresis, no floor or ceiling, non-finite steps skipped (the
    two differ only once the scale would pass 2**127, where Keras's becomes inf).

    Example:
        >>> keras_expressible(LossScaleConfig(mode="dynamic", initial_scale=1024.0, growth_interval=100))
        True
        >>> keras_expressible(LossScaleConfig(mode="dynamic", hysteresis=2))
        False
    """
    return (config.mode == "dynamic" and config.growth_factor == 2.0 and config.backoff_factor == 0.5
            and config.hysteresis == 1 and config.min_scale is None and config.max_scale is None
            and config.skip_nonfinite and restart_count(config) == 0 and config.max_consecutive_skips is None)


class _KerasFormat(LossScaleOptimizer):
    """ampbridge's optimizer with settings Keras's own runs the same way: it saves as
    ``keras.optimizers.LossScaleOptimizer`` (same config keys, same variable layout), so the
    file loads in plain Keras; what Keras has no variable for travels in an asset."""


# private: keras.src.api_export.REGISTERED_OBJS_TO_NAMES (checked on Keras 3.13-3.15) is the
# table serialize_keras_object reads a class's public Keras name from; Keras has no public way
# to save a subclass under its base class's name
_api_export.REGISTERED_OBJS_TO_NAMES[_KerasFormat] = "keras.optimizers.LossScaleOptimizer"


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
    active = policy.at(step=0, epoch=0)
    inner = keras.optimizers.get(inner)
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise TypeError(f"optimizer() wraps a plain Keras optimizer; received a {type(inner).__name__}, "
                        "which already scales the loss (pass its inner_optimizer)")
    check_reduce_dtype(policy, replicas())
    return LossScaleOptimizer(inner, loss_scale=active.resolved_loss_scale, policy=policy)


# --- callbacks --------------------------------------------------------------------------------

def callback_model(callback: Any) -> Any:
    """The callback's model, without the JAX state sync that ``Callback.model`` performs on every
    access (it puts the traced state back into the variables, and the next step re-gathers it:
    callbacks that run every step read ``model._jax_state`` instead)."""
    return callback._model if active_backend() == "jax" else callback.model


class LossScaleCallback(keras.callbacks.Callback):
    """Enforces ``on_min_scale = "warn" | "error"`` during a compiled ``fit``.

    After each batch it reads the count of overflows at ``min_scale`` (one host sync per
    step, only when those modes are set) and warns once or raises
    :class:`ampbridge.LossScaleError`.
    """

    def _optimizer(self) -> LossScaleOptimizer | None:
        opt = getattr(callback_model(self), "optimizer", None)
        return opt if isinstance(opt, LossScaleOptimizer) else None

    def on_train_begin(self, logs: Any = None) -> None:
        opt = self._optimizer()
        if opt is not None:
            opt.host_checked = True

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        opt = self._optimizer()
        if opt is None or not opt._needs_host_check() or not opt.built:
            return
        jax_state = getattr(callback_model(self), "_jax_state", None)
        if jax_state:
            index = next(i for i, v in enumerate(opt.variables) if v is opt.min_scale_overflows)
            opt.check_min_scale(jax_state["optimizer_variables"][index])
        else:
            opt.check_min_scale()

"""Precision schedules (``[[phase]]``) for a linen model: one jitted train step per phase,
parameters re-cast and the loss-scale state moved on at each boundary.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax

from ...core.plan import Plan
from ...core.policy import Policy
from .apply import Applied, apply
from .environment import phase_policy
from .loss_scale import enter_phase, optimizer


class Schedule:
    """A precision schedule (``[[phase]]``) for a linen model: one jitted train step per phase.

    Write the train step once, for any phase::

        def train_step(amp, tx, params, opt_state, x, y):
            def loss_fn(p):
                return ampbridge.jax.scale_loss(cross_entropy(amp.apply({"params": p}, x), y), opt_state)
            grads = jax.grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        schedule = ampbridge.jax.Schedule(module, policy, optax.adam(1e-3), train_step)
        params, opt_state = schedule.init(jax.random.key(0), x)
        for epoch in range(epochs):
            for x, y in batches:
                params, opt_state = schedule(params, opt_state, x, y, epoch=epoch)

    ``amp`` and ``tx`` are the phase's :class:`Applied` model and :func:`optimizer`. Each phase's
    step is traced and compiled once and cached (``traces`` counts them). At a phase boundary
    the parameters are re-cast to the new phase's ``param_dtype`` rows and the loss-scale state
    moves on by the core's rule (:func:`enter_phase`: carried over, or fresh on ``reset = true`` or
    a loss-scale mode change); the inner optimizer state (Adam's moments, its count) carries over
    untouched. ``params`` may be the ``params`` collection or the whole variables dict.

    The schedule follows one run: it remembers the phase of the state it last returned. After
    restoring a checkpoint, call ``resume(epoch=...)`` (or ``step=``) before the next step.
    """

    def __init__(self, module: Any, policy: Policy | str, inner: Any, train_step: Callable[..., Any], *,
                 host_callback: bool = False, **jit_kwargs: Any):
        self.amp = apply(module, policy)
        if not isinstance(self.amp, Applied):
            raise TypeError("ampbridge.jax.Schedule drives flax.linen modules; for flax.nnx apply the "
                            "phase's policy with ampbridge.jax.apply(model, policy.at(epoch=...))")
        self.policy = self.amp.schedule
        self.inner = inner
        self.train_step = train_step
        self.host_callback = host_callback
        self.jit_kwargs = jit_kwargs
        self.traces: dict[int | None, int] = {}
        self.phase: int | None | str = "unset"
        self._steps: dict[int | None, Callable] = {}
        self._txs: dict[int | None, Any] = {}
        self._models: dict[int | None, Applied] = {}
        self._lock = threading.Lock()

    # -- phases --
    def key(self, *, step: int | None = None, epoch: int | None = None) -> int | None:
        """The phase index in force (None: past a closed last phase, the top-level settings)."""
        if not self.policy.phases:
            return 0
        return self.policy.phase_index(step=step, epoch=epoch)

    def _policy_of(self, key: int | None) -> Policy:
        return self.policy.phase_policy(key)  # (no schedule: the whole policy)

    def _at(self, key: int | None) -> tuple[Applied, Any]:
        with self._lock:
            if key in self._txs:
                return self._models[key], self._txs[key]
        model = self.amp if not self.policy.phases else self._model_for(key)
        tx = optimizer(self.inner, self._policy_of(key), host_callback=self.host_callback)
        with self._lock:
            self._txs.setdefault(key, tx)
            self._models.setdefault(key, model)
            return self._models[key], self._txs[key]

    def _model_for(self, key: int | None) -> Applied:
        policy = self._policy_of(key)
        return self.amp.phase_model(policy)

    def model(self, *, step: int | None = None, epoch: int | None = None) -> Applied:
        """The :class:`Applied` model of the phase in force."""
        return self._at(self.key(step=step, epoch=epoch))[0]

    def optimizer(self, *, step: int | None = None, epoch: int | None = None) -> Any:
        """The loss-scaling optimizer of the phase in force."""
        return self._at(self.key(step=step, epoch=epoch))[1]

    def plan(self, *example_inputs: Any, step: int | None = None, epoch: int | None = None, **kw: Any) -> Plan:
        return self.model(step=step, epoch=epoch).plan(*example_inputs, **kw)

    # -- state --
    def init(self, rngs: Any, *example_inputs: Any, step: int | None = None, epoch: int | None = None,
             collections: bool = False, **kwargs: Any) -> tuple[Any, Any]:
        """``(params, opt_state)`` for the phase in force (``collections=True``: all variables)."""
        if step is None and epoch is None:
            step, epoch = 0, 0
        key = self.key(step=step, epoch=epoch)
        model, tx = self._at(key)
        variables = jax.jit(functools.partial(model.init, **kwargs))(rngs, *example_inputs)
        params = variables if collections else variables["params"]
        opt_state = jax.jit(tx.init)(variables["params"])
        self.phase = key
        return params, opt_state

    def resume(self, *, step: int | None = None, epoch: int | None = None) -> None:
        """Declare the phase of a restored state (no conversion happens)."""
        self.phase = self.key(step=step, epoch=epoch)

    def _recast(self, model: Applied, params: Any) -> Any:
        if isinstance(params, Mapping) and "params" in params:
            return model.cast_params(params)
        return model.cast_params({"params": params})["params"]

    def enter(self, params: Any, opt_state: Any, *, step: int | None = None,
              epoch: int | None = None) -> tuple[Any, Any]:
        """Move ``(params, opt_state)`` into the phase in force (a no-op inside a phase)."""
        key = self.key(step=step, epoch=epoch)
        if self.phase == "unset":
            self.phase = key
        if key == self.phase:
            return params, opt_state
        order = list(range(len(self.policy.phases))) + [None]
        path = [key]
        if self.phase in order and key in order and order.index(key) > order.index(self.phase):
            path = order[order.index(self.phase) + 1:order.index(key) + 1]
        previous = phase_policy(self._policy_of(self.phase)).resolved_loss_scale
        for k in path:
            cfg = phase_policy(self._policy_of(k)).resolved_loss_scale
            reset = k is not None and self.policy.phases[k].reset_loss_scale
            opt_state = enter_phase(opt_state, cfg, previous, reset=reset)
            previous = cfg
        params = self._recast(self._at(key)[0], params)
        self.phase = key
        return params, opt_state

    # -- the steps --
    def step_fn(self, *, step: int | None = None, epoch: int | None = None) -> Callable:
        """The jitted train step of the phase in force (traced once per phase, then cached)."""
        key = self.key(step=step, epoch=epoch)
        with self._lock:
            hit = self._steps.get(key)
        if hit is not None:
            return hit
        model, tx = self._at(key)

        def traced(*args: Any, **kwargs: Any) -> Any:
            self.traces[key] = self.traces.get(key, 0) + 1  # runs only while tracing
            return self.train_step(model, tx, *args, **kwargs)

        fn = jax.jit(traced, **self.jit_kwargs)
        with self._lock:
            self._steps.setdefault(key, fn)
            return self._steps[key]

    def __call__(self, params: Any, opt_state: Any, *args: Any, step: int | None = None,
                 epoch: int | None = None, **kwargs: Any) -> Any:
        """``enter`` the phase in force, then run its jitted step."""
        params, opt_state = self.enter(params, opt_state, step=step, epoch=epoch)
        return self.step_fn(step=step, epoch=epoch)(params, opt_state, *args, **kwargs)

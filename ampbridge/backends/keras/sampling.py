"""Between a ``MonitorCallback``'s samples: ``model.train_function`` as a dispatch between
Keras's own train function traced without the monitor (unsampled steps) and with it (sampled),
and the replay of a non-finite unsampled step (TensorFlow and torch: read at the step, replayed
in a sandbox; JAX: read in windows, replayed exactly from the window's saved state).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from ...errors import AmpBridgeWarning, UnsupportedOptionError
from ..common import read_host_scalar
from .environment import active_backend
from .numerics import host_value


class SamplingHooks(NamedTuple):
    """What the dispatch may do to its monitor beyond the public ``record``: the one interface
    between this room and monitor.py (``Monitor.sampling_hooks`` builds it)."""

    unsampled: Callable[[], contextlib.AbstractContextManager[Any]]  # run and trace as if no monitor were attached
    count: Callable[[int], None]  # an unread (finite) step seen: counted for the closing record
    unreplayed: Callable[[int, float], None]  # a skipped step that could not be replayed: logged as such
    expect: Callable[[int], None]  # the step the next record() is


class FitDispatch:
    """``model.train_function`` while a :class:`MonitorCallback` monitors ``fit``: two of Keras's own
    train functions, made by Keras's ``make_train_function``, one traced without the monitor
    (unsampled steps: the same graph / program / ops as no monitor) and one with it (sampled
    steps). On TensorFlow and torch the host reads one scalar after an unsampled step, the
    optimizer's skipped-step counter; when it moved, the step was non-finite and skipped (weights
    and optimizer variables as they were), and it is replayed on the same batch with the
    statistics function, from the loss-scale state the step started with (kept on the host by
    the reference algorithm), in a sandbox: every variable (model, optimizer, metrics) is put back
    afterwards. Layers that draw random numbers (dropout) draw them again there, so their masks
    differ from the skipped step's. On JAX (NNX off) an unsampled step is not read at all: its finite flag
    (an extra output of the same program) is read at the next sample with the window's others,
    and a skipped step is replayed exactly, from a copy of the state the window started from (see
    :meth:`flush`). Where non-finite steps are applied (``skip_nonfinite`` off) there is nothing
    to replay: every step runs the statistics function and is read at the step.
    """

    def __init__(self, monitor: Any):  # a monitor.Monitor (imported there: no circle)
        self.monitor = monitor
        self.hooks: SamplingHooks = monitor.sampling_hooks()
        model = monitor.model
        # Keras's TensorFlow and JAX trainers capture the train step when they make the function,
        # so `plain` enters the unsampled mode only while it is traced; its torch trainer (and JAX
        # under NNX) look `model.train_step` up at each call, so there every unsampled call enters it.
        self._mode_each_call = active_backend() == "torch" or getattr(keras.config, "is_nnx_enabled", lambda: False)()
        # JAX (Keras's own jit): unsampled steps are read late, at the next sample (see _late_step)
        self._late = active_backend() == "jax" and not self._mode_each_call
        self.plain = self._keras_train_function(model, self.hooks.unsampled, finite_out=self._late)
        self.stats = self._keras_train_function(model)
        self._own_at: list[int] | None = None  # JAX: the loss-scale state's places in the optimizer values
        self._window: list[tuple[int, Any, Any]] = []  # JAX: (step, batch, finite flag) since _origin
        self._origin: Any = None  # JAX: a copy of the state the window's first step started from
        self.sync()
        model.train_function = self

    @staticmethod
    def _keras_train_function(model: Any, mode: Any = None, finite_out: bool = False) -> Any:
        """Keras's own ``make_train_function``, over a train step of its own: JAX caches traces by
        the function jitted, and two jits of the same bound ``train_step`` would share one.
        ``mode`` (a context manager) is entered around that train step: under ``jit`` and
        ``tf.function`` only while it is traced, so a compiled step pays nothing for it.
        ``finite_out`` (JAX): the step returns ``((logs, finite), state)``, ``finite`` the flag the
        loss-scale optimizer computes anyway (an output more, no op more; the state is donated as
        Keras donates it, and the flag is not part of it, so it outlives the next step's dispatch)."""
        own = model.__dict__.get("train_step")
        step = functools.partial(own or type(model).train_step, *(() if own else (model,)))
        if mode is not None:
            inner = step

            def step(*args: Any, **kwargs: Any) -> Any:
                with mode():
                    return inner(*args, **kwargs)
        if finite_out:
            whole = step

            def step(*args: Any, **kwargs: Any) -> Any:
                optimizer, flags = model.optimizer, []
                object.__setattr__(optimizer, "_finite_out", flags)
                try:
                    logs, state = whole(*args, **kwargs)
                finally:
                    object.__setattr__(optimizer, "_finite_out", None)
                if len(flags) != 1:
                    raise UnsupportedOptionError(
                        f"MonitorCallback: the train step applied the optimizer {len(flags)} times; the monitor "
                        "reads one optimizer step per train step")
                return (logs, flags[0]), state
        object.__setattr__(model, "train_step", step)
        try:
            model.make_train_function(force=True)
        finally:
            if own is None:
                del model.__dict__["train_step"]
            else:
                object.__setattr__(model, "train_step", own)
        return model.train_function

    def sync(self) -> None:
        """Read the loss-scale state (at each ``fit``'s start: it may have moved in between)."""
        self._state = self.monitor.optimizer.state
        self._finite = 0  # finite steps since self._state, not yet folded in (see `state`)
        self.step = self._state.steps

    @property
    def state(self) -> Any:
        """The loss-scale state the next step starts from, by the reference algorithm. Finite steps
        are counted on the host and folded in here, when a replay needs the state, rather than
        each step: an unsampled step costs its host no more than the counter read."""
        from ...core.loss_scale import next_state

        for _ in range(self._finite):
            self._state = next_state(self.monitor.optimizer.loss_scale_config, self._state, False)
        self._finite = 0
        return self._state

    def __call__(self, *args: Any) -> Any:
        backend = active_backend()
        if backend == "jax":
            state, iterator = args
            data = next(iterator)

            def run(fn: Any, state: Any = state) -> Any:
                return fn(state, iter([data]))
        elif backend == "tensorflow":
            data = next(args[0])  # the batch, for a replay; Keras's function then runs it as it would

            def run(fn: Any) -> Any:
                return fn([data])
        else:
            data = args[0]

            def run(fn: Any) -> Any:
                return fn(data)
        monitor, opt, step = self.monitor, self.monitor.optimizer, self.step
        self.step += 1
        cfg = opt.loss_scale_config
        if step % monitor.every == 0 or not cfg.skip_nonfinite or cfg.max_consecutive_skips is not None:
            # sampled; or non-finite steps are (or may be) applied (nothing to replay), so every step is read
            self.flush()
            opt.monitor_spec.host_step = step
            monitor.fp8_snapshot(step, args[0][0] if backend == "jax" else None)  # float8: the divisors it uses
            out = run(self.stats)
            self.hooks.expect(step)
            if backend == "jax":
                record = monitor.record(non_trainable_variables=out[1][1], optimizer_variables=out[1][2],
                                        trainable_variables=out[1][0])
            else:
                record = monitor.record()
            self._advance(bool(record and record["found_inf"]))
            return out
        if self._late:
            return self._late_step(step, args[0], data)
        if self._mode_each_call:
            with self.hooks.unsampled():
                out = run(self.plain)
        else:
            out = run(self.plain)  # traced inside hooks.unsampled(): see _keras_train_function
        if self._skipped(out) == self._state.skipped:  # the one read of an unsampled step
            self._advance(False)
            self.hooks.count(step)
            return out
        before = self.state
        self._advance(True)
        self._replay(before, run, out[1] if backend == "jax" else None)
        return out

    def _own_places(self) -> list[int]:
        """JAX: the loss-scale state's places in the optimizer values (found once)."""
        if self._own_at is None:
            opt = self.monitor.optimizer
            index = {id(v): i for i, v in enumerate(opt.variables)}
            self._own_at = [index[id(v)] for v in opt._state_variables]
        return self._own_at

    def _late_step(self, step: int, state: Any, data: Any) -> Any:
        """An unsampled JAX step: queued, not read. The host keeps its batch and finite flag (an
        output of the step, not of the donated state); the first step of a window also keeps a
        copy of the state it starts from (one copy program per window). :meth:`flush`
        reads the flags at the next sample, when they have long arrived, so the host never waits
        for an unsampled step and keeps queueing ahead as it does without a monitor."""
        if self._origin is None:
            self._origin = _copy_state(state)
        (logs, finite), state = self.plain(state, iter([data]))
        self._window.append((step, data, finite))
        if len(self._window) >= _WINDOW:  # bounds the batches kept, and the steps a replay reruns
            self.flush()
        return logs, state

    def flush(self) -> None:
        """Read the unsampled steps queued since the last sample (JAX): their finite flags, in one
        transfer. A non-finite one was skipped; it is replayed exactly: from the window's saved
        state the unsampled function reruns the steps before it on their batches (the same
        programs on the same values, so the same results, dropout masks included), and the
        statistics function then runs the skipped step on a copy. The callback flushes at each
        sample and at each epoch's and ``fit``'s end."""
        window, origin = self._window, self._origin
        self._window, self._origin = [], None
        if not window:
            return
        import jax

        flags = [bool(f) for f in jax.device_get([finite for _, _, finite in window])]
        state, done = origin, 0  # the replay's state: origin advanced through window[:done]
        for i, ((step, batch, _), finite) in enumerate(zip(window, flags)):
            if finite:
                self._advance(False)
                self.hooks.count(step)
                continue
            before = self.state
            self._advance(True)
            if state is not None:
                rerun = []
                for _, earlier, _ in window[done:i]:
                    (_, again), state = self.plain(state, iter([earlier]))
                    rerun.append(again)
                start = _copy_state(state)  # the state the skipped step started from (the replay donates it)
                (_, again), state = self.plain(state, iter([batch]))  # the skipped step itself, as fit ran it
                state = self._rerun_agrees(state, rerun + [again], flags[done:i] + [False], window[done][0])
            if state is None:  # not replayable: the step is logged with what the host knows
                self.hooks.unreplayed(step, before.scale)
                continue

            def run(fn: Any, replay_state: Any, batch: Any = batch) -> Any:
                return fn(replay_state, iter([batch]))
            self._replay(before, run, start, disposable=True)
            done = i + 1

    def _rerun_agrees(self, state: Any, rerun: list[Any], flags: list[bool], first: int) -> Any:
        """``state`` if the rerun steps' finite flags are fit's, else None (with a warning)."""
        import jax

        again = [bool(f) for f in jax.device_get(rerun)]
        if again == flags:
            return state
        at = first + next(k for k, (a, b) in enumerate(zip(again, flags)) if a != b)
        warnings.warn(
            f"ampbridge MonitorCallback: rerunning step {at} from the state saved before it gave a "
            f"{'finite' if again[at - first] else 'non-finite'} step where fit's was not (a train step that is not "
            "deterministic on its inputs, or a batch changed in place after fit used it): the skipped steps of that "
            "window are logged without layer statistics or first_nonfinite", AmpBridgeWarning, stacklevel=2)
        return None

    def _skipped(self, out: Any) -> int:
        """The skipped-step counter after the step: one 4-byte read (on torch's CPU the counter's
        own memory, read without an aten op)."""
        backend = active_backend()
        if backend == "jax":
            return int(host_value(out[1][2][self._own_places()[4]]))
        value = self.monitor.optimizer.skipped_steps.value
        if backend == "torch" and value.device.type == "cpu" and value.is_contiguous():
            return int(read_host_scalar(value.data_ptr(), "int32"))
        return int(host_value(value))

    def _advance(self, found_inf: bool) -> None:
        from ...core.loss_scale import LossScaleError, next_state

        if not found_inf:
            self._finite += 1
            return
        try:
            self._state = next_state(self.monitor.optimizer.loss_scale_config, self.state, True, warned=[True])
        except LossScaleError:
            self.sync()

    def _replay(self, before: Any, run: Any, state: Any, disposable: bool = False) -> None:
        """Run the statistics function on the step ``run`` runs, from ``state`` (JAX; copied first
        unless ``disposable``: the function donates it) and the loss-scale state ``before``."""
        monitor, opt, model = self.monitor, self.monitor.optimizer, self.monitor.model
        own = [before.good_steps, np.float32(before.scale), before.hysteresis_left, before.steps, before.skipped]
        opt.monitor_spec.host_step = 0  # torch samples on the host: this step is
        self.hooks.expect(before.steps)
        if active_backend() == "jax":
            import jax.numpy as jnp

            trainable, non_trainable, opt_values, metrics = state if disposable else _copy_state(state)
            opt_values = list(opt_values)
            for at, value in zip(self._own_places(), own):
                opt_values[at] = jnp.asarray(value, opt_values[at].dtype)
            _, replayed = run(self.stats, (trainable, non_trainable, opt_values, metrics))
            monitor.record(non_trainable_variables=replayed[1], optimizer_variables=replayed[2])
            return
        seen: set[int] = set()
        variables = [v for v in (model.trainable_variables + model.non_trainable_variables + opt.variables
                                 + model.metrics_variables) if not (id(v) in seen or seen.add(id(v)))]
        saved = [ops.copy(v.value) for v in variables]
        try:
            for v, x in zip(opt._state_variables, own):
                v.assign(x)
            run(self.stats)
            monitor.record()
        finally:
            for v, x in zip(variables, saved):
                v.assign(x)


def _copy_state(state: Any) -> Any:
    """A copy of a JAX train state (one program): the step it is passed to donates its input."""
    import jax

    global _COPY
    if _COPY is None:
        _COPY = jax.jit(lambda s: jax.tree.map(jax.numpy.copy, s))
    return _COPY(state)


_COPY: Any = None
_WINDOW = 100  # JAX: unsampled steps read at most this late (at every sample, and at least this often)

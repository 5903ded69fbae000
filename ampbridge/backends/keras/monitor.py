"""The numerics monitor: per-layer gradient statistics and where a non-finite step started,
written as the shared run log (``ampbridge report`` reads it), in ``fit`` or a custom loop.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import keras
import numpy as np
from keras import ops

from ...core.policy import Policy
from ...errors import UnsupportedOptionError
from .apply import observe_apply, probe_of, refresh_compiled, set_probe, unobserve_apply
from .environment import active_backend
from .fp8_stats import float8_layers, history_variables, scale_variables, tensor_stats
from .layers import children, code_caller, walk
from .distributed import replicas
from .loss_scale import LossScaleOptimizer, callback_model
from .numerics import LAYOUT, MonitorSpec, all_finite, fetch
from .plan import is_float, plan
from .sampling import FitDispatch, SamplingHooks

# --- the numerics monitor -----------------------------------------------------------------------
#
# Where each number comes from (the same on TensorFlow, JAX and torch):
# * per-layer gradient statistics, found_inf, the scale used: the LossScaleOptimizer, which sees
#   the scaled gradients in `apply` / `stateless_apply`, computes them in keras.ops inside the
#   train step and keeps them in two optimizer variables (left out of checkpoints);
# * the forward flags (the first non-finite value at a layer's inputs or output, in call order),
#   the backward flags (TensorFlow and torch: the first leaf, in backward execution order, whose
#   input gradient went non-finite) and the step's loss: scalar variables that Keras threads
#   through every backend's train step as non-weight layer state (the slot JAX's stateless
#   calls give seed-generator states), written by ampbridge's `call` wrapper on each leaf and
#   by a wrapper on `model.compute_loss`.
# The host reads all of it once per step, as one array (one transfer).

_SLOT_NAMES = ("forward", "backward", "loss", "loss_seen")  # the model-side values, in record order


def _pinned(rows: Any, compute_dtype: str) -> dict[str, str]:
    """The layers a rule keeps in float32 while the policy computes in another dtype, by rule."""
    return {r.path: r.rule for r in rows if r.path and r.rule != "default"
            and r.compute_dtype == "float32" != compute_dtype}


class _Slot:
    """A float32 scalar that Keras carries through every backend's train step without it being a
    weight: kept in the model's seed-generator list, which ``Layer.variables`` (so JAX's
    stateless state) includes and ``weights``, ``get_weights`` and saving leave out."""

    def __init__(self, name: str, value: float):
        self.state = keras.Variable(np.float32(value), dtype="float32", trainable=False, autocast=False,
                                    aggregation="none", name=name)


def _live(tensors: list[Any]) -> bool:
    """Whether these are values of a real (possibly traced) step, not symbolic shapes."""
    for t in tensors:
        if keras.backend.is_keras_tensor(t) or getattr(getattr(t, "device", None), "type", None) == "meta":
            return False
        if type(t).__name__ == "ShapeDtypeStruct":
            return False
    return True


def _mark_first(slot: _Slot, bad: Any, index: int) -> None:
    """``slot = index`` if ``bad`` and nothing is marked yet (on the device, no sync)."""
    current = slot.state.value
    if active_backend() == "torch":  # eager: one in-place op instead of a chain of Keras dispatches
        import torch

        with torch.no_grad():
            current.masked_fill_(torch.logical_and(current < 0, bad), float(index))
        return
    slot.state.assign(ops.where(ops.logical_and(ops.less(current, 0.0), bad), np.float32(index), current))


def _any_nonfinite(tensors: list[Any]) -> Any:
    return ops.logical_not(all_finite(tensors))


def _input_probe(t: Any, slot: _Slot, index: int) -> Any:
    """Identity on ``t`` whose backward marks ``index`` in ``slot`` when the gradient reaching
    ``t`` (this layer's input gradient) is non-finite and nothing was marked before it."""
    backend = active_backend()
    if backend == "tensorflow":
        import tensorflow as tf

        @tf.custom_gradient
        def identity(x: Any) -> Any:
            def grad(upstream: Any) -> Any:
                _mark_first(slot, _any_nonfinite([upstream]), index)
                return upstream

            return tf.identity(x), grad

        return identity(t)
    if backend == "torch" and t.requires_grad:
        t = t.view_as(t)  # this layer's use of the input only

        def hook(g: Any) -> None:
            _mark_first(slot, _any_nonfinite([g]), index)

        t.register_hook(hook)
    return t


def _event(index: int, output: bool) -> int:
    """The forward slot's code for a layer's inputs (even) or output (odd); the root's index is -1."""
    return 2 * (index + 1) + int(output)


def _live_floats(tree: Any) -> list[Any]:
    floats = [t for t in keras.tree.flatten(tree) if is_float(t)]
    return floats if floats and _live(floats) else []


class _BoundaryProbe:
    """A container's (a block's) hooks: in the order calls start and finish, the first non-finite
    forward value is marked: its inputs (made by the code around it) or its output (its own code:
    a residual add, a learned skip projection, a cast)."""

    def __init__(self, monitor: "Monitor", index: int):
        self.monitor, self.index = monitor, index

    def before(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        floats = _live_floats((args, kwargs))
        if floats:
            _mark_first(self.monitor._slots["forward"], _any_nonfinite(floats), _event(self.index, False))
        return args, kwargs

    def after(self, out: Any) -> None:
        floats = _live_floats(out)
        if floats:
            _mark_first(self.monitor._slots["forward"], _any_nonfinite(floats), _event(self.index, True))


class _LeafProbe(_BoundaryProbe):
    """A leaf layer's hooks: a boundary's, and the first non-finite input gradient."""

    def before(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = super().before(args, kwargs)
        if active_backend() == "jax":  # JAX's backward cannot write state: parameter gradients decide there
            return args, kwargs
        if not _live_floats((args, kwargs)):
            return args, kwargs
        slot = self.monitor._slots["backward"]
        return keras.tree.map_structure(lambda t: _input_probe(t, slot, self.index) if is_float(t) else t,
                                        (args, kwargs))


class _RootProbe:
    """The model's hook: a new forward pass starts with nothing marked and no loss seen."""

    def __init__(self, monitor: "Monitor"):
        self.monitor = monitor

    def before(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        tensors = [t for t in keras.tree.flatten((args, kwargs)) if hasattr(t, "shape")]
        if tensors and _live(tensors):
            for name, value in (("forward", -1.0), ("backward", -1.0), ("loss_seen", 0.0)):
                self.monitor._slots[name].state.assign(np.float32(value))
            floats = _live_floats((args, kwargs)) if self.monitor.attribution else []
            if floats:  # the model's inputs: the first forward values
                _mark_first(self.monitor._slots["forward"], _any_nonfinite(floats), _event(-1, False))
        return args, kwargs

    def after(self, out: Any) -> None:
        pass


class Monitor:
    """The numerics log of a Keras model trained with ampbridge's :class:`LossScaleOptimizer`.

    Writes the shared JSON Lines log (``ampbridge.diagnostics.runlog``; read it with ``ampbridge report``):
    a header, then a record for every ``every``-th optimizer step (step 0 included) with each
    layer's gradient statistics, and a record for every step whose gradients were non-finite,
    with ``first_nonfinite`` naming where it started. ``fit`` users pass a
    :class:`MonitorCallback`; a custom loop makes a ``Monitor`` once the model is built (and
    before tracing its train step) and calls :meth:`record` after each optimizer step.

    How it is computed, on every Keras backend: the optimizer sees the scaled gradients and
    computes the statistics in ``keras.ops`` inside the train step (only on sampled steps); an
    ampbridge ``call`` wrapper on each layer (containers too) marks the first non-finite forward
    value, in call order, at a layer's inputs or output (a layer fed non-finite inputs is never
    named: the code that made them is, or the model's inputs), and on TensorFlow and torch the
    first non-finite input gradient of a leaf in backward order
    (on JAX the backward pass cannot write state, so the gradient attribution there is the last
    leaf, in forward order, whose own parameter gradients are non-finite); the step's loss comes
    from a wrapper on ``model.compute_loss`` or from :meth:`record`. The host reads it all as
    one array per step (one transfer, one sync: the step's ``found_inf`` decides whether the
    step is logged). ``attribution=False`` drops the per-step forward/backward flags.

    Example (a custom loop on any backend; ``fit`` passes ``callbacks=[MonitorCallback(path)]``):
        >>> import os, tempfile, keras, numpy as np, ampbridge
        >>> policy = ampbridge.preset("mixed_float16").replace(loss_scale=ampbridge.LossScaleConfig(initial_scale=1024))
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense")])
        >>> model = ampbridge.keras.apply(model, policy)
        >>> model.compile(ampbridge.keras.optimizer(keras.optimizers.SGD(), policy), "mse")
        >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> with Monitor(path, model, every=10) as monitor:
        ...     _ = model.fit(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)  # or your own loop
        ...     record = monitor.record()
        >>> record["step"], sorted(record["layers"]), record["layers"]["dense"]["zero"]
        (0, ['dense'], 0.0)
    """

    def __init__(self, path: Any, model: Any, *, optimizer: Any = None, every: int = 1,
                 attribution: bool = True):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Monitor: every must be a positive integer (log every N-th step); received "
                             f"every={every!r}")
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"Monitor: expected a Keras model; received {type(model).__qualname__}")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if not isinstance(optimizer, LossScaleOptimizer):
            raise UnsupportedOptionError(
                "Monitor needs the model's optimizer to be ampbridge's LossScaleOptimizer (it sees the scaled "
                "gradients): compile with ampbridge.keras.optimizer(inner, policy), or pass optimizer=; received "
                f"{type(optimizer).__name__}")
        if not model.built:
            raise ValueError("Monitor: build the model first (call it on data, or fit/compile with an Input), "
                             "so every layer it will run exists")
        if int(getattr(model, "steps_per_execution", 1) or 1) > 1:
            raise UnsupportedOptionError(
                f"Monitor: steps_per_execution={model.steps_per_execution} runs several steps between callbacks, "
                "so non-finite steps could not all be logged; compile with steps_per_execution=1")
        # fit runs a model built in a tf.distribute scope under that strategy even outside the scope
        # (MonitorCallback starts there): its strategy counts too
        strategy = getattr(model, "distribute_strategy", None) if active_backend() == "tensorflow" else None
        n_replicas = max(replicas(), int(getattr(strategy, "num_replicas_in_sync", 1)))
        if n_replicas > 1:
            raise UnsupportedOptionError(
                f"Monitor: a distributed (multi-replica) run is not supported ({n_replicas} replicas: each computes "
                "the statistics and flags of its own shard, so the log would describe one replica)")
        self.path, self.model, self.optimizer = path, model, optimizer
        self.every, self.attribution = every, bool(attribution)
        self.layers: list[str] = []
        self._slots: dict[str, _Slot] = {}
        self._writer: Any = None
        self._attached = False
        self._positions: tuple[list[int], list[int]] | None = None
        self._next_step: int | None = None
        self._seen: tuple[int, int, int] = (0, -1, -1)  # steps read, the first and last step number (the closing record)
        self._by_path: dict[str, Any] = {}
        self._probed: list[tuple[Any, Any]] = []  # (call wrapper, its probe): switched off on unsampled fit steps
        self._quiet = False  # True while an unsampled fit step runs (or traces): compute_loss records nothing
        self._fp8_layers: list[tuple[str, Any]] = []  # (path, layer) of the float8-quantized layers
        self._fp8_used: tuple[int, Any] | None = None  # (step, the divisors that step quantizes with)
        self._fp8_at: list[int] | None = None  # their variables' places in model.trainable_variables
        self.attach()

    # --- attaching to the model and optimizer ---

    def _policy(self) -> Policy:
        policy = getattr(self.model, "_ampbridge_policy", None) or self.optimizer.policy
        if policy is None:
            from ...core.io import preset

            policy = preset("float32")
        return policy.at(step=0, epoch=0)

    def attach(self) -> None:
        """Start monitoring (the constructor does; again after :meth:`detach`). Re-traces the
        model's compiled functions."""
        if self._attached:
            return
        if not self._slots:
            self._slots = {name: _Slot(f"ampbridge_monitor_{name}", value)
                           for name, value in zip(_SLOT_NAMES, (-1.0, -1.0, np.nan, 0.0))}
        self.model._seed_generators.extend(self._slots.values())
        if hasattr(self.model, "compute_loss") and "compute_loss" not in self.model.__dict__:
            inner = self.model.compute_loss

            @functools.wraps(inner)
            def compute_loss(*args: Any, **kwargs: Any) -> Any:
                loss = inner(*args, **kwargs)
                if not self._quiet and loss is not None and _live([loss]):
                    self._slots["loss"].state.assign(ops.cast(ops.reshape(loss, ()), "float32"))
                    self._slots["loss_seen"].state.assign(np.float32(1.0))
                return loss

            object.__setattr__(self.model, "compute_loss", compute_loss)
        observe_apply(self.model, self._refresh)  # a new policy: new rows, new thresholds
        self._attached = True
        host_step = self.optimizer.state.steps if self.optimizer.built else 0
        self._refresh(host_step=host_step)
        if self._writer is None:
            from ...core.io import policy_to_dict
            from ...diagnostics.runlog import RunLogWriter

            policy = self._policy()
            self._writer = RunLogWriter(self.path, framework=f"keras ({active_backend()})",
                                        compute_dtype=policy.compute_dtype, layers=self.layers,
                                        policy=policy_to_dict(policy),
                                        min_scale=self.optimizer.loss_scale_config.min_scale,
                                        extra={"every": self.every, "attribution": self.attribution,
                                               # what the policy already pins: report's advice never repeats it
                                               "pinned": _pinned(plan(self.model, policy, warn=False),
                                                                 policy.compute_dtype)})

    def _refresh(self, host_step: int | None = None) -> None:
        """(Re)build the probes and the optimizer's layout from the model's current Plan (also after
        :func:`apply` changes the policy, e.g. at a phase boundary)."""
        rows = plan(self.model, self._policy(), warn=False)
        by_path = self._by_path = dict(walk(self.model))
        self.layers = [row.path for row in rows if row.path]
        index = {path: i for i, path in enumerate(self.layers)}
        stats, leaf_of = [], {}
        self._probed = []
        for row in rows:
            layer = by_path[row.path]
            leaf = row.path != "" and not children(layer)
            own = [v for v in layer._trainable_variables if v.trainable]
            if own:
                stats.append((row.path, row.compute_dtype, tuple(id(v) for v in own)))
            if leaf:
                leaf_of.update({id(v): index[row.path] for v in own})
            probe: Any = None
            if row.path and self.attribution:  # containers too: a value can go non-finite in a block's own code
                probe = (_LeafProbe if leaf else _BoundaryProbe)(self, index[row.path])
            if row.path == "":
                probe = _RootProbe(self)
            wrapper = set_probe(layer, probe)
            if probe is not None:
                self._probed.append((wrapper, probe))
        self._positions = None
        self._fp8_layers, self._fp8_at = float8_layers(self.layers, by_path), None
        if self._fp8_layers and host_step is not None:
            self.fp8_snapshot(host_step)
        previous = self.optimizer.monitor_spec
        steps = host_step if host_step is not None else (previous.host_step if previous is not None else 0)
        self.optimizer.attach_monitor(MonitorSpec(self.every, stats, leaf_of, steps))
        refresh_compiled(self.model)

    def sampling_hooks(self) -> SamplingHooks:
        """The monitor's side of ``fit``'s sampling dispatch (sampling.py): its unsampled mode, its
        step counting and the logging of a step it could not replay."""
        return SamplingHooks(unsampled=self._unsampled, count=self._count, unreplayed=self._unreplayed,
                             expect=self._expect)

    def _expect(self, step: int) -> None:
        self._next_step = step

    @contextlib.contextmanager
    def _unsampled(self) -> Any:
        """While inside, the model and optimizer run (and trace) as if no monitor were attached: no
        probes, no statistics, no loss slot (the monitor's variables stay, unused)."""
        for wrapper, _ in self._probed:
            wrapper.probe = None
        self._quiet = True
        try:
            with self.optimizer.monitor_paused():
                yield
        finally:
            self._quiet = False
            for wrapper, probe in self._probed:
                wrapper.probe = probe

    def _unreplayed(self, step: int, scale: float) -> None:
        """A skipped step that could not be replayed: logged with what the host knows."""
        self._count(step)
        self._writer.step(step, loss=None, loss_scale=scale, found_inf=True, skipped=True, layers={},
                          first_nonfinite=None)

    def _count(self, step: int) -> None:
        """A step seen (read or not: an unsampled finite fit step is not): counted for the closing record."""
        seen, first, _ = self._seen
        self._seen = (seen + 1, first if seen else step, step)
        self._next_step = step + 1

    def detach(self) -> None:
        """Stop monitoring: the model and optimizer run as before (the log stays open)."""
        if not self._attached:
            return
        if getattr(self.model, "_jax_state", None) and not getattr(self.model, "_jax_state_synced", True):
            self.model.jax_state_sync()  # the traced state holds the slots: put it back first
        for _, layer in walk(self.model):
            if isinstance(probe_of(layer), (_BoundaryProbe, _RootProbe)):
                set_probe(layer, None)
        for slot in self._slots.values():
            self.model._seed_generators.remove(slot)
        if "compute_loss" in self.model.__dict__:
            del self.model.__dict__["compute_loss"]
        unobserve_apply(self.model, self._refresh)
        self.optimizer.attach_monitor(None)
        refresh_compiled(self.model)
        self._attached = False

    def close(self) -> None:
        """Detach, write the closing record and close the log."""
        self.detach()
        if self._writer is not None:
            self._end()
            self._writer.close()

    def _end(self) -> None:
        """The closing record (the totals so far: ``fit`` ending writes one too, the last counts)."""
        seen, first, last = self._seen
        if not self._writer.closed:
            self._writer.end(seen, first_step=first if seen else None, last_step=last if seen else None)

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reading a step ---

    def _record_tensors(self, non_trainable_variables: Any, optimizer_variables: Any) -> tuple[Any, Any, list]:
        if self._positions is None:  # found once per attach: walking the model every step costs
            opt_index = {id(v): i for i, v in enumerate(self.optimizer.variables)}
            model_index = {id(v): i for i, v in enumerate(self.model.non_trainable_variables)}
            self._positions = ([opt_index[id(v)] for v in self.optimizer.monitor_variables],
                               [model_index[id(self._slots[n].state)] for n in _SLOT_NAMES])
        opt_at, slot_at = self._positions
        if optimizer_variables is not None:
            head, stats = (optimizer_variables[i] for i in opt_at)
        else:
            head, stats = (v.value for v in self.optimizer.monitor_variables)
        if non_trainable_variables is not None:
            slots = [non_trainable_variables[i] for i in slot_at]
        else:
            slots = [self._slots[n].state.value for n in _SLOT_NAMES]
        return head, stats, slots

    def _fp8_variables(self, trainable_variables: Any = None, newest: bool = True) -> tuple[list[Any], list[Any]]:
        """The float8 layers' histories' first entries (``newest``; else none: no slice op) and their
        divisors (values of the model's variables, or of ``trainable_variables``, a functional JAX
        step's list), in layer order."""
        histories = [v for _, layer in self._fp8_layers for v in history_variables(layer)]
        scales = [v for _, layer in self._fp8_layers for v in scale_variables(layer)]
        if trainable_variables is None:
            return [v.value[:1] for v in histories] if newest else [], [v.value for v in scales]
        if self._fp8_at is None:
            index = {id(v): i for i, v in enumerate(self.model.trainable_variables)}
            self._fp8_at = [index[id(v)] for v in histories + scales]
        at = self._fp8_at
        return ([trainable_variables[i][:1] for i in at[:len(histories)]] if newest else [],
                [trainable_variables[i] for i in at[len(histories):]])

    def fp8_snapshot(self, step: int, trainable_variables: Any = None) -> None:
        """Remember the divisors step ``step`` will quantize with (Keras uses the ones stored before
        it): ``fit`` calls this before each sampled step, where the last read did not already."""
        if not self._fp8_layers or (self._fp8_used is not None and self._fp8_used[0] == step):
            return
        self._fp8_used = (step, fetch(self._fp8_variables(trainable_variables, newest=False)[1]))

    def _fp8_parts(self, expected: int | None, want_stats: bool, trainable_variables: Any) -> list[Any]:
        """What a record's one transfer carries for float8: on a sampled step the amaxes and the
        divisors, on the step before one the divisors it will use (only those: no slice op), else nothing."""
        before_sample = expected is not None and (expected + 1) % self.every == 0
        if not self._fp8_layers or not (want_stats or before_sample):
            return []
        newest, scales = self._fp8_variables(trainable_variables, newest=want_stats)
        return newest + scales

    @staticmethod
    def _fp8_split(values: Any, n: int, want_stats: bool) -> tuple[Any, Any]:
        """(the record's own values, the float8 ones as amaxes (NaN where not read) then divisors, or None)."""
        if not n:
            return values, None
        fp8_v = values[-n:]  # one value per part: scalars and one-element slices
        return values[:-n], fp8_v if want_stats else np.concatenate([np.full(n, np.nan), fp8_v])

    def _fp8_record(self, step: int, fp8_v: Any) -> dict[str, Any] | None:
        """The step's float8 statistics (None without the divisors it used); keeps the divisors read
        after the step as the next step's."""
        newest, scales = fp8_v[:len(fp8_v) // 2], fp8_v[len(fp8_v) // 2:]
        used = self._fp8_used[1] if self._fp8_used is not None and self._fp8_used[0] == step else None
        self._fp8_used = (step + 1, scales)
        if used is None:
            return None
        return {path: tensor_stats(newest[3 * i:3 * i + 3], used[3 * i:3 * i + 3], layer.compute_dtype)
                for i, (path, layer) in enumerate(self._fp8_layers)}

    def _forward_origin(self, event: int) -> dict[str, str]:
        """Where the first non-finite forward value came from: the model's inputs, a layer's output
        (its inputs were finite: they were checked when its call began), or a layer's inputs. Keras
        casts a layer's inputs before its ``call`` runs, so inputs seen non-finite there were made
        by the code that called it (a subclassed container's own code, or its cast of what it
        passes) or, where a graph (Functional, Sequential) called it, whose values are other
        layers' checked outputs, by the layer's own input cast (a pinned layer's float32 output
        beyond float16's range): the layer is named."""
        index, output = event // 2 - 1, event % 2 == 1
        if index < 0:
            return {"path": "", "where": "input"}
        path = self.layers[index]
        if output:
            return {"path": path, "where": "output"}
        caller = code_caller(path, self._by_path)
        return {"path": caller if caller is not None else path, "where": "output"}

    def record(self, loss: Any = None, *, non_trainable_variables: Any = None,
               optimizer_variables: Any = None, trainable_variables: Any = None) -> dict[str, Any] | None:
        """Read the last optimizer step's record (one transfer) and log it if it is sampled or
        non-finite; returns what was logged (a dict as in the log), or None.

        ``loss``: the step's unscaled loss, where it did not go through ``model.compute_loss``
        (a custom loop). ``non_trainable_variables`` / ``optimizer_variables``: the value lists
        a functional JAX step returned (``stateless_call`` / ``stateless_apply``), when they are
        not assigned back to the variables before this call (``trainable_variables``: its trainable
        values, where the model has float8 layers, whose scales and histories Keras keeps there).

        A float8 layer's record (``fp8``, see ``ampbridge.diagnostics.runlog``) is written on the
        sampled steps whose divisors the monitor read before the step: with the previous step's
        read (the same transfer) where this one follows it, or by :meth:`fp8_snapshot`.
        """
        if not self._attached:
            raise ValueError("Monitor.record: the monitor is detached; call attach() first")
        if not self.optimizer.monitor_variables:
            raise ValueError("Monitor.record: no optimizer step has run yet (the optimizer is not built)")
        head, stats, slots = self._record_tensors(non_trainable_variables, optimizer_variables)
        # the step is the one after the last recorded (checked below): the statistics travel only
        # on sampled steps, with the rest, as one array
        expected = self._next_step
        want_stats = expected is None or expected % self.every == 0
        parts = [head] + slots + ([loss] if loss is not None else []) + ([stats] if want_stats else [])
        fp8_parts = self._fp8_parts(expected, want_stats, trainable_variables)
        values, fp8_v = self._fp8_split(fetch(parts + fp8_parts), len(fp8_parts), want_stats)
        head_v, rest = values[:LAYOUT.head], values[LAYOUT.head:]
        forward, backward, slot_loss, loss_seen = rest[:4]
        step = LAYOUT.join(head_v[0], head_v[1])
        scale, found_inf, skipped = float(head_v[2]), bool(head_v[3]), bool(head_v[4])
        param_first, sampled = int(head_v[5]), bool(head_v[6])
        if expected is not None and step == expected - 1:
            return None  # no optimizer step since the last record: already logged (or not to be)
        self._count(step)
        if sampled and not want_stats:  # record() was not called after every step: read them now
            stats_v = fetch([stats])
        else:
            stats_v = rest[5 if loss is not None else 4:]
        if loss is not None:
            step_loss: float | None = float(rest[4])
        else:
            step_loss = float(slot_loss) if loss_seen else None
        fp8_stats = self._fp8_record(step, fp8_v) if fp8_v is not None else None
        if not (sampled or found_inf):
            return None
        fp8_stats = fp8_stats if sampled else None
        stats_by_layer = self._layer_stats(stats_v, scale) if sampled else {}
        first = None
        if found_inf and self.attribution:
            first = self._first_nonfinite(int(forward), int(backward), param_first,
                                          step_loss is not None and not np.isfinite(step_loss))
        logged_loss = step_loss if step_loss is not None and np.isfinite(step_loss) else None
        self._writer.step(step, loss=logged_loss, loss_scale=scale, found_inf=found_inf, skipped=skipped,
                          layers=stats_by_layer, first_nonfinite=first, fp8=fp8_stats)
        out = {"step": step, "loss": logged_loss, "loss_scale": scale, "found_inf": found_inf,
               "skipped": skipped, "first_nonfinite": first, "layers": stats_by_layer}
        if fp8_stats:
            out["fp8"] = {p: {t: v.to_record() for t, v in tensors.items()} for p, tensors in fp8_stats.items()}
        return out

    def _layer_stats(self, stats_v: Any, scale: float) -> dict[str, dict[str, float]]:
        """The per-layer statistics of a sampled step, from its rows as read (counts split in two)."""
        stats_by_layer = {}
        rows = stats_v.reshape(-1, LAYOUT.row)
        for (path, _, _), row in zip(self.optimizer.monitor_spec.stats, rows):
            counts = [LAYOUT.join(row[i], row[i + 1]) for i in range(2, LAYOUT.row, 2)]
            zero, nonfinite, under, over, size = counts
            if size == 0:
                continue  # no gradients reached this layer's variables
            finite = size - nonfinite
            stats_by_layer[path] = {
                "grad_max_abs": float(row[0]) / scale if finite else float("nan"),
                "grad_rms": float(row[1]) / scale if finite else float("nan"),
                "zero": zero / size, "nonfinite": nonfinite / size,
                "underflow": under / size, "overflow": over / size}
        return stats_by_layer

    def _first_nonfinite(self, forward: int, backward: int, param_first: int, loss_bad: bool) -> dict[str, str]:
        """Where a non-finite step went non-finite first: a forward value, the loss, a gradient."""
        if forward >= 0:
            return self._forward_origin(forward)
        if loss_bad:
            return {"path": "", "where": "loss"}
        if backward >= 0:
            return {"path": self.layers[backward], "where": "gradient"}
        if param_first >= 0:
            return {"path": self.layers[param_first], "where": "gradient"}
        return {"path": "", "where": "unreproduced"}  # the replay found nothing non-finite


class MonitorCallback(keras.callbacks.Callback):
    """Writes the numerics log (see :class:`Monitor`) during ``fit``.

    ``every``: per-layer statistics on every N-th optimizer step (step 0 included); steps whose
    gradients were non-finite are always logged. One callback writes one log: the model stays
    monitored after ``fit`` returns, so fitting again with the same callback appends to the log
    (step numbers continue) without re-tracing the train step; each ``fit`` ends with the log's
    closing record (the steps and skips so far: ``ampbridge report`` reads the last one);
    :meth:`close` detaches the monitor (the next ``fit`` re-traces without it) and closes the log.

    Example:
        >>> import os, tempfile, keras, numpy as np, ampbridge
        >>> policy = ampbridge.preset("mixed_float16").replace(loss_scale=ampbridge.LossScaleConfig(initial_scale=1024))
        >>> model = ampbridge.keras.apply(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), policy)
        >>> model.compile(ampbridge.keras.optimizer(keras.optimizers.SGD(), policy), "mse")
        >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> x, y = np.ones((8, 3)), np.zeros((8, 2))
        >>> sample_weight = np.array([1, 1, np.inf, 1, 1, 1, 1, 1])  # step 1 goes non-finite
        >>> _ = model.fit(x, y, sample_weight=sample_weight, batch_size=2, shuffle=False, verbose=0,
        ...               callbacks=[MonitorCallback(path, every=2)])
        >>> from ampbridge.diagnostics.runlog import read_log
        >>> [(s["step"], s["skipped"]) for s in read_log(path).steps]
        [(0, False), (1, True), (2, False)]
    """

    def __init__(self, path: Any, every: int = 1, *, attribution: bool = True):
        super().__init__()
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"MonitorCallback: every must be a positive integer (log every N-th step); "
                             f"received every={every!r}")
        self.path, self.every, self.attribution = path, every, attribution
        self.monitor: Monitor | None = None
        self._dispatch: FitDispatch | None = None

    @property
    def async_safe(self) -> bool:
        """Whether Keras may run the callbacks' batch hooks on a thread of its own (and queue steps
        ahead instead of waiting for each step's logs): on JAX, where the dispatch reads nothing
        between samples. On TensorFlow and torch the dispatch reads each step anyway, and their
        monitored ``fit`` measured 1-3% faster with the hooks on the calling thread."""
        return active_backend() == "jax"

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        pass  # the dispatch reads the steps; a batch hook, so that async_safe decides the thread

    def on_train_begin(self, logs: Any = None) -> None:
        if self.monitor is None:
            self.monitor = Monitor(self.path, self.model, every=self.every, attribution=self.attribution)
        else:
            self.monitor.attach()
        model = callback_model(self)
        if self._dispatch is not None and model.train_function is self._dispatch:
            self._dispatch.flush()  # a fit that raised left steps unread
            self._dispatch.sync()
        else:
            self._dispatch = FitDispatch(self.monitor)

    def _flush(self) -> None:
        if self._dispatch is not None:
            self._dispatch.flush()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._flush()

    def on_train_end(self, logs: Any = None) -> None:
        self._flush()
        if self.monitor is not None:
            self.monitor._end()  # the totals so far, for a log read before close()

    def close(self) -> None:
        """Detach the monitor from the model and close the log."""
        self._flush()
        if self.monitor is not None:
            self.monitor.close()

"""Train the demo model under a policy in one framework; the demo, the conformance suite and the
benchmarks all use these runners, so what the demo prints is what the tests check.

Each runner trains ``steps`` SGD steps on the shared batches, from the shared initial weights,
multiplying the loss by ``inf`` at the steps in ``inject`` (so their gradients are non-finite
whatever the dtype), and returns a :class:`Run`: the plan, per-step losses (NaN at injected
steps), the loss scale each step used, which steps were skipped, the final loss-scale state.
``native=True`` runs the framework's own AMP instead (no ampbridge; used for timing ratios):
torch ``autocast`` + ``GradScaler``, Keras's global mixed policy + ``LossScaleOptimizer``, jmp's
policy + ``DynamicLossScale`` in JAX, each with the policy's compute dtype and no pins.

tf.keras 2 (``tf_keras``) is an optional fourth column (:data:`OPTIONAL`): it runs in the same process
as Keras 3 (the ``tf_keras`` package needs no ``TF_USE_LEGACY_KERAS``; that only decides what
``tf.keras`` names, and the runner never uses ``tf.keras``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ...core.loss_scale import LossScaleState
from ...core.plan import Plan
from ...core.policy import Policy
from .model import CONFIG, batches

FRAMEWORKS = ("torch", "keras", "jax")
OPTIONAL = ("tf_keras",)  # trained where installed; the conformance suite adds its column then
Progress = Callable[[int], None]


@dataclass
class Run:
    framework: str
    plan: Plan | None
    losses: list[float] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)  # the scale each step used (before its update)
    skipped: list[bool] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    final_state: LossScaleState | None = None
    phases: list[int | None] = field(default_factory=list)  # the phase in force at each step
    promoted: frozenset[str] = frozenset()  # torch rows whose own code carries a promoted stream on
    fp8_divisors: list[float] = field(default_factory=list)  # FP8_ROW's input divisor after each step

    @property
    def final_loss(self) -> float:
        return next((x for x in reversed(self.losses) if math.isfinite(x)), float("nan"))


#: the float8 tensor the demo follows: the first linear layer's input (after a float32 norm)
FP8_ROW = "block.attn.query"


def _tick(progress: Progress | None, i: int) -> None:
    if progress is not None:
        progress(i)


# --- torch -----------------------------------------------------------------------------------------

def run_torch(policy: Policy, steps: int, inject: Iterable[int] = (), *, seed: int = 0, native: bool = False,
              progress: Progress | None = None) -> Run:
    import torch

    import ampbridge.torch as abt

    from . import torch_model as tm

    inject = set(inject)
    model = tm.build(seed)
    opt = torch.optim.SGD(model.parameters(), lr=CONFIG.lr)
    run = Run("torch", None)
    if native:
        cfg = policy.resolved_loss_scale
        dtype = getattr(torch, policy.compute_dtype)
        scaler = torch.amp.GradScaler("cpu", init_scale=cfg.initial_scale, growth_factor=cfg.growth_factor,
                                      backoff_factor=cfg.backoff_factor, growth_interval=cfg.growth_interval,
                                      enabled=cfg.mode == "dynamic")
    else:
        amp = abt.apply(model, policy)
        run.plan = amp.plan
    for i, (x, y) in enumerate(batches(steps)):
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        t0 = time.perf_counter()
        if native:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                logits = model(xt)
            loss = tm.loss_fn(logits, yt)
            used = scaler.get_scale() if scaler.is_enabled() else 1.0
            scaler.scale(loss * math.inf if i in inject else loss).backward()
            before = scaler.get_scale() if scaler.is_enabled() else 1.0
            scaler.step(opt)
            scaler.update()
            applied = not scaler.is_enabled() or scaler.get_scale() >= before
        else:
            run.phases.append(amp.phase if policy.phases else None)
            used = amp.scaler.loss_scale_state().scale
            logits = amp.model(xt)
            loss = tm.loss_fn(logits, yt)
            applied = bool(amp.step(loss * math.inf if i in inject else loss, opt))
        opt.zero_grad(set_to_none=True)
        run.step_seconds.append(time.perf_counter() - t0)
        run.losses.append(math.nan if i in inject else float(loss))
        run.scales.append(float(used))
        run.skipped.append(not applied)
        followed = None if native else dict(amp.model.named_modules()).get(FP8_ROW)
        if hasattr(followed, "input_divisor"):  # ampbridge's delayed-scaling float8 Linear
            run.fp8_divisors.append(float(followed.input_divisor))
        _tick(progress, i)
    if not native:
        run.final_state = amp.scaler.loss_scale_state()
        run.plan = amp.plan if not policy.phases else run.plan
        run.promoted = amp.realisation.promoted if not policy.phases else frozenset()
    return run


# --- Keras ------------------------------------------------------------------------------------------

def run_keras(policy: Policy, steps: int, inject: Iterable[int] = (), *, seed: int = 0, native: bool = False,
              progress: Progress | None = None, jit_compile: bool | str = "auto") -> Run:
    import keras
    import numpy as np

    inject = set(inject)
    run = Run("keras", None)
    data = batches(steps)
    model, opt = _keras_model(policy, run, seed=seed, native=native)
    model.compile(optimizer=opt, loss=_keras_loss(), jit_compile=jit_compile)
    fp8_layer = _keras_fp8_layer(model) if policy.uses_fp8 and not native else None
    if policy.phases and not native:
        return _keras_fit_schedule(policy, run, model, opt, data, inject, progress)
    for i, (x, y) in enumerate(data):
        w = np.full(x.shape, np.inf if i in inject else 1.0, np.float32)  # per token, like the loss
        used = _keras_scale(opt, native)
        skipped_before = None if native else opt.state.skipped
        t0 = time.perf_counter()
        logs = model.train_on_batch(x, y, sample_weight=w, return_dict=True)
        run.step_seconds.append(time.perf_counter() - t0)
        run.losses.append(math.nan if i in inject else float(logs["loss"]))
        run.scales.append(used)
        if fp8_layer is not None:
            run.fp8_divisors.append(float(keras.ops.convert_to_numpy(fp8_layer.inputs_scale)))
        if native:
            run.skipped.append(_keras_scale(opt, native) < used)
        else:
            run.skipped.append(opt.state.skipped > skipped_before)
        _tick(progress, i)
    if not native:
        run.final_state = opt.state
    return run


def _keras_fp8_layer(model: Any) -> Any:
    """The layer at FP8_ROW when Keras quantized it to float8, else None."""
    import ampbridge.keras as ak

    layer = dict(ak.walk(model)).get(FP8_ROW)
    return layer if hasattr(layer, "inputs_scale") else None


def _keras_loss() -> Any:
    from . import keras_model as km

    return km.loss_fn


def _keras_model(policy: Policy, run: Run, *, seed: int, native: bool) -> tuple[Any, Any]:
    """The demo model and its optimizer: Keras's own mixed precision (``native``) or ampbridge's."""
    import keras

    import ampbridge.keras as ak

    from . import keras_model as km

    if not native:
        model = ak.apply(km.build(seed), policy.at(step=0, epoch=0))
        opt = ak.optimizer(keras.optimizers.SGD(CONFIG.lr), policy)
        run.plan = ak.plan(model, policy.at(step=0, epoch=0), warn=False)
        return model, opt
    previous = keras.config.dtype_policy()
    name = {"float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}.get(policy.compute_dtype, "float32")
    keras.config.set_dtype_policy(name)
    try:
        model = km.build(seed)
    finally:
        keras.config.set_dtype_policy(previous)
    cfg = policy.resolved_loss_scale
    opt: Any = keras.optimizers.SGD(CONFIG.lr)
    if cfg.mode == "dynamic":
        opt = keras.optimizers.LossScaleOptimizer(opt, initial_scale=cfg.initial_scale,
                                                  dynamic_growth_steps=cfg.growth_interval)
    return model, opt


def _keras_scale(opt: Any, native: bool) -> float:
    import keras

    if native:
        return float(keras.ops.convert_to_numpy(opt.dynamic_scale)) if hasattr(opt, "dynamic_scale") and opt.built else (
            float(getattr(opt, "initial_scale", 1.0)))
    return opt.state.scale


def _keras_fit_schedule(policy: Policy, run: Run, model: Any, opt: Any, data: list, inject: set[int],
                        progress: Progress | None) -> Run:
    """A schedule runs through fit, whose PhaseCallback switches phases at step boundaries."""
    import keras
    import numpy as np

    import ampbridge.keras as ak

    x = np.concatenate([b[0] for b in data])
    y = np.concatenate([b[1] for b in data])
    w = np.ones(x.shape, np.float32)  # per token, like the loss
    for i in inject:
        w[i * CONFIG.batch:(i + 1) * CONFIG.batch] = np.inf
    phase_cb = ak.PhaseCallback(policy)

    class Record(keras.callbacks.Callback):
        # the optimizer is read through self.model: on JAX, fit keeps the state off the variables
        # mid-epoch, and Keras syncs it back only when a callback asks for its model
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            run.phases.append(phase_cb.phase)
            run.scales.append(_keras_scale(self.model.optimizer, False))
            self.skipped_before = self.model.optimizer.state.skipped
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            run.step_seconds.append(time.perf_counter() - self.t0)
            run.skipped.append(self.model.optimizer.state.skipped > self.skipped_before)
            run.losses.append(math.nan)  # fit reports running means, not per-step losses
            _tick(progress, batch)

    model.fit(x, y, sample_weight=w, batch_size=CONFIG.batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[phase_cb, Record()])
    run.final_state = opt.state
    return run


# --- JAX ----------------------------------------------------------------------------------------------

def _jax_train_step(amp: Any, tx: Any, params: Any, opt_state: Any, x: Any, y: Any, mult: Any) -> Any:
    import jax
    import optax

    import ampbridge.jax as abj

    from . import flax_model as fm

    def loss_fn(p: Any) -> Any:
        loss = fm.loss_fn(amp.apply({"params": p}, x), y)
        return abj.scale_loss(loss * mult, opt_state), loss

    grads, loss = jax.grad(loss_fn, has_aux=True)(params)
    updates, new_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_state, loss


def _jax_stepper(policy: Policy, module: Any, params: Any, x0: Any) -> tuple[Any, Callable[..., Any]]:
    """The first optimizer state, and ``step_at(i, params, opt_state) -> (params, opt_state, step)``:
    one jitted step per phase (the Schedule moves the state at the boundaries), else one."""
    import jax
    import optax

    import ampbridge.jax as abj

    if policy.phases:
        schedule = abj.Schedule(module, policy, optax.sgd(CONFIG.lr), _jax_train_step)
        opt_state = schedule.init(jax.random.key(0), x0)[1]

        def step_at(i: int, params: Any, opt_state: Any) -> tuple[Any, Any, Callable[..., Any]]:
            # the demo's steps are one epoch (Keras fits epochs=1): an epoch schedule stays in its first phase
            params, opt_state = schedule.enter(params, opt_state, step=i, epoch=0)
            return params, opt_state, schedule.step_fn(step=i, epoch=0)
        return opt_state, step_at
    amp = abj.apply(module, policy)
    tx = abj.optimizer(optax.sgd(CONFIG.lr), policy)
    jitted = jax.jit(lambda p, s, x, y, m: _jax_train_step(amp, tx, p, s, x, y, m))

    def step_fixed(i: int, params: Any, opt_state: Any) -> tuple[Any, Any, Callable[..., Any]]:
        return params, opt_state, jitted
    return tx.init(params), step_fixed


def _jax_fp8_stepper(policy: Policy, module: Any, params: Any, x0: Any, run: Run) -> tuple[Any, Callable[..., Any]]:
    """As :func:`_jax_stepper` for an [fp8] policy: Flax's float8 scales and amax histories live in the
    ``_overwrite_with_gradient`` collection, which each step replaces by its "gradient" (what Flax's
    ``TrainState.apply_gradients`` does); the optimizer updates the parameters only."""
    import jax
    import optax
    from flax.linen import fp8_ops

    import ampbridge.jax as abj

    from ...errors import UnsupportedOptionError
    from . import flax_model as fm

    if policy.phases:
        raise UnsupportedOptionError("the demo's Flax runner trains an [fp8] policy without phases (a phase that "
                                     "turns FP8 on adds Flax variables mid-run); train it with ampbridge.jax.Schedule")
    collection = fp8_ops.OVERWRITE_WITH_GRADIENT
    amp = abj.apply(module, policy)
    tx = abj.optimizer(optax.sgd(CONFIG.lr), policy)
    meta = [amp.init(jax.random.key(0), x0)[collection]]

    def train_step(params: Any, meta: Any, opt_state: Any, x: Any, y: Any, mult: Any) -> Any:
        def loss_fn(p: Any, m: Any) -> Any:
            loss = fm.loss_fn(amp.apply({"params": p, collection: m}, x), y)
            return abj.scale_loss(loss * mult, opt_state), loss

        (grads, new_meta), loss = jax.grad(loss_fn, argnums=(0, 1), has_aux=True)(params, meta)
        updates, new_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_meta, new_state, loss

    jitted = jax.jit(train_step)

    def step(params: Any, opt_state: Any, x: Any, y: Any, mult: Any) -> tuple[Any, Any, Any]:
        params, meta[0], opt_state, loss = jitted(params, meta[0], opt_state, x, y, mult)
        node = meta[0]
        for name in FP8_ROW.split("."):
            node = node[name]
        op = next(v for v in node.values() if "input_scale" in v)  # the fp8 op under the layer
        run.fp8_divisors.append(float(op["input_scale"].reshape(())))
        return params, opt_state, loss

    return tx.init(params), (lambda i, params, opt_state: (params, opt_state, step))


def run_jax(policy: Policy, steps: int, inject: Iterable[int] = (), *, seed: int = 0, native: bool = False,
            progress: Progress | None = None) -> Run:
    import jax.numpy as jnp

    import ampbridge.jax as abj

    from . import flax_model as fm

    inject = set(inject)
    module, variables = fm.build(seed)
    run = Run("jax", None)
    data = batches(steps)
    x0 = jnp.asarray(data[0][0])
    if native:
        return _run_jmp(policy, module, variables, data, inject, run, progress)

    first = policy.at(step=0, epoch=0)
    params = abj.apply(module, first).cast_params(variables, x0)["params"]
    run.plan = abj.plan(module, first, x0, warn=False)
    if policy.uses_fp8:
        opt_state, step_at = _jax_fp8_stepper(policy, module, params, x0, run)
    else:
        opt_state, step_at = _jax_stepper(policy, module, params, x0)
    for i, (x, y) in enumerate(data):
        if policy.phases:
            run.phases.append(policy.phase_index(step=i, epoch=0))  # one epoch, as in _jax_stepper
        params, opt_state, step = step_at(i, params, opt_state)
        before = abj.loss_scale(opt_state)
        used, skipped_before = float(before.scale), int(before.skipped)
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, jnp.asarray(x), jnp.asarray(y),
                                       jnp.float32(math.inf if i in inject else 1.0))
        loss = float(loss)
        run.step_seconds.append(time.perf_counter() - t0)
        run.losses.append(math.nan if i in inject else loss)
        run.scales.append(used)
        run.skipped.append(int(abj.loss_scale(opt_state).skipped) > skipped_before)
        _tick(progress, i)
    s = abj.loss_scale(opt_state)
    run.final_state = LossScaleState(float(s.scale), int(s.good_steps), int(s.hysteresis_left), int(s.steps),
                                     int(s.skipped), int(s.nonfinite_streak))
    return run


def _run_jmp(policy: Policy, module: Any, variables: Any, data: list, inject: set, run: Run,
             progress: Progress | None) -> Run:
    import jax
    import jax.numpy as jnp
    import jmp
    import optax

    from . import flax_model as fm

    compute = policy.compute_dtype
    jpol = jmp.get_policy(f"params=float32,compute={compute},output=float32")
    cfg = policy.resolved_loss_scale
    scale = (jmp.DynamicLossScale(jnp.float32(cfg.initial_scale), period=cfg.growth_interval,
                                  factor=int(cfg.growth_factor)) if cfg.mode == "dynamic" else jmp.NoOpLossScale())
    tx = optax.sgd(CONFIG.lr)
    params = variables["params"]
    opt_state = tx.init(params)

    @jax.jit
    def step(params: Any, opt_state: Any, scale: Any, x: Any, y: Any, mult: Any) -> Any:
        def loss_fn(p: Any) -> Any:
            logits = module.apply({"params": jpol.cast_to_compute(p)}, jpol.cast_to_compute(x))
            loss = fm.loss_fn(jpol.cast_to_output(logits), y)
            return scale.scale(loss * mult), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        grads = scale.unscale(jpol.cast_to_param(grads))
        finite = jmp.all_finite(grads)
        new_scale = scale.adjust(finite)
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = jmp.select_tree(finite, optax.apply_updates(params, updates), params)
        new_opt = jmp.select_tree(finite, new_opt, opt_state)
        return new_params, new_opt, new_scale, loss, finite

    for i, (x, y) in enumerate(data):
        used = float(getattr(scale, "loss_scale", 1.0))
        t0 = time.perf_counter()
        params, opt_state, scale, loss, finite = step(params, opt_state, scale, jnp.asarray(x), jnp.asarray(y),
                                                      jnp.float32(math.inf if i in inject else 1.0))
        loss = float(loss)
        run.step_seconds.append(time.perf_counter() - t0)
        run.losses.append(math.nan if i in inject else loss)
        run.scales.append(used)
        run.skipped.append(not bool(finite))
        _tick(progress, i)
    return run


# --- tf.keras 2 ---------------------------------------------------------------------------------------

def run_tf_keras(policy: Policy, steps: int, inject: Iterable[int] = (), *, seed: int = 0,
                 progress: Progress | None = None, jit_compile: bool | None = None) -> Run:
    """The Keras 3 run in tf.keras 2: the policy applied before the model is built (Keras 2 fixes a
    layer's dtype when its variables are made); a ``[[phase]]`` schedule runs through ``fit`` with
    ``PhaseCallback``, as in Keras 3."""
    import numpy as np
    import tensorflow as tf
    import tf_keras

    import ampbridge.tf_keras as atk

    from . import tf_keras_model as km

    inject = set(inject)
    run = Run("tf_keras", None)
    active = policy.at(step=0, epoch=0)
    model = km.build(seed, policy=policy)  # a schedule: layers made for every phase, the first one running
    opt = atk.optimizer(tf_keras.optimizers.SGD(CONFIG.lr), policy)
    run.plan = atk.plan(model, active, warn=False)

    def loss_fn(targets, logits):
        return tf_keras.losses.sparse_categorical_crossentropy(targets, tf.cast(logits, "float32"), from_logits=True)

    model.compile(optimizer=opt, loss=loss_fn, jit_compile=jit_compile)
    head = model.get_layer("head").kernel
    if policy.phases:
        _fit_phases(atk.PhaseCallback(policy), model, opt, run, batches(steps), inject, progress)
    for i, (x, y) in enumerate(batches(steps) if not policy.phases else ()):
        w = np.full(x.shape, np.inf if i in inject else 1.0, np.float32)  # per token, like the loss
        used, before = float(opt.loss_scale.numpy()), head.numpy()
        t0 = time.perf_counter()
        logs = model.train_on_batch(x, y, sample_weight=w, return_dict=True)
        run.step_seconds.append(time.perf_counter() - t0)
        run.losses.append(math.nan if i in inject else float(logs["loss"]))
        run.scales.append(used)
        run.skipped.append(bool(np.array_equal(before, head.numpy())))
        _tick(progress, i)
    state = atk.state_of(opt)  # Keras 2's own state holds scale and good steps only: the rest is counted here
    run.final_state = LossScaleState(state["scale"], int(state["good_steps"]), int(state.get("hysteresis_left", 1)),
                                     int(state.get("steps", steps)), int(state.get("skipped", sum(run.skipped))))
    return run


def _fit_phases(phase_cb: Any, model: Any, opt: Any, run: Run, data: list, inject: set, progress: Progress | None) -> None:
    """A schedule through ``fit``: the per-step records from a callback (fit reports running means, not
    per-step losses)."""
    import numpy as np
    import tf_keras

    x = np.concatenate([b[0] for b in data])
    y = np.concatenate([b[1] for b in data])
    w = np.ones(x.shape, np.float32)  # per token, like the loss
    for i in inject:
        w[i * CONFIG.batch:(i + 1) * CONFIG.batch] = np.inf

    class Record(tf_keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            run.phases.append(phase_cb.phase)
            run.scales.append(float(opt.loss_scale.numpy()))
            self.skipped_before = int(opt._loss_scale.skipped.numpy())
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            run.step_seconds.append(time.perf_counter() - self.t0)
            run.skipped.append(int(opt._loss_scale.skipped.numpy()) > self.skipped_before)
            run.losses.append(math.nan)
            _tick(progress, batch)

    model.fit(x, y, sample_weight=w, batch_size=CONFIG.batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[phase_cb, Record()])


RUNNERS = {"torch": run_torch, "keras": run_keras, "jax": run_jax, "tf_keras": run_tf_keras}

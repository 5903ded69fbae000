"""What every backend shares, framework-free: the policy a backend runs (a Policy, a preset name
or a file; the bisect switch; ``compute_dtype = "auto"``) and the clear error for a missing extra.

Example:
    >>> import ampbridge
    >>> policy, notes = resolve_policy("mixed_bfloat16", "jax", device=lambda: None)
    >>> policy.compute_dtype, notes
    ('bfloat16', ())
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any, NamedTuple, Protocol

from ..core.io import as_policy
from ..core.kinds import KindRegistry, infer_kind
from ..core.policy import Policy
from ..core.risks import lossy_settings
from ..diagnostics.environment import effective_policy
from ..diagnostics.hardware import Device, resolve_auto
from ..errors import BackendUnavailableError, LossyPolicyWarning, warn_once

class StepRecord(NamedTuple):
    """One optimizer step as the loss scaler saw it, told to a :class:`StepObserver` before the
    scale moves (so the log holds the scale the step used).

    Fields: ``step`` (the scaler's step count), ``found`` (the overflow flag on the device, > 0 when
    non-finite; None where nothing was checked), ``known`` (the flag as the host already read it,
    None when it did not), ``scale`` (the scale the step used; None at scale 1 without checking),
    ``skip`` (whether a non-finite step is skipped).
    """

    step: int
    found: Any
    known: bool | None
    scale: Any
    skip: bool


class StepObserver(Protocol):
    """What a loss scaler tells the monitor watching it, in this order within one step: the loss it
    scaled, the gradients before the first unscale, a fused optimizer whose gradients stay scaled,
    then the step. A scaler holds at most one observer (``scaler.observer``)."""

    def on_loss(self, outputs: Any) -> None: ...

    def on_grads(self, scale: Any, step: int) -> None: ...

    def on_kept_scaled(self, optimizer: Any) -> None: ...

    def on_step(self, record: StepRecord) -> None: ...


#: the extra that installs each backend's framework
EXTRAS = {"torch": "torch", "keras": "keras", "jax": "jax", "flax": "jax", "optax": "jax", "tensorflow": "tensorflow",
          "tf_keras": "tf-keras"}


def environment(policy: Policy | str | os.PathLike[str], framework: str, *,
                warn: bool = True) -> tuple[Policy, tuple[str, ...]]:
    """The policy after the bisect switch (``AMPBRIDGE_DISABLE`` / ``AMPBRIDGE_POLICY``), and the
    Plan note saying it replaced the one given (warned once per process, at the user's line)."""
    given = as_policy(policy)
    effective = effective_policy(given, framework, warn=warn)
    if warn:
        warn_lossy(effective)
    if effective is given:
        return given, ()
    return effective, (f"the environment replaced the policy given ({given.source or 'in code'}) with "
                       f"{effective.source or 'another'} (AMPBRIDGE_DISABLE / AMPBRIDGE_POLICY)",)


def warn_lossy(policy: Policy) -> None:
    """Warn once per process for each lossy combination of ``policy`` (``ampbridge.core.risks``)."""
    for risk in lossy_settings(policy):
        warn_once(f"{policy.source or 'policy'}: {risk}", LossyPolicyWarning)


def resolve_policy(policy: Policy | str | os.PathLike[str], framework: str, device: Callable[[], Device | Any],
                   *, warn: bool = True) -> tuple[Policy, tuple[str, ...]]:
    """The policy a backend applies and the notes saying why it differs from the one given: the
    bisect switch, then ``compute_dtype = "auto"`` decided for ``device()`` (asked only then)."""
    policy, notes = environment(policy, framework, warn=warn)
    uses_auto = policy.compute_dtype == "auto" or any(p.policy.compute_dtype == "auto" for p in policy.phases)
    if not uses_auto:
        return policy, notes
    policy, why = resolve_auto(policy, device(), warn=warn)
    return policy, notes + ((why,) if why else ())


_C_TYPES = {"float32": ctypes.c_float, "int32": ctypes.c_int32}


def read_host_scalar(address: int, dtype: str) -> float | int:
    """The scalar of ``dtype`` ("float32", "int32") at ``address`` in host memory (a CPU tensor's
    ``data_ptr()``), read without the framework: torch's ``.item()`` and ``.numpy()`` dispatch an
    aten op each time (``_local_scalar_dense``, ``detach``), which the monitors keep off the
    per-step path of a step that logs nothing.

    Example:
        >>> seven = ctypes.c_int32(7)
        >>> read_host_scalar(ctypes.addressof(seven), "int32")
        7
    """
    return _C_TYPES[dtype].from_address(address).value


def room_above(package: str, name: str) -> ModuleType:
    """A room of ``package`` that sits above the caller (already imported by the package's
    ``__init__``). Rooms import downwards only; a verb that hands over to a room above it (``plan``
    with example inputs to ``trace``) looks that room up here instead of importing it.

    Example:
        >>> room_above("ampbridge.backends", "common").__name__
        'ampbridge.backends.common'
    """
    return sys.modules[f"{package}.{name}"]


def import_framework(module: str, backend: str) -> ModuleType:
    """Import a backend's framework, or raise the ``BackendUnavailableError`` naming its extra."""
    try:
        imported = importlib.import_module(module)
    except ImportError as e:
        extra = EXTRAS.get(module.split(".")[0], backend)
        raise BackendUnavailableError(
            f"ampbridge.{backend} needs {module.split('.')[0]!r}, which is not installed ({e}). "
            f"Install with: pip install 'ampbridge[{extra}]'") from None  # the chained import trace says no more
    checked_release(module.split(".")[0])
    if module == "keras":  # and the framework Keras computes with
        checked_release({"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}.get(
            imported.backend.backend(), "keras"))
    return imported


@functools.lru_cache(maxsize=None)
def checked_release(name: str) -> None:
    """Once per process: refuse ``name`` older than its tested floor, warn when newer than tested
    (:func:`ampbridge.backends.private_hooks.check_release`). ``name`` must be imported already."""
    from .private_hooks import TESTED, check_release

    version = getattr(sys.modules.get(name), "__version__", None)
    if name in TESTED and isinstance(version, str):
        check_release(name, version)


def doctests(namespace: dict[str, Any]) -> dict[str, Any]:
    """A backend package's ``__test__``: ``doctest.testmod`` looks only at names defined in the module
    itself, so this hands it the package docstring and the rooms' public functions and classes."""
    public = set(namespace["__all__"])
    return {"overview": namespace["__doc__"]} | {
        name: obj for name, obj in namespace.items() if name in public and isinstance(obj, type | FunctionType)}


# --- what the two Keras backends (Keras 3, tf.keras 2) share: kinds and the layer walk ------------

#: Keras layer class names (in ``keras.layers`` and ``tf_keras.layers``) -> portable kind; most
#: specific first: ConvLSTM subclasses RNN, so it stays recurrent. Normalization (preprocessing: an
#: adapted mean and variance) normalises its input as BatchNormalization at inference does: a norm.
KERAS_KIND_CLASSES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("BatchNormalization", "LayerNormalization", "GroupNormalization", "UnitNormalization", "RMSNormalization",
      "Normalization"), "norm"),
    (("Embedding",), "embedding"),
    (("Softmax",), "softmax"),
    (("Dense", "EinsumDense"), "linear"),
    (("MultiHeadAttention", "GroupedQueryAttention", "Attention", "AdditiveAttention"), "attention"),
    (("RNN", "Bidirectional", "LSTMCell", "GRUCell", "SimpleRNNCell", "StackedRNNCells"), "recurrent"),
    (("Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose", "DepthwiseConv1D",
      "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D"), "conv"),
)


def keras_kind_table(layers_module: Any) -> list[tuple[tuple[type, ...], str]]:
    """:data:`KERAS_KIND_CLASSES` as the classes a Keras ``layers`` module has (a release without one
    simply lacks it)."""
    return [(tuple(getattr(layers_module, n) for n in names if hasattr(layers_module, n)), kind)
            for names, kind in KERAS_KIND_CLASSES]


def kind_cascade(layer: Any, registry: KindRegistry, table: Callable[[], list[tuple[tuple[type, ...], str]]],
                 framework_prefix: str, children: Callable[[Any], list[Any]]) -> tuple[str | None, str | None]:
    """``(kind, how it was decided)`` as every backend decides it: the ``ampbridge_kind`` attribute,
    the classes ``registry`` holds (``register_kind``), the framework's ``table()`` of classes, then
    the core's inference from the names of the class and its bases outside ``framework_prefix``
    (``leaf``: ``children(layer)`` is empty).

    Example:
        >>> class MyAttention: pass
        >>> kind_cascade(MyAttention(), KindRegistry(), list, "keras.", lambda layer: [])
        ('attention', 'class name')
    """
    declared = getattr(layer, "ampbridge_kind", None)
    if declared is not None:
        return declared, "ampbridge_kind attribute"
    registered = registry.lookup(type(layer))
    if registry.found(registered):
        return registered, "registered"
    for classes, kind in table():
        if classes and isinstance(layer, classes):
            return kind, "framework class"
    names = [c.__name__ for c in type(layer).__mro__ if not c.__module__.startswith((framework_prefix, "builtins"))]
    return infer_kind(names, leaf=not children(layer))


def walk_tree(root: Any, children: Callable[[Any], list[tuple[str, Any]]]) -> Iterator[tuple[str, Any]]:
    """``(path, node)`` for ``root`` (path ``""``) and every node below it, depth first, where
    ``children(node)`` gives ``(name, child)`` pairs: paths join names with ``.``, a node reached
    twice (shared) is listed once, at its first path, and siblings with one name get ``_2``, ``_3``.

    Example:
        >>> tree = {"a": {"b": {}}, "c": {}}
        >>> [p for p, _ in walk_tree(tree, lambda n: list(n.items()))]
        ['', 'a', 'a.b', 'c']
    """
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield path, node
        kids, used = [], set()
        for name, child in children(node):
            segment, n = name, 1
            while segment in used:  # siblings with one name (possible in subclassed models)
                n += 1
                segment = f"{name}_{n}"
            used.add(segment)
            kids.append((f"{path}.{segment}" if path else segment, child))
        stack.extend(reversed(kids))


# --- a [[phase]] schedule's clock in a fit callback (Keras 3 and tf.keras 2) ------------------------

def clone_keras_model(keras_module: Any, model: Any) -> Any:
    """A copy of a Keras 3 or tf.keras 2 model with the same layer names and weights (``tune`` runs
    on copies: the user's model is never applied to)."""
    name = keras_module.__name__
    try:
        clone = keras_module.models.clone_model(model)
    except Exception as e:  # a subclassed model without a config: say what tune needs
        raise TypeError(f"tune clones the model with {name}.models.clone_model, which failed: "
                        f"{type(e).__name__}: {e}") from None
    clone.set_weights(model.get_weights())
    return clone


def stack_batches(batches: Any, who: str) -> tuple[Any, Any, int]:
    """``(x, y)`` batches of one size as two arrays and that size (what one ``fit`` call takes)."""
    import numpy as np

    xs, ys = zip(*batches)
    sizes = {len(x) for x in xs}
    if len(sizes) != 1:
        raise ValueError(f"tune's {who} data: every batch must have the same size; received sizes {sorted(sizes)}")
    return np.concatenate([np.asarray(x) for x in xs]), np.concatenate([np.asarray(y) for y in ys]), sizes.pop()


class PhaseClock:
    """The step and epoch bookkeeping of a ``fit`` callback running a ``[[phase]]`` schedule, framework-free:
    mixed in before the framework's ``Callback`` class, it calls :meth:`_enter` at each epoch (or step,
    for ``until_step``) boundary and records each switch; the backend's ``_switch(index, first, **where)``
    does the switching (``first``: the phase the run starts in). ``on_train_batch_end`` calls the next
    class's too (Keras 3's ``LossScaleCallback`` looks at the scale there).

    Example:
        >>> import ampbridge
        >>> class Callback:  # the framework's
        ...     def on_train_batch_end(self, batch, logs=None): pass
        >>> class Phases(PhaseClock, Callback):
        ...     def _switch(self, index, first, **where): pass
        >>> cb = Phases()
        >>> cb._start_clock(ampbridge.loads('[[phase]]\\nuntil_step = 2\\ncompute_dtype = "float32"'))
        >>> for batch in range(4):
        ...     cb.on_train_batch_begin(batch); cb.on_train_batch_end(batch)
        >>> cb.switches
        [(0, 0), (2, None)]
    """

    policy: Policy

    def _start_clock(self, policy: Policy) -> None:
        self.policy = policy
        self.phase: int | None = -1  # index in force (None: after the last phase); -1: none yet
        self.switches: list[tuple[int, int | None]] = []  # (epoch or step, phase index) at each switch
        self._step = 0
        self._epoch_first_step = 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch_first_step = self._step
        if self.policy.phase_unit != "step":
            self._enter(self.policy.phase_index(epoch=epoch), epoch, epoch=epoch)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._step = self._epoch_first_step + batch
        if self.policy.phase_unit == "step":
            self._enter(self.policy.phase_index(step=self._step), self._step, step=self._step)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        super().on_train_batch_end(batch, logs)  # type: ignore[misc]  (the framework's Callback)
        self._step = self._epoch_first_step + batch + 1

    def _enter(self, index: int | None, at: int, **where: int) -> None:
        if index == self.phase:
            return
        first = self.phase == -1
        self.phase = index
        self.switches.append((at, index))
        self._switch(index, first, **where)

    def _switch(self, index: int | None, first: bool, **where: int) -> None:
        raise NotImplementedError

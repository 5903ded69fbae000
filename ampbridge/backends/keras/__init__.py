"""The Keras 3 backend: the Plan as per-layer dtype policies, and a loss-scaling optimizer.

Works the same on Keras's TensorFlow, JAX and torch backends; it imports ``keras`` only (and
``tensorflow`` only for the TF32 switch when TensorFlow is the active Keras backend).

* :func:`apply` sets every layer's ``dtype_policy`` to its Plan row (compute / variable dtype),
  re-casts built weights whose variable dtype changes (values kept), casts outputs where a row
  (or the policy, for the model) asks for another output dtype, and sets ``matmul_precision``.
* :func:`scope` builds models under the policy: the global Keras dtype policy, plus the
  ``kind:``/``type:`` rules applied to each layer as it is created.
* :func:`optimizer` wraps a Keras optimizer in :class:`LossScaleOptimizer`, a subclass of
  Keras's own that runs ampbridge's reference loss-scale algorithm in ``keras.ops``.
* :class:`PhaseCallback` switches phases of a precision schedule during ``fit``.
* :class:`MonitorCallback` (``fit``) and :class:`Monitor` (custom loops) write the numerics log
  ``ampbridge report`` reads: per-layer gradient statistics and which layer overflowed first.

All of them apply the environment's bisect switch (``AMPBRIDGE_DISABLE=1``,
``AMPBRIDGE_POLICY=...``) and resolve ``compute_dtype = "auto"`` for the backend's
:func:`device` (:func:`resolve_policy`).

Example:
    >>> import keras, ampbridge
    >>> policy = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="dense"),
    ...                           keras.layers.LayerNormalization(name="norm")])
    >>> model = ampbridge.keras.apply(model, policy)
    >>> model.get_layer("dense").compute_dtype, model.get_layer("norm").compute_dtype
    ('float16', 'float32')
    >>> model.compile(ampbridge.keras.optimizer(keras.optimizers.SGD(), policy), "mse")
"""

from ..common import import_framework

import_framework("keras", "keras")  # before any room imports it: a clear error naming the extra

from .apply import apply, scope  # noqa: E402
from .environment import bfloat16_rounding, device, resolve_policy, set_matmul_precision  # noqa: E402
from .layers import kind_and_source, kind_of, layers, owns, register_kind, walk  # noqa: E402
from .loss_scale import LossScaleCallback, LossScaleOptimizer, optimizer  # noqa: E402
from .monitor import Monitor, MonitorCallback  # noqa: E402
from .plan import MixedDTypePolicy, dtype_policy, plan  # noqa: E402
from .saving import load_model, stored_policy  # noqa: E402
from .schedule import PhaseCallback  # noqa: E402
from .trace import trace  # noqa: E402
from .tune import tune  # noqa: E402

__all__ = [
    "LossScaleCallback",
    "LossScaleOptimizer",
    "MixedDTypePolicy",
    "Monitor",
    "MonitorCallback",
    "PhaseCallback",
    "apply",
    "bfloat16_rounding",
    "device",
    "dtype_policy",
    "kind_and_source",
    "kind_of",
    "layers",
    "load_model",
    "optimizer",
    "owns",
    "plan",
    "register_kind",
    "resolve_policy",
    "scope",
    "set_matmul_precision",
    "stored_policy",
    "trace",
    "tune",
    "walk",
]

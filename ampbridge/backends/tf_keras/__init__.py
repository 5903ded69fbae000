"""The tf.keras 2 backend (the ``tf_keras`` package, ``TF_USE_LEGACY_KERAS=1``): the Plan as
per-layer ``tf_keras.mixed_precision.Policy`` objects, and Keras 2's ``LossScaleOptimizer``.

* :func:`plan` / :func:`layers`: the same rows as Keras 3 for the same model;
* :func:`apply` rebuilds a Functional or Sequential model with each layer's policy and the same
  weights (Keras 2 fixes a layer's dtype when it is made) and returns it;
* :class:`Monitor` writes the numerics log ``ampbridge report`` reads, as a ``fit`` callback;
* :class:`PhaseCallback` runs a ``[[phase]]`` schedule during ``fit``;
* :func:`load_model` loads a saved model with its policy and loss-scale state (training resumes exactly);
* :func:`optimizer` wraps a tf_keras optimizer in ``tf_keras.mixed_precision.LossScaleOptimizer``:
  Keras 2's own algorithm where it runs the policy's settings, ampbridge's reference otherwise.

Detection (``ampbridge.plan(model, policy)``) never imports TensorFlow: only a class whose module is
``tf_keras.*`` is looked at. docs/tf_keras.md says what is realised and what is refused by name.

Example:
    >>> import tf_keras, ampbridge
    >>> policy = ampbridge.preset("mixed_float16").replace(keep_float32=("kind:norm",))
    >>> x = tf_keras.Input((4,))
    >>> m = tf_keras.Model(x, tf_keras.layers.LayerNormalization(name="norm")(tf_keras.layers.Dense(8, name="dense")(x)))
    >>> m = ampbridge.tf_keras.apply(m, policy)
    >>> m.get_layer("dense").compute_dtype, m.get_layer("norm").compute_dtype
    ('float16', 'float32')
"""

from ..common import doctests, import_framework

import_framework("tf_keras", "tf_keras")  # before any room imports it: a clear error naming the extra

from .apply import OUTPUT_CAST, apply  # noqa: E402
from .environment import device, resolve_policy, set_matmul_precision  # noqa: E402
from .layers import author_dtypes, dtype_policy, kind_and_source, kind_of, layers, owns, register_kind, walk  # noqa: E402
from .loss_scale import keras2_expressible, optimizer, state_of  # noqa: E402
from .plan import STREAM_REFUSED, plan  # noqa: E402  (plan: static, traced when example inputs are given)
from .trace import trace  # noqa: E402
from .monitor import Monitor  # noqa: E402
from .schedule import PhaseCallback  # noqa: E402
from .tune import tune  # noqa: E402
from .saving import load_model, stored_policy  # noqa: E402

__all__ = [
    "Monitor",
    "OUTPUT_CAST",
    "PhaseCallback",
    "STREAM_REFUSED",
    "apply",
    "author_dtypes",
    "device",
    "dtype_policy",
    "keras2_expressible",
    "kind_and_source",
    "kind_of",
    "layers",
    "load_model",
    "optimizer",
    "owns",
    "plan",
    "register_kind",
    "resolve_policy",
    "set_matmul_precision",
    "state_of",
    "stored_policy",
    "trace",
    "tune",
    "walk",
]

__test__ = doctests(globals())

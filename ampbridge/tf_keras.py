"""The tf.keras 2 backend (the ``tf_keras`` package), ``ampbridge.tf_keras``; the implementation lives
in ``ampbridge/backends/tf_keras/`` (environment, layers, plan, trace, apply, loss_scale, monitor, schedule, saving). See
``ampbridge.backends.tf_keras`` for what it does and an example."""

from .backends.tf_keras import *  # noqa: F403
from .backends.tf_keras import __all__  # noqa: F401

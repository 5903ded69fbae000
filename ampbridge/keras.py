"""The Keras 3 backend, ``ampbridge.keras``; the implementation lives in ``ampbridge/backends/keras/``
(one module per job: environment, layers, plan, apply, loss_scale, numerics, monitor, schedule,
saving). See ``ampbridge.backends.keras`` for what it does and an example."""

from .backends.keras import *  # noqa: F403
from .backends.keras import __all__  # noqa: F401

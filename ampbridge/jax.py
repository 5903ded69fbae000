"""ampbridge for JAX (Flax linen and NNX, optax): the public name ``ampbridge.jax``.

The implementation lives in ampbridge/backends/jax/ (one module per job: environment, layers,
cast, watch, linen, nnx, apply, plan, loss_scale, monitor, schedule).
"""

from .backends.jax import *  # noqa: F403
from .backends.jax import __all__, __test__  # noqa: F401

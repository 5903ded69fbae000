"""ampbridge for JAX: Flax (linen and NNX) casting per Plan row, and loss scaling as optax.

JAX has no AMP of its own. This adapter realises a policy with Flax's and optax's own pieces:

- :func:`apply` on a ``flax.linen.Module`` returns an :class:`Applied` with ``init``/``apply``.
  A linen *method interceptor* (``nn.intercept_methods``) runs around every module method: it
  casts the module's floating inputs to the compute dtype of its Plan row, sets the module's own
  ``dtype``/``param_dtype`` attributes (so Flax's ``promote_dtype`` agrees) and casts its outputs
  to the row's output dtype. Parameters are cast per module path inside ``apply``, i.e. inside the
  function you differentiate, so gradients arrive in the stored (``param_dtype``) parameters.
  Mutable collections keep the dtypes their modules created them in (``batch_stats`` float32,
  a ``decode=True`` cache the compute dtype).
- :func:`apply` on a ``flax.nnx.Module`` returns a copy whose modules follow the Plan: parameters
  stored in the row's ``param_dtype``, ``dtype`` attributes set, and every public method of each
  module with a ``__call__`` (``attend``, ``encode``, ``init_cache``, ...) casting its inputs, its
  own parameters and its outputs; its ``nnx.Cache`` variables are held in its compute dtype.
- :func:`cast` (and, in its room, ``cast_to_compute``/``cast_to_param``/``cast_to_output``) for plain pytrees
  (equinox, haiku): floating leaves only; ints, bools and non-arrays pass through.
- :func:`optimizer` wraps any optax transformation with the reference loss-scale algorithm
  (``ampbridge.core.loss_scale``): ``update`` unscales, checks finiteness, and on a non-finite step
  returns (negative) zero updates and leaves the inner state untouched. Everything is pure
  ``jnp``/``lax`` on pytree state with static settings: no host sync, no Python branch on a
  traced value, no host callback unless you ask for one (``host_callback=True``).
- :func:`scale_loss`, :func:`loss_scale`, :func:`check` find the loss-scale state anywhere in an
  optax state (chains, ``MultiSteps``, ``nnx.Optimizer``); :func:`value_and_grad` scales the loss
  for you (``jax.value_and_grad`` style); :func:`skipped` and :func:`rollback` keep any other state
  (``batch_stats``) as it was on a skipped step.
- :func:`plan` / :func:`owns` for ``ampbridge.plan(module, policy, *example_inputs)``;
  :func:`trace`: the Plan with each row's dtypes as one traced forward ran them.
- :class:`Schedule`: precision phases (``[[phase]]``), one jitted step per phase.
- ``distributed.pmean_grads`` (in ``shard_map``/``pmap``) and
  ``distributed.data_parallel_value_and_grad`` (a sharded ``jit``): the data-parallel gradient
  all-reduce in ``reduce_dtype``; ``distributed.replicate``.

Rooms: ``environment`` (dtypes, device, the policy that runs), ``layers`` (kinds, rows),
``cast`` (pytrees), ``watch`` (the probes of :func:`numerics`), ``linen`` and ``nnx`` (each
flavour's interception and Plan), ``apply``, ``plan``, ``loss_scale``, ``sampling`` (what
``Monitor.wrap`` keeps between samples), ``stats`` (the per-layer statistics and attribution
:func:`numerics` computes in the step), ``monitor``, ``schedule``.
Flax and optax are imported on first use.

Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, optax, ampbridge
    >>> policy = ampbridge.Policy(compute_dtype="float16", keep_float32=("kind:norm",))
    >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
    >>> amp = ampbridge.jax.apply(model, policy)
    >>> variables = amp.init(jax.random.key(0), jnp.ones((4, 3)))
    >>> amp.apply(variables, jnp.ones((4, 3))).dtype
    dtype('float32')
    >>> tx = ampbridge.jax.optimizer(optax.sgd(0.1), policy)
    >>> opt_state = tx.init(variables["params"])
    >>> float(ampbridge.jax.loss_scale(opt_state).scale)
    65536.0
"""

from ..common import doctests, import_framework

import_framework("jax", "jax")

# the rooms, in layers: environment -> layers -> cast -> watch -> linen -> nnx -> apply -> plan
# -> loss_scale -> sampling -> monitor -> schedule (the room modules apply, cast, plan and loss_scale are
# shadowed here by the functions of those names: reach them as
# ``from ampbridge.backends.jax.loss_scale import ...``)
from .apply import Applied, apply  # noqa: E402
from .cast import cast  # noqa: E402
from .environment import dtype, resolve_policy  # noqa: E402
from .loss_scale import (  # noqa: E402
    PackedLossScale,
    check,
    loss_scale,
    optimizer,
    rollback,
    scale_loss,
    skipped,
    value_and_grad,
)
from . import distributed  # noqa: E402  (a namespace: pmean_grads, data_parallel_value_and_grad, replicate)
from .monitor import Monitor, Numerics, numerics  # noqa: E402
from .plan import plan  # noqa: E402
from .schedule import Schedule  # noqa: E402
from .trace import trace  # noqa: E402
from .tune import tune  # noqa: E402
from .layers import layers, owns, register_kind  # noqa: E402

__all__ = [
    "Applied",
    "Monitor",
    "Numerics",
    "PackedLossScale",
    "Schedule",
    "apply",
    "cast",
    "check",
    "distributed",
    "dtype",
    "layers",
    "loss_scale",
    "numerics",
    "optimizer",
    "owns",
    "plan",
    "register_kind",
    "resolve_policy",
    "rollback",
    "scale_loss",
    "skipped",
    "trace",
    "tune",
    "value_and_grad",
]

__test__ = doctests(globals())  # the rooms' examples, for doctest.testmod(ampbridge.jax)

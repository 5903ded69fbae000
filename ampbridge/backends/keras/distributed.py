"""The loss-scaling optimizer under data parallelism: every replica skips a step any replica found
non-finite, and ``reduce_dtype`` is the variables' dtype or refused by name.

Under ``tf.distribute`` each replica checks its own gradients before Keras all-reduces them
(inside the inner optimizer's update), and Keras's ``LossScaleOptimizer`` takes the first
replica's flag for all: an overflow on another replica alone went into the sum and every replica
stepped with inf. Here the flags are agreed first (one scalar all-reduce per step). Under
``keras.distribution.DataParallel`` (JAX) the step is one global program: the check already sees
every replica's gradients. Keras all-reduces gradients in the variables' dtype, so a policy whose
``reduce_dtype`` differs from its ``param_dtype`` is refused with more than one replica.

Holds: agreed_finite, check_reduce_dtype, replicas, tf_apply.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from ...core.policy import Policy
from ...errors import UnsupportedOptionError
from .environment import active_backend


def agreed_finite(finite: Any) -> Any:
    """``finite`` and-ed over the replicas of the ``tf.distribute`` replica context in force (one
    scalar all-reduce); ``finite`` itself with one replica, outside a replica context, or on
    another backend."""
    if active_backend() != "tensorflow":
        return finite
    import tensorflow as tf

    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync <= 1:
        return finite
    bad = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(tf.logical_not(finite), tf.int32))
    return tf.equal(bad, 0)


def replicas() -> int:
    """How many replicas the model trains on: the devices of the Keras distribution in force, else
    the ``tf.distribute`` strategy's replicas (TensorFlow), else 1.

    Example:
        >>> replicas()
        1
    """
    distribution = keras.distribution.distribution()
    if distribution is not None:
        return max(1, int(np.prod(distribution.device_mesh.shape)))
    if active_backend() == "tensorflow":
        import tensorflow as tf

        return int(tf.distribute.get_strategy().num_replicas_in_sync)
    return 1


def check_reduce_dtype(policy: Policy | None, replicas: int) -> None:
    """Raise :class:`ampbridge.errors.UnsupportedOptionError` when ``replicas > 1`` and the
    policy's ``reduce_dtype`` is not its ``param_dtype`` (Keras reduces in the variables' dtype)."""
    if policy is None or replicas <= 1:
        return
    active = policy.at(step=0, epoch=0)
    if active.reduce_dtype != active.param_dtype:
        raise UnsupportedOptionError(
            f"reduce_dtype={active.reduce_dtype} with param_dtype={active.param_dtype} on {replicas} replicas: "
            "Keras all-reduces gradients in the variables' dtype; set reduce_dtype to the param_dtype")


def tf_apply(optimizer: Any, grads: Any, trainable_variables: Any = None) -> None:
    """``LossScaleOptimizer.apply`` on TensorFlow, in a replica context: Keras's own logic with
    the finite flag agreed over the replicas before anything is applied."""
    import tensorflow as tf

    if tf.distribute.in_cross_replica_context():
        raise ValueError("apply() must be called in a replica context.")
    grads = list(grads)  # every replica hands merge_call the same structure
    ctx = tf.distribute.get_replica_context()
    check_reduce_dtype(optimizer.policy, ctx.num_replicas_in_sync)
    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        optimizer._common_apply(grads, trainable_variables=trainable_variables)  # agrees there
        return
    finite = agreed_finite(optimizer.check_finite(grads))

    def cross_replica(distribution: Any, grads: Any, trainable_variables: Any, finite: Any) -> None:
        finite = distribution.experimental_local_results(finite)[0]  # agreed: the same on every replica

        def apply_finite() -> None:
            distribution.extended.call_for_each_replica(optimizer._stateful_handle_finite_grads,
                                                        args=(grads, trainable_variables))

        # a cond in the cross-replica context: the inner optimizer's update calls merge_call
        ops.cond(finite, apply_finite, optimizer._stateful_handle_non_finite_grads)

    ctx.merge_call(cross_replica, args=(grads, trainable_variables, finite))

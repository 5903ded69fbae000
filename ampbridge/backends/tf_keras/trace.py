"""What one forward really ran in: ``trace(model, policy, *example_inputs)`` applies the policy to a
rebuilt copy of the model (the model given is not changed), reads the output dtypes of one forward,
and writes them onto the static Plan's rows. Holds ``trace``.
"""

from __future__ import annotations

from typing import Any

from ...core.plan import Plan
from ...core.policy import Policy
from .plan import traced


def trace(model: Any, policy: Policy | str, *example_inputs: Any, warn: bool = True) -> Plan:
    """The Plan of a tf_keras model from one traced forward (inputs required): the applied copy runs once
    and the output dtype of the model and of each layer of its own graph called once is the one
    observed (nested layers keep their static rows). Needs a Functional or Sequential model.

    Example:
        >>> import ampbridge, tf_keras
        >>> m = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1, name="head")])
        >>> trace(m, "mixed_bfloat16", tf_keras.backend.ones((1, 2)))["head"].output_dtype
        'bfloat16'
    """
    if not example_inputs:
        raise TypeError("ampbridge.tf_keras.trace(model, policy, *example_inputs) needs example inputs to run "
                        "(the static Plan is ampbridge.tf_keras.plan(model, policy))")
    return traced(model, policy, example_inputs, warn=warn)

"""What one forward really ran in: ``trace(model, policy, *example_inputs)`` applies the policy to a
rebuilt copy of the model (the model given is not changed), reads the output dtypes of one forward,
and writes them onto the static Plan's rows. Holds ``trace``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
import tf_keras

from ...core.plan import Plan, traced_plan, traced_row
from ...core.policy import Policy
from .apply import apply
from .layers import _graph, walk
from .plan import _static


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
    static = _static(model, policy, warn=warn)
    twin = apply(model, static.policy, warn=False)
    by_path = dict(walk(twin))
    # the root graph's own layers (a nested graph's tensors, its own output included, are its graph's)
    probed = [p for p, layer in by_path.items()
              if p and "." not in p and not _graph(layer) and len(getattr(layer, "_inbound_nodes", ())) == 1]
    taps = tf_keras.Model(twin.inputs, [by_path[p].output for p in probed] + [twin.output])
    seen = taps(*example_inputs)
    observed = {p: {t.dtype.name} for p, t in zip(probed, seen)}
    observed[""] = {t.dtype.name for t in tf.nest.flatten(seen[-1])}
    rows = [traced_row(row, None, observed[row.path]) if row.path in observed else row for row in static.rows]
    return traced_plan(static, rows)

"""The monitor's float8 reader on Flax linen: per float8 layer, this step's amax, the scale it used
and saturation, from the ``_overwrite_with_gradient`` collection Flax's ``fp8_ops`` keep
(``input_scale``, ``input_amax_history``, ``kernel_*``, ``output_grad_*``).

Flax quantizes step t with the scale it computes at step t (``in_qdq`` updates the scale from the
history before step t, then quantizes), and that scale is what the collection holds after the step
(``apply_gradients`` overwrites it with its "gradient"); the history's first entry after step t is
step t's amax. So the collection after the step is all a record needs: saturation is
``amax / scale > fp8_max`` (``fp8_ops.quantize`` clips ``x / scale``, computed in the compute dtype,
to the format's max); the
fraction clipped is not counted (it would need the tensor itself).

Example:
    >>> import numpy as np
    >>> meta = {n: np.ones(1, np.float32) for n in ("input_scale", "kernel_scale", "output_grad_scale")}
    >>> meta |= {n: np.array([900.0, 1.0], np.float32) for n in ("input_amax_history", "kernel_amax_history",
    ...                                                          "output_grad_amax_history")}
    >>> stats = fp8_stats({"fc1": {"Fp8DirectDotGeneralOp_0": meta}})
    >>> stats["fc1"]["input"].saturated, stats["fc1"]["grad_output"].saturated
    (True, False)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...core.fp8 import FP8_MAX
from ...diagnostics.runlog import Fp8TensorStats

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"  # flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT
#: (the log's tensor name, fp8_ops' variable prefix, the format fp8_ops casts it to)
TENSORS = (("input", "input", "e4m3"), ("weight", "kernel", "e4m3"), ("grad_output", "output_grad", "e5m2"))


def _ops(tree: Mapping[str, Any], path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Mapping[str, Any]]]:
    """(module path, variables) of every fp8_ops module in the collection, in tree order."""
    if "input_amax_history" in tree:
        return [(path, tree)]
    return [hit for key, sub in tree.items() if isinstance(sub, Mapping) for hit in _ops(sub, path + (str(key),))]


def fp8_stats(collection: Mapping[str, Any],
              compute_dtypes: Mapping[str, str] | None = None) -> dict[str, dict[str, Fp8TensorStats]]:
    """Per float8 layer (the Plan path of the layer holding the fp8_ops module: its module path
    without the op's own name, ``.``-joined), per tensor, from the ``_overwrite_with_gradient``
    collection after the step (or the whole variables dict holding it). Reads the values (one
    transfer): call it on the steps you log. A layer with two ops (``Einsum``) keeps the last.
    ``compute_dtypes``: per layer path the dtype fp8_ops scales in (the kernel's dtype as the layer
    passes it: the Plan row's compute dtype); float32 where not given."""
    import jax
    import numpy as np

    collection = collection.get(OVERWRITE_WITH_GRADIENT, collection)
    found = _ops(collection)
    wanted = [[meta[f"{prefix}_amax_history"][:1] for _, prefix, _ in TENSORS]
              + [meta[f"{prefix}_scale"] for _, prefix, _ in TENSORS] for _, meta in found]
    out: dict[str, dict[str, Fp8TensorStats]] = {}
    for (path, _), values in zip(found, jax.device_get(wanted)):
        values = [float(np.asarray(v, np.float32).reshape(-1)[0]) for v in values]
        layer = ".".join(path[:-1])
        dtype = (compute_dtypes or {}).get(layer, "float32")
        out[layer] = {
            name: Fp8TensorStats(amax=values[i], scale=values[3 + i], scale_op="divide", fp8_max=FP8_MAX[fmt],
                                 compute_dtype=dtype if dtype in ("bfloat16", "float16") else "float32")
            for i, (name, _, fmt) in enumerate(TENSORS)}
    return out

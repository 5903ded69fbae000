"""Loading a saved Keras model with its policy re-applied (output casts live on the model object,
not in the file); the registered ``MixedDTypePolicy`` and ``LossScaleOptimizer`` make the file load.

Names: ``load_model``.
"""

from __future__ import annotations

from typing import Any

import keras

from ...core.policy import Policy
from .apply import apply

def load_model(filepath: Any, policy: Policy | str | None = None, **kwargs: Any) -> Any:
    """``keras.saving.load_model`` plus :func:`apply`, so output casts come back too.

    Keras saves each layer's dtype policy and the optimizer (loss-scale state included); the
    casts ampbridge adds to outputs live on the model object, so they are re-applied here from
    ``policy``, or from the policy stored with the model's :class:`LossScaleOptimizer`.

    Example:
        >>> # model.save("run.keras"); model = ampbridge.keras.load_model("run.keras")
    """
    model = keras.saving.load_model(filepath, **kwargs)
    if policy is None:
        policy = getattr(getattr(model, "optimizer", None), "policy", None)
    if policy is not None:
        apply(model, policy, warn=False)
    return model

"""Saving and loading: a model saved after :func:`apply` loads in plain Keras 2, and :func:`load_model`
loads it with what ampbridge added: the policy, and ampbridge's optimizer with the loss-scale state.

Where each format keeps what (Keras 2 itself keeps the layers' dtype policies in every format):

* ``.keras``: Keras 2 keeps the inner optimizer's variables, not the loss scale; ``apply``'s
  ``save_assets`` hook adds ``assets/ampbridge_tf_keras.json`` (the policy, the loss-scale state);
* SavedModel: the checkpoint under ``variables/`` holds every optimizer variable (the loss scale and
  the reference state's counters too) and the policy (``optimizer/ampbridge_policy``, a string
  variable :func:`~ampbridge.tf_keras.optimizer` adds), but Keras 2's loader restores none of the
  optimizer's: :func:`load_model` reads that checkpoint again into the optimizer;
* ``.h5``: Keras 2 keeps no optimizer state (its HDF5 writer asks the optimizer for ``variables``, a
  method), so nothing to resume from: :func:`load_model` says so, and needs the policy given.

Names: ``load_model``, ``stored_policy``; ``_format``, ``_record``, ``_set_state``.
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile
from typing import Any

import tensorflow as tf
import tf_keras

from ...core.policy import Policy
from ...errors import AmpBridgeWarning, UnsupportedOptionError
from .apply import ASSET, attach_asset
from .environment import resolve_policy
from .loss_scale import equip, ReferenceState


def _format(path: str) -> str:
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "saved_model.pb")):
        return "savedmodel"
    if os.path.isfile(path) and zipfile.is_zipfile(path):
        return "keras"
    return "h5"


def _checkpoint(path: str) -> str:
    return os.path.join(path, "variables", "variables")


def _record(path: str, fmt: str) -> dict[str, Any] | None:
    """``{"policy": ..., "loss_scale": state or None}`` as the file keeps it, or None."""
    if fmt == "keras":
        with zipfile.ZipFile(path) as archive:
            name = f"assets/{ASSET}"
            return json.loads(archive.read(name).decode("utf-8")) if name in archive.namelist() else None
    if fmt == "savedmodel":
        reader = tf.train.load_checkpoint(_checkpoint(path))
        key = "optimizer/ampbridge_policy/policy/.ATTRIBUTES/VARIABLE_VALUE"
        if reader.has_tensor(key):
            return {"policy": json.loads(reader.get_tensor(key).decode("utf-8")), "loss_scale": None}
    return None


def stored_policy(filepath: Any) -> Policy | None:
    """The policy a model was saved under (``.keras``: by a model :func:`apply` made; SavedModel: by
    an optimizer :func:`~ampbridge.tf_keras.optimizer` made), or None.

    Example:
        >>> stored_policy("no-such-file.keras") is None
        True
    """
    path = os.fspath(filepath)
    if not os.path.exists(path):
        return None
    record = _record(path, _format(path))
    return Policy.from_dict(record["policy"]) if record is not None else None


def _set_state(opt: Any, state: dict[str, Any]) -> None:
    """The loss-scale state a ``.keras`` asset recorded, into ``opt`` (made by ``optimizer``)."""
    ls = opt._loss_scale  # private: Keras 2's state object (or the reference one), as in loss_scale.py
    ls.current_loss_scale.assign(state["scale"])
    ls.counter.assign(state["good_steps"])
    if isinstance(ls, ReferenceState):
        for name in ("hysteresis_left", "steps", "skipped"):
            if name in state:
                getattr(ls, name).assign(state[name])


def load_model(filepath: Any, policy: Policy | str | None = None, **kwargs: Any) -> Any:
    """``tf_keras.models.load_model`` plus what ampbridge added: the policy (the model's ``Monitor``,
    ``PhaseCallback`` and ``plan`` read it) and :func:`~ampbridge.tf_keras.optimizer`'s optimizer
    around the loaded inner optimizer, its loss-scale state restored, so that training resumes where
    it stopped (``.keras`` and SavedModel; an ``.h5`` file keeps no optimizer state in Keras 2).

    ``policy`` defaults to the one stored in the file (:func:`stored_policy`); ``kwargs`` go to
    ``tf_keras.models.load_model``. Plain Keras 2 loads the same file as a working model.

    Example:
        >>> # model.save("run.keras"); model = ampbridge.tf_keras.load_model("run.keras")
    """
    path = os.fspath(filepath)
    fmt = _format(path)
    model = tf_keras.models.load_model(path, **kwargs)
    record = _record(path, fmt)
    if policy is None and record is not None:
        policy = Policy.from_dict(record["policy"])
    if policy is None:
        return model
    policy, _ = resolve_policy(policy, warn=False)
    object.__setattr__(model, "_ampbridge_policy", policy)
    attach_asset(model)  # saved again, it keeps them again
    native = getattr(model, "optimizer", None)
    if not isinstance(native, tf_keras.mixed_precision.LossScaleOptimizer):
        return model
    config = policy.at(step=0, epoch=0).resolved_loss_scale
    if not native.dynamic or native.dynamic_growth_steps != max(config.growth_interval, 1):
        raise UnsupportedOptionError(
            f"{path}: its LossScaleOptimizer (dynamic={native.dynamic}, dynamic_growth_steps="
            f"{native.dynamic_growth_steps}) is not the one the policy makes (growth_interval={config.growth_interval}); "
            "accepted: the policy the model was trained with (load_model without one reads it from the file)")
    ours = equip(native, policy)  # Keras 2's own optimizer, as loaded: the inner one's variables kept
    model.train_function = None  # traced again with the state object in place
    if fmt == "savedmodel":
        model.load_weights(_checkpoint(path)).expect_partial()  # every optimizer variable, on creation
    elif fmt == "keras" and record is not None and record.get("loss_scale") is not None:
        _set_state(ours, record["loss_scale"])
    else:
        warnings.warn(f"{path}: the file keeps no loss-scale state (Keras 2's {fmt} "
                      f"{'format keeps no optimizer state' if fmt == 'h5' else 'file was not saved by a model apply made'}"
                      "); the optimizer starts from the policy's initial scale. Save as .keras or a SavedModel "
                      "to resume exactly", AmpBridgeWarning, stacklevel=2)
    return model

"""Saving and loading: a ``.keras`` file saved after :func:`apply` loads in plain Keras, and
:func:`load_model` restores everything ampbridge added (the policy and its pins, output casts, the
full loss-scale state) from the file alone.

What travels where: each layer's config holds its Keras dtype policy (plain Keras reads it); the
optimizer saves as Keras's own ``LossScaleOptimizer`` when its settings are ones Keras runs the
same way (:func:`ampbridge.keras.loss_scale.keras_expressible`), with the state Keras has no
variable for in an asset; the policy is an asset of the model (``ampbridge_policy.json``) and of
the optimizer. Plain Keras ignores the assets.

Names: ``load_model``, ``stored_policy``; ``_read_assets``, ``_adopt``.
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile
from typing import Any

import keras

from ...core.policy import LossScaleConfig, Policy
from .apply import POLICY_ASSET, apply
from .layers import AUTHOR, mark_automatic, walk
from .loss_scale import LOSS_SCALE_ASSET, LossScaleOptimizer


def _read_assets(filepath: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the model's policy asset, the top-level optimizer's loss-scale asset) of a ``.keras`` file."""
    path = os.fspath(filepath)
    if not (os.path.isfile(path) and zipfile.is_zipfile(path)):
        return None, None
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()

        def read(name: str) -> dict[str, Any] | None:
            return json.loads(archive.read(name).decode("utf-8")) if name in names else None

        return read(f"assets/{POLICY_ASSET}"), read(f"assets/optimizer/{LOSS_SCALE_ASSET}")


def _restore_custom_compile(model: Any, filepath: Any) -> bool:
    """Compile a model whose class overrides ``compile()`` (keras-hub's tasks: CausalLM, classifiers)
    from the file's saved compile config, then load the optimizer's variables: for such a model
    ``keras.saving.load_model`` skips both with only a warning, and training would restart its
    optimizer (moments, step count, loss scale) from zero. True if it restored them."""
    optimizer = getattr(model, "optimizer", None)
    if type(model).compile is keras.Model.compile or (optimizer is not None and optimizer.built):
        return False  # Keras compiled it itself
    path = os.fspath(filepath)
    if not (os.path.isfile(path) and zipfile.is_zipfile(path)):
        return False
    with zipfile.ZipFile(path) as archive:
        compile_config = json.loads(archive.read("config.json").decode("utf-8")).get("compile_config")
    if not compile_config or compile_config.get("optimizer") is None:
        return False
    config = keras.saving.deserialize_keras_object(compile_config)
    model.compile(**{key: value for key, value in config.items() if value is not None})
    model.optimizer.build(model.trainable_variables)
    with warnings.catch_warnings():  # Keras's "compile() was not called" is what this just did
        warnings.filterwarnings("ignore", message=r".*compile\(\)` was not called")
        model.load_weights(path)
    return True


def stored_policy(filepath: Any) -> Policy | None:
    """The policy a ``.keras`` file was saved under (by a model :func:`apply` set up), or None.

    Example:
        >>> stored_policy("no-such-file.keras") is None
        True
    """
    model_asset, optimizer_asset = _read_assets(filepath)
    for asset in (model_asset, optimizer_asset):
        if asset is not None and asset.get("policy") is not None:
            return Policy.from_dict(asset["policy"])
    return None


def _adopt(model: Any, native: Any, asset: dict[str, Any], policy: Policy | None) -> LossScaleOptimizer:
    """Replace the Keras ``LossScaleOptimizer`` plain Keras loaded by ampbridge's, state included."""
    ours = LossScaleOptimizer(native.inner_optimizer, loss_scale=LossScaleConfig(**asset["loss_scale"]),
                              policy=policy, name=native.name)
    if native.built:
        ours.build(model.trainable_variables)
        for mine, theirs in zip(ours._keras_variables(), native.variables):
            if mine is not theirs:
                mine.assign(theirs)
        ours._restore_asset(asset)
    model.optimizer = ours
    compile_config = getattr(model, "_compile_config", None)
    if compile_config is not None:  # private: Trainer._compile_config (Keras 3.13-3.15), what save reads
        compile_config.config["optimizer"] = ours
    return ours


def load_model(filepath: Any, policy: Policy | str | None = None, **kwargs: Any) -> Any:
    """``keras.saving.load_model`` plus what ampbridge added: the policy re-applied (pins and
    output casts) and ampbridge's :class:`LossScaleOptimizer` with its full state.

    ``policy`` defaults to the one stored in the file (by :func:`apply` and the optimizer), so
    no argument is needed for a file ampbridge saved; plain ``keras.saving.load_model`` loads the
    same file as a working Keras model (see docs/keras.md for what it leaves out).

    Example:
        >>> # model.save("run.keras"); model = ampbridge.keras.load_model("run.keras")
    """
    with warnings.catch_warnings():  # said below in ampbridge's own words where it matters
        warnings.filterwarnings("ignore", message=r".*compile\(\)` was not called")
        warnings.filterwarnings("ignore", message=r"Skipping variable loading for optimizer")
        model = keras.saving.load_model(filepath, **kwargs)
    if kwargs.get("compile", True):
        _restore_custom_compile(model, filepath)
    model_asset, optimizer_asset = _read_assets(filepath)
    if policy is None:
        policy = stored_policy(filepath)
    if model_asset is not None:  # paths as the saving process had them (its automatic names)
        automatic = set(model_asset.get("automatic_names", ()))
        for _, layer in walk(model):
            if layer.name in automatic:
                mark_automatic(layer)
    if model_asset is not None and "set_by_the_model" in model_asset:
        fixed = model_asset["set_by_the_model"]
        for path, layer in walk(model):
            object.__setattr__(layer, AUTHOR, tuple(fixed[path]) if path in fixed else None)
    optimizer = getattr(model, "optimizer", None)
    if (optimizer_asset is not None and isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            and not isinstance(optimizer, LossScaleOptimizer)):
        stored = optimizer_asset.get("policy")
        _adopt(model, optimizer, optimizer_asset, Policy.from_dict(stored) if stored is not None else None)
    if policy is None:
        policy = getattr(getattr(model, "optimizer", None), "policy", None)
    if policy is not None:
        apply(model, policy, warn=False)
    return model

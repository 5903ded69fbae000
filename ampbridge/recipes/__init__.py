"""Porting recipes: read other tools' AMP settings into a Policy, and write a Policy back out.

Each format has a ``from_X`` (its settings -> :class:`~ampbridge.Policy`, or a
:class:`~ampbridge.LossScaleConfig` for the loss-scale-only formats) and a ``to_X`` (policy ->
the tool's own settings as plain data). Every one returns a :class:`Conversion`: the ``result``
plus ``losses``, each setting the target cannot express, by name and with the reason, so a
conversion never drops a setting silently. ``notes`` record mappings that are exact but not
obvious (Flax's growth interval is one step longer than ampbridge's) and values filled in
because the source says nothing.

==============  ===========================================  =====================================
format          read                                         write
==============  ===========================================  =====================================
deepspeed       ``from_deepspeed(config_dict)``               ``to_deepspeed(policy)`` -> dict
accelerate      ``from_accelerate(config_dict)``              ``to_accelerate(policy)`` -> dict
lightning       ``from_lightning("bf16-mixed")``              ``to_lightning(policy)`` -> dict
keras           ``from_keras("mixed_float16")``               ``to_keras(policy)`` -> dict
tf_keras        ``from_tf_keras("mixed_float16")``            ``to_tf_keras(policy)`` -> dict
jmp             ``from_jmp("p=f32,c=bf16,o=f32")``            ``to_jmp(policy)`` -> str
grad-scaler     ``from_grad_scaler(state_dict_or_kwargs)``    ``to_grad_scaler(policy)`` -> dict
flax            ``from_flax(dynamic_scale_kwargs)``           ``to_flax(policy)`` -> dict | None
fsdp            (write only)                                 ``to_fsdp(policy, plan=None)`` -> dict
optax           ``from_optax(apply_if_finite_kwargs)``        ``to_optax(policy)`` -> dict | None
te (FP8)        ``from_transformer_engine(recipe_args)``      ``to_transformer_engine(policy)`` -> dict
torchao (FP8)   ``from_torchao(Float8LinearConfig | dict)``   ``to_torchao(policy)`` -> dict
==============  ===========================================  =====================================

``load(path)`` / ``loads(text)`` read a file or text and detect its format; ``ampbridge convert`` goes
from any readable format to any writable one; ``disagreements`` compares a policy with another
tool's settings (what ``ampbridge check`` prints). This package is framework-free: it reads and
writes plain dicts, JSON, YAML and strings, and imports no framework (``keras.py``, ``flax.py`` ...
here are the converters for those tools' settings, not the tools).

Layout: ``convert`` holds what every converter shares (Loss, Conversion, the reading and writing
helpers, loss_scale_view, differences); one module per tool (``deepspeed``, ``apex``,
``accelerate``, ``lightning``, ``keras``, ``tf_keras``, ``jmp``, ``grad_scaler``, ``flax``, ``optax``, ``fsdp``);
``formats`` the format-generic entry points (detect, read, write, loads, load); ``compare``
disagreements.

Example:
    >>> from ampbridge import recipes
    >>> c = recipes.from_lightning("bf16-mixed", api="fabric")
    >>> c.result.compute_dtype, c.result.param_dtype, c.losses
    ('bfloat16', 'float32', ())
    >>> recipes.to_lightning(c.result).result
    {'precision': 'bf16-mixed', 'grad_scaler': None}
"""

from __future__ import annotations

from ..core.policy import LossScaleConfig  # noqa: F401  (the docstring examples use it, as before the split)
from .accelerate import from_accelerate, to_accelerate
from .compare import disagreements
from .convert import (
    POLICY_FIELDS,  # noqa: F401  (public outside __all__, as before the split)
    Conversion,
    Disagreement,
    Loss,
    differences,
    loss_scale_view,
)
from .deepspeed import (
    DEEPSPEED_RELEASES,  # noqa: F401  (public outside __all__, as before the split)
    DEEPSPEED_VERSION,  # noqa: F401
    from_deepspeed,
    to_deepspeed,
)
from .flax import from_flax, to_flax
from .formats import (
    READ_FORMATS,
    WRITE_FORMATS,
    detect,
    load,
    loads,
    read,
    write,
)
from .fp8 import from_torchao, from_transformer_engine, to_torchao, to_transformer_engine
from .fsdp import to_fsdp
from .grad_scaler import from_grad_scaler, to_grad_scaler
from .jmp import from_jmp, to_jmp
from .keras import from_keras, from_keras_loss_scale_optimizer, to_keras
from .lightning import from_lightning, to_lightning
from .optax import from_optax, to_optax
from .tf_keras import from_tf_keras, from_tf_keras_loss_scale_optimizer, to_tf_keras

__all__ = [
    "Loss",
    "Conversion",
    "Disagreement",
    "READ_FORMATS",
    "WRITE_FORMATS",
    "from_deepspeed",
    "to_deepspeed",
    "from_accelerate",
    "to_accelerate",
    "from_lightning",
    "to_lightning",
    "from_keras",
    "from_keras_loss_scale_optimizer",
    "to_keras",
    "from_tf_keras",
    "from_tf_keras_loss_scale_optimizer",
    "to_tf_keras",
    "from_jmp",
    "to_jmp",
    "from_grad_scaler",
    "to_grad_scaler",
    "from_flax",
    "to_flax",
    "from_optax",
    "to_optax",
    "to_fsdp",
    "from_transformer_engine",
    "to_transformer_engine",
    "from_torchao",
    "to_torchao",
    "detect",
    "load",
    "loads",
    "read",
    "write",
    "disagreements",
    "differences",
    "loss_scale_view",
]

#: doctest.testmod(ampbridge.recipes) runs the examples of the converters the package re-exports
__test__ = {name: globals()[name] for name in __all__ if callable(globals()[name])}

"""PyTorch backend: ``apply(model, policy)`` realises the Plan with torch's own machinery (autocast,
a pinned region per ruled module, in-place parameter storage, a ``GradScaler`` that follows the
core's loss-scale algorithm); ``plan``, ``Monitor``, phases and FSDP policies come with it.

Example:
    >>> import torch, ampbridge
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    >>> amp = ampbridge.torch.apply(model, ampbridge.preset("mixed_bfloat16").replace(keep_float32=("kind:norm",)))
    >>> amp.plan["0"].compute_dtype, amp.plan["1"].compute_dtype, model(torch.ones(2, 4)).dtype
    ('bfloat16', 'float32', torch.float32)
"""

from ..common import doctests, import_framework

import_framework("torch", "torch")

# the rooms, in layers: environment -> layers -> forward -> plan -> monitor -> loss_scale -> schedule
# -> trace -> apply -> distributed -> trainers -> tune (the room modules apply, plan, trace and layers are shadowed
# here by the functions of those names: reach them as ``from ampbridge.backends.torch.plan import ...``)
from .apply import ModelNotSupportedError, TorchAmp, apply  # noqa: E402
from .distributed import FSDPPrecision, deepspeed_initialize, fsdp_policy, wrap_ddp, wrap_fsdp  # noqa: E402
from .environment import cpu_lstm_takes_float32_inputs, native_dtype  # noqa: E402
from .layers import kind_and_source, kind_of, layers, owns, register_kind  # noqa: E402
from .loss_scale import GradScaler, StepResult  # noqa: E402
from .monitor import Monitor  # noqa: E402
from .plan import plan  # noqa: E402
from .trace import trace  # noqa: E402
from .trainers import HFTrainerMixin, fabric_precision, hf_trainer, lightning_precision  # noqa: E402
from .tune import tune  # noqa: E402

__all__ = [
    "FSDPPrecision",
    "GradScaler",
    "HFTrainerMixin",
    "ModelNotSupportedError",
    "Monitor",
    "StepResult",
    "TorchAmp",
    "apply",
    "cpu_lstm_takes_float32_inputs",
    "deepspeed_initialize",
    "fabric_precision",
    "fsdp_policy",
    "hf_trainer",
    "kind_and_source",
    "kind_of",
    "layers",
    "lightning_precision",
    "native_dtype",
    "owns",
    "plan",
    "register_kind",
    "trace",
    "tune",
    "wrap_ddp",
    "wrap_fsdp",
]

__test__ = doctests(globals())  # the rooms' examples, for doctest.testmod(ampbridge.torch)

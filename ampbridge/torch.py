"""``ampbridge.torch``, the PyTorch backend: ``apply``, ``plan``, ``GradScaler``, ``Monitor``, ``fsdp_policy``,
and the trainers' integrations ``hf_trainer``, ``lightning_precision``, ``fabric_precision``.

The implementation lives in ampbridge/backends/torch/ (one module per job; see its ``__init__``).
"""

from .backends.torch import *  # noqa: F403
from .backends.torch import __all__, __test__  # noqa: F401

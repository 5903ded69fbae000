"""Shared test set-up: torch before tensorflow (known import-order crashes), TF32 off."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

if importlib.util.find_spec("torch") is not None and not os.environ.get("AMPBRIDGE_NO_TORCH_FIRST"):
    import torch  # noqa: F401  (imported first on purpose)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

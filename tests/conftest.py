"""Shared test set-up: torch before tensorflow (known import-order crashes), TF32 off."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
# one OpenMP thread for torch (read when torch loads; subprocesses inherit it): the test models are
# tiny, and two OpenMP workers spin for the CPU a busy 2-core machine's other processes need (the
# conformance suite's torch runs took 11.5 s of CPU with two threads, 1.3 s with one; Keras and
# JAX compile-bound runs did not change with their thread pools, so those are left alone)
os.environ.setdefault("OMP_NUM_THREADS", "1")

if importlib.util.find_spec("torch") is not None and not os.environ.get("AMPBRIDGE_NO_TORCH_FIRST"):
    import torch  # noqa: F401  (imported first on purpose)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


import pytest  # noqa: E402

# tf.keras 2 needs TF_USE_LEGACY_KERAS=1 before TensorFlow resolves tf.keras: its tests run in their own
# process (make test-all: TF_USE_LEGACY_KERAS=1 pytest tests/backend_tf_keras), not beside Keras 3's
collect_ignore = [] if os.environ.get("TF_USE_LEGACY_KERAS") == "1" else ["backend_tf_keras"]


@pytest.fixture(autouse=True)
def _plan_warnings_unsaid():
    """Each test starts as a fresh process would: no unmatched-rule warning said yet (build_plan says
    each once per policy and model; tests/core/test_kinds.py checks that)."""
    from ampbridge.core import plan

    plan._SAID.clear()
    yield

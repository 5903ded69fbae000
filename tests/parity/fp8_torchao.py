"""torchao as the reference of FP8 current scaling, for the parity tests of ampbridge's own current-scaling
code (Flax's CurrentScalingDotGeneral, Keras's CurrentScalingCall): torchao's cast of a tensor, the
bit-level comparisons, and the fixed cases around torchao's float64 1e-12 floor. Import it after
``require("torch")`` and ``require("torchao.float8")``."""

import numpy as np
import torch
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import LinearMMConfig, hp_tensor_and_scale_to_float8

# float32(1e-12) is below torchao's float64 1e-12 floor: the next float32 is the first amax not floored
EPS32 = np.nextafter(np.float32(1e-12), np.float32(1))
TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
ML_DTYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}

#: (id, tensor): the fixed cases every implementation's scale and float8 bits are held to
CASES = (
    ("ramp", np.linspace(-3, 5, 24).reshape(4, 6)), ("zeros", np.zeros((3, 2))),
    ("subnormal", np.array([1e-40, -2e-39, 0.0])), ("huge", np.array([3e38, -1.0, 7.0])),
    ("inf", np.array([np.inf, 1.0, -2.0])), ("nan", np.array([np.nan, 1.0])),
    ("normal", np.random.default_rng(0).normal(size=(8, 16)) * 1e4), ("floor", np.array([EPS32, -0.5e-12])),
    ("below-floor", np.array([np.nextafter(EPS32, np.float32(0)), 1e-13])), ("above-floor", np.array([1.5e-12, 0.0])),
    ("under-floor", np.array([1e-13, -5e-14])),
)


def torchao_cast(x, fmt, scale=None):
    """torchao's float8 of ``x`` (its own scale, or ``scale``): (scale, the float8 bits)."""
    t = torch.from_numpy(np.array(x, np.float32))
    if scale is None:
        f8 = hp_tensor_to_float8_dynamic(t, TORCH_FP8[fmt], LinearMMConfig())
    else:
        f8 = hp_tensor_and_scale_to_float8(t, torch.tensor(scale, dtype=torch.float32), TORCH_FP8[fmt])
    return f8._scale.numpy(), f8._data.view(torch.uint8).numpy()


def assert_same_scale(got, want):
    """The same float32 bits, or both NaN (payloads differ between XLA and torch)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not (np.isnan(got) and np.isnan(want)):
        assert got.view(np.uint32) == want.view(np.uint32), (got, want)


def assert_same_float8(got, want, fmt):
    """The same float8 bits; a NaN is any NaN (inf * 0 is NaN with another payload in XLA)."""
    import ml_dtypes

    f8 = getattr(ml_dtypes, ML_DTYPES[fmt])
    nan = np.isnan(got.view(f8).astype(np.float32))
    np.testing.assert_array_equal(nan, np.isnan(want.view(f8).astype(np.float32)))
    np.testing.assert_array_equal(np.where(nan, 0, got), np.where(nan, 0, want))

import math

import pytest

import ampbridge
from ampbridge._testing import require


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
def test_format_facts_match_ml_dtypes(name):
    ml_dtypes = require("ml_dtypes")
    np = require("numpy")
    dtype = getattr(np, name) if name in ("float32", "float16") else getattr(ml_dtypes, name)
    info = ml_dtypes.finfo(dtype)
    fmt = ampbridge.formats()[name]
    assert fmt.bits == info.bits
    assert fmt.mantissa_bits == info.nmant
    assert fmt.exponent_bits == info.nexp
    assert fmt.max == float(info.max)
    assert fmt.smallest_normal == float(info.smallest_normal)
    assert fmt.smallest_subnormal == float(info.smallest_subnormal)
    assert fmt.eps == float(info.eps)


def test_tfloat32_facts():
    f = ampbridge.formats()["tfloat32"]
    assert (f.bits, f.storage_bits, f.exponent_bits, f.mantissa_bits) == (19, 32, 8, 10)
    assert f.eps == 2.0**-10
    assert f.smallest_normal == ampbridge.formats()["float32"].smallest_normal
    assert f.max == math.ldexp(2 - 2**-10, 127)


def test_finite_only_format_has_no_inf():
    assert not ampbridge.formats()["float8_e4m3fn"].has_inf
    assert ampbridge.formats()["float8_e5m2"].has_inf


@pytest.mark.parametrize("alias,canonical", [
    ("fp16", "float16"), ("half", "float16"), ("f16", "float16"), ("FP16", "float16"),
    ("bf16", "bfloat16"), ("fp32", "float32"), ("f32", "float32"), ("float", "float32"),
    ("single", "float32"), ("float32", "float32"),
])
def test_aliases(alias, canonical):
    assert ampbridge.canonical_dtype(alias) == canonical


def test_unknown_dtype_lists_accepted():
    with pytest.raises(ValueError, match="accepted: float32, bfloat16, float16"):
        ampbridge.canonical_dtype("float64")
    assert ampbridge.canonical_dtype("auto", allow_auto=True) == "auto"

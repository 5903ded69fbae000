"""FP8 delayed-scaling conformance: one scripted amax sequence, every framework's own state machinery.

The loss-scale conformance approach applied to FP8 scales. Each sequence (zeros first, a spike, inf,
NaN, a subnormal, a history that forgets the spike) is fed as the input amax of one float8 layer:

- Keras: a ``Dense`` quantized by Keras's own ``layer.quantize("float8")`` (history length from its
  ``QuantizedFloat8DTypePolicy``), trained by ``model.train_on_batch`` so the optimizer writes the
  ``overwrite_with_gradient`` scale and history variables, as in real training;
- Flax: ``nn.Dense(dot_general_cls=Fp8DirectDotGeneralOp)``, the ``_overwrite_with_gradient``
  collection replaced by its gradient, as ``TrainState.apply_gradients`` does;
- torch: ampbridge's own ``DelayedFloat8Linear`` (torchao has no delayed scaling), trained by
  ``loss.backward()`` (it computes with float32 subnormals, as Keras on its torch backend);
- the reference, :mod:`ampbridge.core.fp8`.

The divisor and history after every step are identical across the three (the single-step functions
are compared in tests/backend_*/test_fp8.py over random inputs; here whole trajectories through the
layers). The frameworks differ in which divisor quantizes a step, and the test shows it on the
layers' outputs: Keras quantizes step t with the divisor stored after step t-1, Flax with the one it
computes at step t. So in a real model, where the next layer's amax depends on this one's output,
the amaxes (and then the scales) part after the first step that has a history.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ampbridge._testing import require
from ampbridge.core.fp8 import delayed_trajectory

torch = require("torch")  # before TensorFlow (Keras's tensorflow backend)
from ampbridge.backends.torch.fp8_delayed import DelayedFloat8Linear, qdq as torch_qdq  # noqa: E402

np = require("numpy")
keras = require("keras")
jax = require("jax")
require("flax")
ml_dtypes = require("ml_dtypes")
import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf/NaN steps overflow on purpose
HISTORY = 4
SEQUENCES = {
    "zeros-then-values": [0.0, 0.0, 1.0, 2.0, 3.0, 0.5, 0.25, 0.125],
    "spike-forgotten": [1.0, 1000.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    "inf": [2.0, math.inf, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
    "nan": [2.0, math.nan, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0],
    "tiny": [1e-45, 1e-30, 5.0, 1e30, 1.0, 1.0, 1.0, 1.0],
}


def _same(a, b) -> bool:
    a, b = np.float32(a), np.float32(b)
    return bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def keras_run(seq):
    """(divisor, history, output) after each step of a Keras float8 Dense(1) whose input amax is ``seq[t]``."""
    inp = keras.Input((1,))
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", dtype="float32")
    model = keras.Model(inp, dense(inp))
    dense.dtype_policy = keras.dtype_policies.QuantizedFloat8DTypePolicy("float8", "float32",
                                                                          amax_history_length=HISTORY)
    dense.kernel.trainable = False  # only the float8 state moves: an inf step cannot poison the kernel
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    out = []
    for a in seq:
        x = np.float32([[a]])
        y = keras.ops.convert_to_numpy(dense(x, training=True))  # this step's quantization (no state written)
        model.train_on_batch(x, np.float32([[0.0]]))
        out.append((float(keras.ops.convert_to_numpy(dense.inputs_scale)),
                    tuple(keras.ops.convert_to_numpy(dense.inputs_amax_history).tolist()), float(y[0, 0])))
    return out


def flax_run(seq):
    """The same through Flax's fp8_ops: the new state is the gradient of the overwrite collection."""
    layer = nn.Dense(1, use_bias=False, kernel_init=nn.initializers.ones,
                     dot_general_cls=lambda: fp8_ops.Fp8DirectDotGeneralOp(amax_history_length=HISTORY))
    variables = layer.init(jax.random.key(0), jnp.ones((1, 1), jnp.float32))
    key = fp8_ops.OVERWRITE_WITH_GRADIENT

    @jax.jit
    def step(v, x):
        y, grads = jax.value_and_grad(lambda v: layer.apply(v, x).sum())(v)
        return {**v, key: grads[key]}, y

    out = []
    for a in seq:
        variables, y = step(variables, jnp.float32([[a]]))
        meta = variables[key]["Fp8DirectDotGeneralOp_0"]
        out.append((float(meta["input_scale"][0]), tuple(np.asarray(meta["input_amax_history"]).tolist()), float(y)))
    return out


def torch_run(seq):
    """The same through torch's DelayedFloat8Linear(1, 1) (weight 1): (divisor, history, output) after each step."""
    lin = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1.0)
    layer = DelayedFloat8Linear.from_linear(lin, amax_history=HISTORY)
    layer.weight.requires_grad_(False)
    out = []
    for a in seq:
        y = layer(torch.tensor([[a]], requires_grad=True))
        y.sum().backward()
        out.append((layer.input_divisor.item(), tuple(layer.input_amax_history.tolist()), y.item(),
                    layer.weight_divisor.item()))
    return out


def flax_qdq(x, divisor, dtype=jnp.float8_e4m3fn):
    """Flax's own float8 round trip (``fp8_ops.qdq``, float32 compute)."""
    return np.float32(fp8_ops.qdq(jnp.float32(x), dtype, jnp.float32(divisor), jnp.float32))


def qdq(x: float, divisor: float) -> float:
    """x through a float8_e4m3fn cast at ``divisor`` and back (saturating, as Keras and Flax clip)."""
    q = np.clip(np.float32(x) / np.float32(divisor), -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
    return float(q.astype(np.float32) * np.float32(divisor))


@pytest.fixture(scope="module")
def runs():
    return {name: (keras_run(seq), flax_run(seq), delayed_trajectory(seq, "e4m3", HISTORY), torch_run(seq))
            for name, seq in SEQUENCES.items()}


#: Keras on torch computes with float32 subnormals; XLA and TF (Flax, Keras on JAX/TF) flush them to zero
KERAS_FLUSHES = keras.backend.backend() != "torch"


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_divisor_and_history_trajectories_are_identical(runs, name):
    k, f, ref, _ = runs[name]
    ref_keras = ref if KERAS_FLUSHES else delayed_trajectory(SEQUENCES[name], "e4m3", HISTORY, flush_denormals=False)
    for t, (kk, ff, rr, rk) in enumerate(zip(k, f, ref, ref_keras)):
        assert _same(ff[0], rr.divisor) and _same(ff[1], rr.history), (name, t, ff, rr)
        assert _same(kk[0], rk.divisor) and _same(kk[1], rk.history), (name, t, kk, rk)
    same = all(_same(a.divisor, b.divisor) for a, b in zip(ref, ref_keras))
    assert same == (KERAS_FLUSHES or name != "tiny")  # only a subnormal amax parts Keras-on-torch from XLA


@pytest.mark.parametrize("name", ["zeros-then-values", "spike-forgotten", "tiny"])
def test_keras_quantizes_with_the_previous_divisor_flax_with_the_updated_one(runs, name):
    k, f, ref, _ = runs[name]
    seq = SEQUENCES[name]
    divisors = [1.0] + [r.divisor for r in ref]  # divisors[t]: stored before step t; divisors[t + 1]: after it
    ref_keras = ref if KERAS_FLUSHES else delayed_trajectory(seq, "e4m3", HISTORY, flush_denormals=False)
    keras_divisors = [1.0] + [r.divisor for r in ref_keras]
    parted = 0
    # (Flax multiplies the float8 product by both divisors after the dot, Keras dequantizes each operand
    # first: the same value up to a float32 rounding; which divisor was used changes it by far more)
    for t, a in enumerate(seq):
        assert np.isclose(k[t][2], qdq(a, keras_divisors[t]), rtol=1e-6, atol=0), (name, t)  # Keras: the previous
        assert np.isclose(f[t][2], qdq(a, divisors[t + 1]), rtol=1e-6, atol=0), (name, t)  # Flax: this step's
        parted += not np.isclose(k[t][2], f[t][2], rtol=1e-3)
    assert parted  # the outputs differ: a next layer would see different amaxes


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_torch_delayed_trajectories_are_the_references(runs, name):
    """torch computes with subnormals: identical to core.fp8 with flush_denormals=False, and so to Flax
    on every sequence but the subnormal one."""
    _, f, ref, tt = runs[name]
    ref_torch = delayed_trajectory(SEQUENCES[name], "e4m3", HISTORY, flush_denormals=False)
    flax_same = []
    for t, (ff, rr, tr) in enumerate(zip(f, ref_torch, tt)):
        assert _same(tr[0], rr.divisor) and _same(tr[1], rr.history), (name, t, tr, rr)
        flax_same.append(_same(tr[0], ff[0]) and _same(tr[1], ff[1]))
    assert all(flax_same) == (name != "tiny")


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_torch_quantizes_step_t_with_the_divisor_of_step_t_as_flax(runs, name):
    """The output of step t is Flax's float8 round trip of the input at the divisor computed at step t
    (times the weight's, 1 through float8), bit for bit; and Flax's own output up to the order of its
    float32 products (Flax scales the float8 product by both divisors after the dot)."""
    _, f, _, tt = runs[name]
    divisors = [1.0] + [r[0] for r in tt]
    for t, a in enumerate(SEQUENCES[name]):
        x = flax_qdq(a, divisors[t + 1])
        w = flax_qdq(1.0, tt[t][3])
        assert _same(tt[t][2], np.float32(x * w)), (name, t, tt[t][2], x, w)
        if name != "tiny":
            assert np.isclose(tt[t][2], f[t][2], rtol=1e-6, atol=0, equal_nan=True), (name, t, tt[t][2], f[t][2])
    assert not all(_same(tt[t][2], np.float32(flax_qdq(a, divisors[t]) * flax_qdq(1.0, tt[t][3])))
                   for t, a in enumerate(SEQUENCES[name]))  # the previous step's divisor gives other values


@settings(max_examples=150, deadline=None)
@given(st.floats(-3.4028234663852886e38, 3.4028234663852886e38, width=32) | st.sampled_from([0.0, math.inf, -math.inf, math.nan, 1e-3, 6e4]),
       st.floats(2.0 ** -100, 2.0 ** 100, width=32), st.sampled_from(["e4m3", "e5m2"]))
def test_torchs_float8_round_trip_is_flaxs(x, divisor, fmt):
    dtypes = {"e4m3": (torch.float8_e4m3fn, jnp.float8_e4m3fn), "e5m2": (torch.float8_e5m2, jnp.float8_e5m2)}
    mine = torch_qdq(torch.tensor([x]), torch.tensor(divisor), dtypes[fmt][0]).item()
    assert _same(mine, flax_qdq(x, divisor, dtypes[fmt][1])), (x, divisor, fmt)

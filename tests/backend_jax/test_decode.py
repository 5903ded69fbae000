"""Autoregressive decoding with KV caches under a policy, linen and NNX: the cache keeps the dtype its
module writes into it, greedy decoding runs, and each step's logits match the full forward pass.

The linen model is a small decoder in the style of Flax's lm1b/WMT examples (token embedding,
positional embedding with its own ``cache_index`` in decode mode, pre-norm blocks of Flax's own
``MultiHeadDotProductAttention(decode=...)`` and an MLP, logits through the embedding's ``attend``).
The NNX model is the same with ``nnx.MultiHeadAttention`` (caches made by Flax's ``init_cache``,
whose dtype defaults to float32) and explicit positions, as Gemma passes them.

The bound. The decode step and the full (causal) pass do the same operations, in the same dtypes,
on the same values: a row of a matmul is the same dot product whether the matmul has 1 row or 8,
and the masked positions contribute exact zeros (exp of Flax's large negative mask underflows).
What may differ is the order XLA accumulates a dot product in for a matrix of another shape
(float32 accumulation), which can flip the last bit of a value once it is rounded to the compute
dtype. One such flip, carried through the few layers that follow (each with gain of order one),
stays within a few units in the last place of the compute dtype relative to the logits' scale. So
|logits_decode - logits_full| <= 8 * eps(compute) * max(1, max|logits_full|), eps = 2^-23 (float32),
2^-10 (float16), 2^-7 (bfloat16); 8 ulps leave room for two flips in each of the model's layers
before the logits while staying far below a wrong-position or wrong-cache error (those move logits
by order 0.1-1: the test with a position off by one shows it). Measured on this CPU: 0 in bfloat16
and float16 (every step), 3.8e-6 in float32 at the first step, 7.6e-6 over all eight (bound 2e-5).
"""

from __future__ import annotations

from ampbridge._testing import require

jax = require("jax")
nn = require("flax.linen")
nnx = require("flax.nnx")
require("optax")

import functools  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ampbridge  # noqa: E402
import ampbridge.jax as abj  # noqa: E402

VOCAB, DIM, HEADS, LAYERS, MAX_LEN, BATCH, STEPS = 24, 32, 2, 2, 8, 2, 8
POLICIES = {
    "float32": ampbridge.preset("float32"),
    "bfloat16": ampbridge.preset("mixed_bfloat16"),
    "float16": ampbridge.preset("mixed_float16"),
}
EPS = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def bound(name: str, full: np.ndarray) -> float:
    return 8 * EPS[name] * max(1.0, float(np.max(np.abs(full))))


# --- linen: lm1b-style ------------------------------------------------------------------------

class AddPositionEmbs(nn.Module):
    """lm1b's positional embedding: in decode mode one position per call, from its own cache index."""

    decode: bool = False

    @nn.compact
    def __call__(self, x):
        pe = self.param("pos_embedding", nn.initializers.normal(0.02), (1, MAX_LEN, x.shape[-1]))
        if self.decode:
            is_initialized = self.has_variable("cache", "cache_index")
            index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
            if is_initialized:
                i = index.value
                index.value = i + 1
                return x + jax.lax.dynamic_slice(pe, (0, i, 0), (1, 1, x.shape[-1]))
        return x + pe[:, : x.shape[1]]


class DecoderBlock(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, x, mask):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=self.decode, deterministic=True)(y, mask=mask)
        x = x + y
        y = nn.LayerNorm()(x)
        y = nn.Dense(DIM)(nn.gelu(nn.Dense(2 * DIM)(y)))
        return x + y


class Decoder(nn.Module):
    decode: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, DIM, embedding_init=nn.initializers.normal(1.0))
        x = AddPositionEmbs(decode=self.decode)(embed(tokens))
        mask = None if self.decode else nn.make_causal_mask(tokens)  # decode: the cache masks
        for i in range(LAYERS):
            x = DecoderBlock(decode=self.decode, name=f"block_{i}")(x, mask)
        return embed.attend(nn.LayerNorm()(x))


@functools.lru_cache(maxsize=None)
def linen_decode(name: str):
    policy = POLICIES[name]
    full = abj.apply(Decoder(), policy)
    dec = abj.apply(Decoder(decode=True), policy)
    prompt = jnp.zeros((BATCH, MAX_LEN), jnp.int32)
    # lm1b inits the decode model with the full shape for its "cache"; the same init gives the params,
    # bit for bit those of full.init (the same modules, names and key), so one init is compiled, not two
    variables = jax.jit(dec.init)(jax.random.key(0), prompt)
    params, cache = variables["params"], variables["cache"]

    @jax.jit
    def step(cache, token):
        logits, state = dec.apply({"params": params, "cache": cache}, token, mutable=["cache"])
        return logits[:, -1], state["cache"]

    token = jnp.array([[1], [2]], jnp.int32)  # a start token per row
    tokens, step_logits, caches = [token], [], []
    for _ in range(STEPS):
        logits, cache = step(cache, token)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
        tokens.append(token)
        step_logits.append(logits)
        caches.append(cache)
    seq = jnp.concatenate(tokens[:STEPS], axis=1)  # what each step saw, teacher-forced at once
    full_pass = jax.jit(lambda p, s: full.apply({"params": p}, s))
    reference = full_pass(params, seq)
    return np.stack([np.asarray(x) for x in step_logits], 1), np.asarray(reference), caches, full_pass, params, seq


def cache_dtypes(cache) -> set[str]:
    return {str(x.dtype) for x in jax.tree_util.tree_leaves(cache) if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.mark.parametrize("name", list(POLICIES))
def test_linen_greedy_decoding_matches_the_full_pass(name):
    step_logits, reference, caches, *_ = linen_decode(name)
    compute = POLICIES[name].compute_dtype
    # the cache holds what attention writes into it: the keys and values in the compute dtype,
    # the same dtype after every step (a stable carry); the index stays an integer
    for cache in caches:
        assert cache_dtypes(cache) == {compute}
    assert int(caches[-1]["block_0"]["MultiHeadDotProductAttention_0"]["cache_index"]) == STEPS
    assert step_logits.shape == (BATCH, STEPS, VOCAB) and step_logits.dtype == np.float32
    assert np.all(np.isfinite(step_logits))
    first_err = float(np.max(np.abs(step_logits[:, 0] - reference[:, 0])))
    assert first_err <= bound(name, reference[:, 0]), (name, first_err)
    all_err = float(np.max(np.abs(step_logits - reference)))
    assert all_err <= bound(name, reference), (name, all_err)


def test_a_position_off_by_one_is_caught_by_the_bound():
    """The bound can fail: the logits of a token at the wrong position (a cache index off by one)
    differ from the right ones by far more than it allows."""
    _, reference, _, full_pass, params, seq = linen_decode("float32")
    shifted = np.asarray(full_pass(params, seq[:, 1:]))  # each token one position early
    assert float(np.max(np.abs(shifted[:, 0] - reference[:, 1]))) > 100 * bound("float32", reference)


def test_linen_batch_stats_and_cache_keep_their_dtypes_under_bfloat16_params():
    """The rule in one place: batch_stats (Flax makes float32) and a cache (made from bf16 keys)."""
    class Net(nn.Module):
        decode: bool = True

        @nn.compact
        def __call__(self, x, train: bool = True):
            x = nn.BatchNorm(use_running_average=not train)(nn.Dense(DIM)(x))
            return nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=self.decode)(x)

    amp = abj.apply(Net(), ampbridge.preset("bfloat16"))  # params bf16 too
    x = jnp.ones((BATCH, MAX_LEN, 4))
    variables = amp.init(jax.random.key(0), x)
    assert cache_dtypes(variables["batch_stats"]) == {"float32"}
    assert cache_dtypes(variables["cache"]) == {"bfloat16"}
    out, state = amp.apply(variables, x[:, :1], mutable=["batch_stats", "cache"])
    assert cache_dtypes(state["batch_stats"]) == {"float32"} and cache_dtypes(state["cache"]) == {"bfloat16"}
    assert out.dtype == jnp.bfloat16  # this preset's output_dtype


# --- NNX ----------------------------------------------------------------------------------------

def einsum_attention(query, key, value, *, mask=None, dtype=None, precision=None, **_):
    """NNX's own slow path (weights, then an einsum). Its fast path, ``jax.nn.dot_product_attention``,
    fails under jit on CPU in float16 whatever ampbridge does (JAX 0.10: "The precision
    'F16_F16_F32' is not supported by dot_general on CPU"); on GPU the default works."""
    from flax.nnx.nn.attention import dot_product_attention_weights

    weights = dot_product_attention_weights(query, key, mask=mask, dtype=dtype, precision=precision)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision)


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, DIM, decode=False, deterministic=True,
                                           attention_fn=einsum_attention, rngs=rngs)
        self.norm2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 2 * DIM, rngs=rngs)
        self.down = nnx.Linear(2 * DIM, DIM, rngs=rngs)

    def __call__(self, x, mask, decode):
        x = x + self.attn(self.norm1(x), mask=mask, decode=decode)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class NnxDecoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (MAX_LEN, DIM)))
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)

    def init_cache(self, batch: int):
        for block in self.blocks:
            block.attn.init_cache((batch, MAX_LEN, DIM))  # Flax's default cache dtype: float32

    def __call__(self, tokens, positions, decode: bool = False):
        x = self.embed(tokens) + self.pos[...][positions]
        mask = None if decode else nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask, decode)
        return self.embed.attend(self.norm(x))


@pytest.mark.parametrize("name", list(POLICIES))
def test_nnx_greedy_decoding_matches_the_full_pass(name):
    model = abj.apply(NnxDecoder(nnx.Rngs(0)), POLICIES[name])
    compute = POLICIES[name].compute_dtype
    model.init_cache(BATCH)
    attn = model.blocks[0].attn
    assert attn.cached_key[...].dtype == compute  # init_cache made float32; the decode-cache rule cast it

    @nnx.jit
    def step(model, token, position):
        return model(token, position, decode=True)[:, -1]

    token = jnp.array([[1], [2]], jnp.int32)
    tokens, step_logits = [token], []
    for i in range(STEPS):
        logits = step(model, token, jnp.full((BATCH, 1), i, jnp.int32))
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
        tokens.append(token)
        step_logits.append(np.asarray(logits))
        assert attn.cached_key[...].dtype == compute and attn.cache_index[...].dtype == jnp.int32
    assert int(attn.cache_index[...]) == STEPS
    step_logits = np.stack(step_logits, 1)
    assert step_logits.dtype == np.float32 and np.all(np.isfinite(step_logits))
    seq = jnp.concatenate(tokens[:STEPS], axis=1)
    reference = np.asarray(nnx.jit(lambda m, s: m(s, jnp.arange(STEPS)[None].repeat(BATCH, 0)))(model, seq))
    first_err = float(np.max(np.abs(step_logits[:, 0] - reference[:, 0])))
    assert first_err <= bound(name, reference[:, 0]), (name, first_err)
    assert float(np.max(np.abs(step_logits - reference))) <= bound(name, reference)


def test_nnx_methods_other_than_call_follow_their_rows():
    """Embed.attend and a model's own encode/decode run in their rows' dtypes, as __call__ does."""
    seen = []

    class Codec(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.full((DIM, DIM), 0.1))
            self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)

        def encode(self, x):
            seen.append(("encode", str(x.dtype), str(self.w[...].dtype)))
            return x @ self.w[...]

        def decode(self, h):
            return self.embed.attend(h)

        def __call__(self, tokens):
            return self.decode(self.encode(self.embed(tokens)))

    policy = ampbridge.Policy(compute_dtype="bfloat16", keep_float32=("embed",))
    model = abj.apply(Codec(nnx.Rngs(0)), policy)
    h = model.encode(jnp.ones((2, DIM), jnp.float32))
    assert seen[-1] == ("encode", "bfloat16", "bfloat16") and h.dtype == jnp.float32  # the root: output_dtype
    assert model.w[...].dtype == jnp.float32  # the stored parameter is left as it was
    logits = model.embed.attend(jnp.ones((2, DIM), jnp.bfloat16))  # pinned: the query arrives float32
    assert logits.dtype == jnp.float32
    assert model.decode(h).dtype == jnp.float32
    seen.clear()
    out = model(jnp.array([1, 2]))  # __call__ -> encode (the same module: cast once, by the outer call)
    assert seen == [("encode", "bfloat16", "bfloat16")] and out.dtype == jnp.float32
    unapplied = Codec(nnx.Rngs(0))
    unapplied.encode(jnp.ones((2, DIM)))
    assert seen[-1] == ("encode", "float32", "float32")  # the original module is untouched

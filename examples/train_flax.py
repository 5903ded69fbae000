"""Train a small Flax (linen) model with optax under examples/amp.toml.

    python examples/train_flax.py [--steps N] [--policy FILE]
"""

import argparse
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import ampbridge
import ampbridge.jax as abj


class Model(nn.Module):
    vocab: int = 64
    dim: int = 64

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.dim, name="embed")(tokens)
        h = nn.Dense(self.dim, name="mlp_out")(nn.relu(nn.Dense(4 * self.dim, name="mlp_in")(nn.LayerNorm(name="norm")(x))))
        return nn.Dense(self.vocab, name="head")(x + h)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--policy", default=Path(__file__).with_name("amp.toml"))
    args = parser.parse_args()

    policy = ampbridge.load(args.policy)
    amp = abj.apply(Model(), policy)                         # every module in its Plan row's dtype
    x = jnp.zeros((32, 16), jnp.int32)
    params = amp.init(jax.random.key(0), x)["params"]
    print(amp.plan(x))
    tx = abj.optimizer(optax.adamw(3e-3), policy)            # the policy's loss scaling, inside jit
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x):
        def loss_fn(p):
            logits = amp.apply({"params": p}, x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, (x + 1) % 64).mean()
            return abj.scale_loss(loss, opt_state), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    key = jax.random.key(1)
    for step in range(args.steps):
        key, sub = jax.random.split(key)
        params, opt_state, loss = train_step(params, opt_state, jax.random.randint(sub, (32, 16), 0, 64))
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {float(loss):.4f}  scale {float(abj.loss_scale(opt_state).scale):g}")


if __name__ == "__main__":
    main()

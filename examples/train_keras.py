"""Train a small model with Keras (any backend: set KERAS_BACKEND) under examples/amp.toml.

    python examples/train_keras.py [--steps N] [--policy FILE]
"""

import argparse
from pathlib import Path

import keras
import numpy as np

import ampbridge
import ampbridge.keras as ak


def make_model(vocab=64, dim=64):
    tokens = keras.Input((16,), dtype="int32")
    x = keras.layers.Embedding(vocab, dim, name="embed")(tokens)
    h = keras.layers.LayerNormalization(name="norm")(x)
    h = keras.layers.Dense(4 * dim, activation="relu", name="mlp_in")(h)
    h = keras.layers.Dense(dim, name="mlp_out")(h)
    return keras.Model(tokens, keras.layers.Dense(vocab, name="head")(x + h))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--policy", default=Path(__file__).with_name("amp.toml"))
    args = parser.parse_args()

    policy = ampbridge.load(args.policy)
    model = ak.apply(make_model(), policy)   # each layer gets its Plan row's dtype policy
    print(ak.plan(model, policy))
    model.compile(ak.optimizer(keras.optimizers.AdamW(3e-3), policy),   # the policy's loss scaling
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, (32 * args.steps, 16)).astype("int32")
    model.fit(x, (x + 1) % 64, batch_size=32, epochs=1, verbose=2)
    print("final loss scale", model.optimizer.state.scale)


if __name__ == "__main__":
    main()

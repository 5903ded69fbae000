"""Train a small model with PyTorch under examples/amp.toml.

    python examples/train_torch.py [--steps N] [--policy FILE]
"""

import argparse
from pathlib import Path

import torch
from torch import nn

import ampbridge
import ampbridge.torch as abt


class Model(nn.Module):
    def __init__(self, vocab=64, dim=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.head(x + self.mlp(self.norm(x)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--policy", default=Path(__file__).with_name("amp.toml"))
    args = parser.parse_args()

    policy = ampbridge.load(args.policy)
    model = Model()
    amp = abt.apply(model, policy)          # pins, autocast regions, GradScaler: all from the file
    print(amp.plan)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        x = torch.randint(0, 64, (32, 16), generator=gen)
        loss = nn.functional.cross_entropy(amp.model(x).flatten(0, 1), ((x + 1) % 64).flatten())
        amp.step(loss, opt)                  # scale, backward, unscale, skip or step, update
        opt.zero_grad()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  scale {amp.scaler.get_scale():g}")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, "/tmp/ckpt_torch.pt")


if __name__ == "__main__":
    main()

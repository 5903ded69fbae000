"""Checkpoint: save mid-run, restore in a fresh process, continue: identical to an uninterrupted run."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import ampbridge._testing

torch = ampbridge._testing.require("torch")

ROOT = Path(__file__).resolve().parents[2]

# One training script for all three runs (uninterrupted, first half, resumed second half). The
# loss-scale settings make every state field move: hysteresis, a floor, frequent growth, and
# gradients made non-finite at fixed steps.
SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import ampbridge
    import ampbridge.torch as abt

    F = torch.nn.functional
    POLICY = ampbridge.Policy(
        compute_dtype="float16", keep_float32=("kind:norm", "kind:embedding"),
        loss_scale=ampbridge.LossScaleConfig(mode="dynamic", initial_scale=2.0**18, growth_interval=3,
                                             hysteresis=2, min_scale=1.0))
    POISONED = {4, 5, 11, 16, 17, 18}


    class Tiny(torch.nn.Module):
        def __init__(self, vocab=32, d=16):
            super().__init__()
            self.embed, self.ln1 = torch.nn.Embedding(vocab, d), torch.nn.LayerNorm(d)
            self.attn = torch.nn.MultiheadAttention(d, 2, batch_first=True)
            self.ln2, self.fc, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, d), torch.nn.Linear(d, vocab)

        def forward(self, tokens):
            h = self.ln1(self.embed(tokens))
            h = h + self.attn(h, h, h, need_weights=False)[0]
            return self.head(self.ln2(h + self.fc(h)))


    def batch(step):
        g = torch.Generator().manual_seed(1000 + step)
        return torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)


    def build():
        torch.manual_seed(0)
        model = Tiny()
        amp = abt.apply(model, POLICY)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, amp, opt


    def train(model, amp, opt, start, stop):
        losses = []
        for step in range(start, stop):
            tokens, y = batch(step)
            loss = F.cross_entropy(model(tokens).flatten(0, 1), y.flatten())
            hook = model.fc.weight.register_hook(lambda g: g * float("inf")) if step in POISONED else None
            amp.step(loss, opt)
            if hook is not None:
                hook.remove()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses


    def result(model, amp, opt, losses):
        return {"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict(),
                "scaler": amp.scaler.state_dict(), "losses": losses}


    if __name__ == "__main__":
        _, ckpt, out, start, stop = sys.argv
        model, amp, opt = build()
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        amp.load_state_dict(saved["amp"])
        torch.save(result(model, amp, opt, train(model, amp, opt, int(start), int(stop))), out)
''')


def test_resume_in_a_fresh_process_is_identical(tmp_path):
    script = tmp_path / "train_ckpt.py"
    script.write_text(SCRIPT)
    spec = importlib.util.spec_from_file_location("train_ckpt", script)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)

    model, amp, opt = run.build()
    full = run.result(model, amp, opt, run.train(model, amp, opt, 0, 24))

    model, amp, opt = run.build()
    first = run.train(model, amp, opt, 0, 17)
    # the next step overflows: only the restored hysteresis_left (1, not a fresh 2) backs off there
    assert amp.state_dict()["loss_scale"]["hysteresis_left"] == 1 and 17 in run.POISONED
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, tmp_path / "ckpt.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt.pt"), str(tmp_path / "out.pt"), "17", "24"],
                   check=True, env=env, cwd=tmp_path)
    resumed = torch.load(tmp_path / "out.pt")

    assert all(torch.equal(a, b) for a, b in zip(full["losses"], first + resumed["losses"]))
    for key, value in full["model"].items():
        assert torch.equal(value, resumed["model"][key]), key
    for pid, state in full["opt"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, resumed["opt"]["state"][pid][key]), (pid, key)
    assert full["amp"] == resumed["amp"] and full["scaler"] == resumed["scaler"]
    state = full["amp"]["loss_scale"]
    assert state["skipped"] >= 2 and state["steps"] == 24  # the scaler's state really moved
    assert set(state) == {"scale", "good_steps", "hysteresis_left", "steps", "skipped", "nonfinite_streak"}


def _docs_recipe():
    """The checkpoint code docs/torch.md shows (the block defining ``rng_state``), run as written."""
    text = (ROOT / "docs" / "torch.md").read_text()
    block = next(b.split("\n", 1)[1] for b in text.split("```python")[1:] if "def rng_state" in b)
    namespace: dict = {}
    exec(compile(block.split("```", 1)[0], "docs/torch.md", "exec"), namespace)
    return namespace


def test_resume_with_dropout_is_exact_with_the_documented_rng_state(tmp_path):
    import random

    import numpy as np

    import ampbridge
    import ampbridge.torch as abt

    recipe = _docs_recipe()
    nn = torch.nn

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.LayerNorm(32), nn.Linear(32, 4))
        amp = abt.apply(model, ampbridge.Policy(compute_dtype="float16", keep_float32=("kind:norm",)))
        return model, amp, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, amp, opt, start, stop):
        for step in range(start, stop):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(6, 8, generator=g) * (1 + np.random.rand() + random.random())  # all three RNGs
            with amp.autocast():
                loss = model(x).float().pow(2).mean()
            amp.step(loss, opt)
            opt.zero_grad()

    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    model, amp, opt = build()
    train(model, amp, opt, 0, 6)
    full = [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    model, amp, opt = build()
    train(model, amp, opt, 0, 3)
    recipe["save"](tmp_path / "ckpt.pt", model, opt, amp)
    for restore in (True, False):
        torch.manual_seed(99), np.random.seed(99), random.seed(99)  # a fresh process's generators
        model, amp, opt = build()
        if restore:
            recipe["resume"](tmp_path / "ckpt.pt", model, opt, amp)
        else:  # everything but the generators
            ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
            model.load_state_dict(ckpt["model"]), opt.load_state_dict(ckpt["opt"]), amp.load_state_dict(ckpt["amp"])
        train(model, amp, opt, 3, 6)
        same = all(torch.equal(a, b) for a, b in zip(full, model.parameters()))
        assert same == restore

"""``ampbridge tune`` on a tiny torch model in a user module: the summary, ``-o`` writes the tuned
policy (loadable, pinning the layer out of float16's range), bad usage exits 2 and bad input 1,
each with one line and no traceback."""

from __future__ import annotations

import textwrap

from ampbridge._testing import require

torch = require("torch")

import ampbridge  # noqa: E402
from ampbridge.cli.commands import main  # noqa: E402

USER_MODULE = '''
import torch

class Scale(torch.nn.Module):
    def forward(self, x):
        return x * 1e6

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), Scale(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))

def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(2)]

loss = torch.nn.functional.mse_loss

def broken():
    raise RuntimeError("no data here")
'''


def _setup(tmp_path, monkeypatch, name):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    (tmp_path / "policy.toml").write_text('version = 1\nextends = "mixed_float16"\n')
    monkeypatch.chdir(tmp_path)


def test_cli_tune_writes_the_tuned_policy(tmp_path, monkeypatch, capsys):
    _setup(tmp_path, monkeypatch, "tune_cli_user_a")
    code = main(["tune", "policy.toml", "--model", "tune_cli_user_a:build", "--data", "tune_cli_user_a:batches",
                 "--loss", "tune_cli_user_a:loss", "--steps", "3", "-o", "tuned.toml"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert '+keep_float32 = ["1"]' in out and "tuned policy written to tuned.toml" in out
    assert "float32 reference run" in err  # progress goes to stderr
    assert ampbridge.load(tmp_path / "tuned.toml") == ampbridge.preset("mixed_float16").replace(keep_float32=("1",))


def test_cli_tune_bad_usage_and_bad_input(tmp_path, monkeypatch, capsys):
    _setup(tmp_path, monkeypatch, "tune_cli_user_b")
    base = ["tune", "policy.toml", "--model", "tune_cli_user_b:build", "--loss", "tune_cli_user_b:loss"]
    cases = [
        (base + ["--data", "tune_cli_user_b"], 2, "--data takes module:callable"),
        (base + ["--data", "tune_cli_user_b:nothing"], 2, "has no attribute 'nothing'"),
        (base + ["--data", "tune_cli_user_b:batches", "--dtypes", "int8"], 2, "--dtypes takes"),
        (base + ["--data", "tune_cli_user_b:batches", "--steps", "0"], 2, "--steps must be >= 1"),
        (base + ["--data", "tune_cli_user_b:batches", "--tolerance", "-1"], 2, "--tolerance takes a loss gap >= 0"),
        (base + ["--data", "tune_cli_user_b:broken"], 1, "the callable raised RuntimeError: no data here"),
        (["tune", "missing.toml", "--model", "a:b", "--data", "a:b", "--loss", "a:b"], 1, "missing.toml"),
    ]
    for argv, want, text in cases:
        code = main(argv)
        _, err = capsys.readouterr()
        assert code == want, (argv, err)
        assert text in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err

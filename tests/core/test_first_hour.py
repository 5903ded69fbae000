"""What a newcomer with only the wheel meets first: `ampbridge init`, a missing framework said in one
line, and a demo that refuses what it cannot do instead of exiting 0 with nothing written."""

import subprocess
import sys
import textwrap

from ampbridge import load
from ampbridge.cli.commands import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_init_writes_the_example_policy_and_never_overwrites(tmp_path, capsys):
    code, out, err = run(capsys, "init", str(tmp_path))
    written = tmp_path / "amp.toml"
    assert code == 0 and f"wrote {written}" in out
    policy = load(written)
    assert policy.compute_dtype == "float16" and "kind:norm" in policy.keep_float32
    written.write_text("# mine\n")
    code, out, err = run(capsys, "init", str(written))
    assert code == 1 and "exists; not overwritten (--force replaces it)" in err
    assert written.read_text() == "# mine\n"  # nothing lost
    assert run(capsys, "init", str(written), "--force")[0] == 0
    assert load(written) == policy
    code, out, err = run(capsys, "init", str(tmp_path / "no" / "such" / "x.toml"))
    assert code == 1 and err.count("\n") == 1 and "no such directory" in err


def test_demo_plot_without_a_framework_to_train_is_refused(tmp_path, capsys):
    code, out, err = run(capsys, "demo", "--frameworks", "none", "--plot", str(tmp_path / "x.png"))
    assert code == 2 and "nothing to plot" in err and err.count("\n") == 1
    assert not (tmp_path / "x.png").exists()


def test_a_missing_framework_is_one_error_without_the_chained_import_trace():
    # a fresh interpreter where importing torch fails, as on a machine without it
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # import torch -> ImportError
        import ampbridge.torch
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ampbridge.errors.BackendUnavailableError: ampbridge.torch needs 'torch'")
    assert "pip install 'ampbridge[torch]'" in last
    assert "above exception" not in proc.stderr  # no chained trace ("direct cause of" / "During handling of")


def test_each_extra_installs_what_its_demo_run_imports():
    # `pip install 'ampbridge[jax]'` once left the demo's JAX run out without a word (it needed jmp)
    import re
    import tomllib
    from pathlib import Path

    from ampbridge.cli.demo.run import _NEEDS, EXTRAS

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    for framework, modules in _NEEDS.items():
        names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).replace("-", "_") for r in extras[EXTRAS.get(framework, framework)]}
        assert set(modules) <= names, (framework, modules, names)



def test_the_demo_leaves_tf_keras_out_where_it_is_not_installed(monkeypatch, capsys):
    # tf.keras 2 is optional: without it the demo trains the others (said on stderr) and refuses it by name
    import importlib.util

    from ampbridge.cli.demo import run as demo

    real = importlib.util.find_spec
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name, *a: None if name == "tf_keras" else real(name, *a))
    assert "tf_keras" not in demo.installed_frameworks()
    assert main(["demo", "--frameworks", "tf_keras"]) == 2
    assert "not installed here: tf_keras (pip install 'ampbridge[tf-keras]')" in capsys.readouterr().err

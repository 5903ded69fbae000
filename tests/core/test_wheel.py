"""The package as a user installs it: build the wheel, install it into a fresh virtual environment
with no framework, and use it from outside the source tree.

Every other test imports ampbridge from the source tree, which is how ``ampbridge demo`` once
shipped without its own subpackage. This one sees only what the wheel holds.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("ampbridge", "pyproject.toml", "README.md", "LICENSE")


def _run(args: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300, **kwargs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """The wheel, built from a copy of the sources (nothing written into the tree), installed into
    a new virtual environment; returns its paths."""
    pytest.importorskip("setuptools", reason="the wheel is built with this environment's setuptools")
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    dist = work / "dist"
    build = _run([sys.executable, "-W", "always", "-c",
                  "import setuptools.build_meta as b, sys; print(b.build_wheel(sys.argv[1]))", str(dist)], src)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = dist / build.stdout.strip().splitlines()[-1]
    venv = work / "venv"
    made = _run([sys.executable, "-m", "venv", str(venv)], work)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    pip = _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], work)
    assert pip.returncode == 0, pip.stderr
    outside = work / "elsewhere"
    outside.mkdir()
    return {"wheel": wheel, "python": python, "bin": venv / "bin", "cwd": outside,
            "build_stderr": build.stderr}  # type: ignore[dict-item]


def test_the_build_says_nothing_deprecated(installed):
    assert "eprecat" not in installed["build_stderr"], installed["build_stderr"][-3000:]


def test_the_wheel_holds_every_package_and_data_file(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    packages = sorted(str(p.parent.relative_to(ROOT)) for p in (ROOT / "ampbridge").rglob("__init__.py")
                      if "__pycache__" not in p.parts)
    assert [p for p in packages if f"{p}/__init__.py" not in names] == []
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "ampbridge").rglob("*.py") if "__pycache__" not in p.parts)
    assert [m for m in modules if m not in names] == []
    data = [str(p.relative_to(ROOT)) for p in (ROOT / "ampbridge" / "examples").iterdir()] + ["ampbridge/py.typed"]
    assert [d for d in data if d not in names] == []
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    metadata = next(zipfile.ZipFile(installed["wheel"]).read(n).decode() for n in names if n.endswith("METADATA"))
    assert "License-Expression: Apache-2.0" in metadata


def test_the_installed_cli_runs_from_outside_the_tree(installed):
    ampbridge, cwd = str(installed["bin"] / "ampbridge"), installed["cwd"]
    helped = _run([ampbridge, "--help"], cwd)
    assert helped.returncode == 0 and "validate" in helped.stdout, helped.stderr
    where = _run([str(installed["python"]), "-c", "import ampbridge, sys; print(ampbridge.__file__)"], cwd)
    package = Path(where.stdout.strip()).parent
    assert str(package).startswith(str(installed["bin"].parent)), "imported the source tree, not the wheel"
    example = package / "examples" / "amp.toml"
    validated = _run([ampbridge, "validate", str(example)], cwd)
    assert validated.returncode == 0 and validated.stdout.startswith("ok:"), validated.stderr
    demo = _run([ampbridge, "demo", "--frameworks", "none"], cwd)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "Plan" in demo.stdout
    module = _run([str(installed["python"]), "-m", "ampbridge", "show", str(example)], cwd)
    assert module.returncode == 0 and "compute_dtype" in module.stdout, module.stderr


@pytest.mark.parametrize("backend, extra", [("torch", "torch"), ("keras", "keras"), ("tf_keras", "tf-keras"), ("jax", "jax")])
def test_a_missing_framework_names_its_extra(installed, backend, extra):
    code = (f"import ampbridge\ntry:\n    import ampbridge.{backend}\n"
            "except ImportError as e:\n    print(type(e).__name__, isinstance(e, ampbridge.AmpBridgeError)); print(e)\n")
    got = _run([str(installed["python"]), "-c", code], installed["cwd"])
    assert got.returncode == 0, got.stderr
    kind, message = got.stdout.split("\n", 1)
    assert kind == "BackendUnavailableError True"
    assert f"pip install 'ampbridge[{extra}]'" in message
    recipes = _run([str(installed["python"]), "-c", "from ampbridge import recipes; print(recipes.detect({'fp16': {}}))"],
                   installed["cwd"])
    assert recipes.returncode == 0 and recipes.stdout.strip() == "deepspeed", recipes.stderr


def test_the_metadata_names_python_versions_and_the_extras(installed):
    metadata = next(zipfile.ZipFile(installed["wheel"]).read(n).decode()
                    for n in zipfile.ZipFile(installed["wheel"]).namelist() if n.endswith("METADATA"))
    for version in ("3.11", "3.12", "3.13"):
        assert f"Classifier: Programming Language :: Python :: {version}" in metadata
    for extra in ("torch", "keras", "tensorflow", "jax", "all"):
        assert f"Provides-Extra: {extra}" in metadata
    # Keras alone must not bring a TensorFlow of ours (a GPU tensorflow already installed stays)
    keras_requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")
                      and 'extra == "keras"' in line]
    assert keras_requires and not any("tensorflow" in line for line in keras_requires), keras_requires


def test_the_sdist_carries_the_docs_the_readme_links_to(tmp_path):
    pytest.importorskip("setuptools", reason="the sdist is built with this environment's setuptools")
    import tarfile

    src = tmp_path / "src"
    for name in (*SOURCES, "docs", "MANIFEST.in"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    build = _run([sys.executable, "-c", "import setuptools.build_meta as b, sys; print(b.build_sdist(sys.argv[1]))",
                  str(tmp_path / "dist")], src)
    assert build.returncode == 0, build.stderr[-3000:]
    names = tarfile.open(tmp_path / "dist" / build.stdout.strip().splitlines()[-1]).getnames()
    linked = sorted({link for link in __import__("re").findall(r"\((docs/[\w./-]+\.md)", (ROOT / "README.md").read_text())})
    assert linked, "the README links no docs/ page"
    from ampbridge import __version__

    assert [link for link in linked if f"ampbridge-{__version__}/{link}" not in names] == []

"""The supported releases are said once (ampbridge.backends.private_hooks.TESTED) and the files that
install them agree: constraints-min.txt pins the floors, constraints.txt the newest, pyproject's
extras declare the floors; a release outside that range is refused (older) or warned about (newer)."""

import re
import tomllib
import warnings
from pathlib import Path

import pytest

from ampbridge.backends.private_hooks import TESTED, check_release, release
from ampbridge.errors import AmpBridgeWarning, BackendUnavailableError

ROOT = Path(__file__).resolve().parents[2]
PIP_NAME = {"tensorflow": "tensorflow-cpu", "tf_keras": "tf-keras"}


def _pins(name):
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if match:
            pins[match[1].lower().replace("_", "-")] = match[2]
    return pins


def test_constraint_files_pin_the_tested_floors_and_newest():
    floors, newest = _pins("constraints-min.txt"), _pins("constraints.txt")
    for framework, (low, high) in TESTED.items():
        name = PIP_NAME.get(framework, framework)
        assert floors[name] == low, (framework, "constraints-min.txt")
        assert newest[name] == high, (framework, "constraints.txt")
    assert floors["jaxlib"] == floors["jax"] and newest["jaxlib"] == newest["jax"]


def test_constraints_min_says_why_for_every_framework():
    lines = (ROOT / "constraints-min.txt").read_text().splitlines()
    for framework in TESTED:
        at = next(i for i, line in enumerate(lines) if line.startswith(PIP_NAME.get(framework, framework) + "=="))
        assert lines[at - 1].startswith("# ") and len(lines[at - 1]) > 20, framework


def test_pyproject_extras_declare_the_floors():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    declared = {}
    for requirement in extras["torch"] + extras["keras"] + extras["tensorflow"] + extras["jax"] + extras["tf-keras"]:
        if requirement.startswith(("ampbridge[", "numpy")):  # an extra's own extras; the demo's numpy
            continue
        name, floor = re.fullmatch(r"([a-z-]+)>=(\S+)", requirement).groups()
        declared[name] = floor
    for framework, (low, _) in TESTED.items():
        floor = declared[PIP_NAME.get(framework, framework)]
        assert release(floor) == release(low)[:len(release(floor))], (framework, floor, low)


def test_releases_outside_the_tested_range(monkeypatch):
    monkeypatch.delenv("AMPBRIDGE_UNTESTED_OK", raising=False)
    low, high = TESTED["keras"]
    check_release("keras", low)
    check_release("keras", high + "+local")
    with pytest.raises(BackendUnavailableError, match=r"keras 3\.11\.3 is older .*keras 3\.12\.0 to"):
        check_release("keras", "3.11.3")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_release("keras", "99.0.0")
        monkeypatch.setenv("AMPBRIDGE_UNTESTED_OK", "1")
        check_release("keras", "3.10.0")  # the explicit choice: said, not refused
    assert [issubclass(w.category, AmpBridgeWarning) for w in caught] == [True, True]
    assert "newer than ampbridge was tested" in str(caught[0].message)
    assert "running untested" in str(caught[1].message)
    assert release("2.13.0+cpu") == (2, 13, 0) and release("0.12.5rc1") == (0, 12, 5)

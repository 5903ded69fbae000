"""Every private torch name the torch backend uses is listed in ampbridge/backends/private_hooks.py
(with what it is for and the test that guards it), and every listed one is still used."""

import torch  # noqa: F401  (first: see tests/conftest.py)

from ampbridge.backends import private_hooks


def test_private_torch_names_are_the_listed_ones():
    used = private_hooks.scan("torch")
    listed = {h.name for h in private_hooks.hooks_of("torch")}
    unlisted = {name: sorted(used[name]) for name in set(used) - listed}
    assert not unlisted, f"private names used but not listed in private_hooks.HOOKS: {unlisted}"
    assert not listed - set(used), f"listed but no longer used: {sorted(listed - set(used))}"

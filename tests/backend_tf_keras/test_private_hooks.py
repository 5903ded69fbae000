"""Every private tf_keras name the tf_keras backend uses is listed in ampbridge/backends/private_hooks.py
(with what it is for and the test that guards it), and every listed one is still used."""

from ampbridge._testing import require

require("tf_keras")

from ampbridge.backends import private_hooks  # noqa: E402


def test_private_tf_keras_names_are_the_listed_ones():
    used = private_hooks.scan("tf_keras")
    listed = {h.name for h in private_hooks.hooks_of("tf_keras")}
    unlisted = {name: sorted(used[name]) for name in set(used) - listed}
    assert not unlisted, f"private names used but not listed in private_hooks.HOOKS: {unlisted}"
    assert not listed - set(used), f"listed but no longer used: {sorted(listed - set(used))}"

"""tf.keras 2 (tf_keras) backend tests: run in their own pytest process with TF_USE_LEGACY_KERAS=1
(``make test-all`` does), since ``tf.keras`` is decided when TensorFlow first resolves it and the
Keras 3 tests share the default run. tests/conftest.py leaves this folder out otherwise."""

from __future__ import annotations

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before anything imports tensorflow

import pytest  # noqa: E402

from ampbridge._testing import require  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_global_policy():
    tf_keras = require("tf_keras")
    before = tf_keras.mixed_precision.global_policy()
    yield
    tf_keras.mixed_precision.set_global_policy(before)

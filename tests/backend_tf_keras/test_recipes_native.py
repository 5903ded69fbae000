"""What ``to_tf_keras`` writes (and ``ampbridge convert --to tf_keras``) is what Keras 2 itself takes:
the dtype policy name builds a ``tf_keras.mixed_precision.Policy``, the optimizer settings a
``LossScaleOptimizer``, and that optimizer's own ``get_config()`` reads back to the same settings."""

from __future__ import annotations

import json

import pytest

from ampbridge._testing import require

tf_keras = require("tf_keras")

import ampbridge  # noqa: E402
from ampbridge import LossScaleConfig, recipes  # noqa: E402
from ampbridge.cli.commands import main  # noqa: E402

CASES = {
    "dynamic": ampbridge.preset("mixed_float16").replace(output_dtype="float16", loss_scale=LossScaleConfig(
        mode="dynamic", initial_scale=1024.0, growth_interval=8, min_scale=1.0)),
    "static": ampbridge.preset("float16").replace(loss_scale=LossScaleConfig(
        mode="static", initial_scale=64.0, skip_nonfinite=False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_keras2_takes_what_to_tf_keras_writes(case, tmp_path, capsys):
    policy = CASES[case]
    written = recipes.to_tf_keras(policy)
    assert written.exact, written.losses
    dtype = tf_keras.mixed_precision.Policy(written.result["dtype_policy"])
    assert (dtype.compute_dtype, dtype.variable_dtype) == (policy.compute_dtype, policy.param_dtype)
    opt = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD(), **written.result["loss_scale_optimizer"])
    assert float(opt.loss_scale.numpy()) == policy.loss_scale.initial_scale
    # Keras 2's own config of that optimizer, as a file, through the CLI
    config = tmp_path / "lso.json"
    config.write_text(json.dumps(opt.get_config()))
    assert main(["convert", str(config), "--from", "tf_keras"]) == 0
    assert ampbridge.loads(capsys.readouterr().out).loss_scale == policy.loss_scale

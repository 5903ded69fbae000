"""The DeepSpeed reader validates the fp16 section as DeepSpeed 0.19.8's own config model does.

The judge is the installed ``deepspeed.runtime.precision_config.DeepSpeedFP16Config`` (pydantic,
lax mode, plus DeepSpeed's validators): over random fp16 sections, a section fp16 does not enable is
accepted by ``recipes.from_deepspeed`` exactly when DeepSpeed accepts it (issue 38: a negative, NaN or
string ``loss_scale`` stops DeepSpeed even with ``enabled`` absent), and an enabled one DeepSpeed
rejects is rejected too (ampbridge may refuse more there: a hysteresis of 0, say, which it cannot run).
"""

from __future__ import annotations

import math
import os

import pytest

from ampbridge import PolicyError, recipes
from ampbridge._testing import require

require("torch")
require("deepspeed", "the fp16 section is judged by DeepSpeed's own config model")
hypothesis = require("hypothesis")
from deepspeed.runtime.precision_config import DeepSpeedFP16Config  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = 2000 if os.environ.get("AMPBRIDGE_FUZZ") else 150

VALUES = st.one_of(
    st.integers(-3, 40), st.sampled_from([0.0, 0.5, 2.0, 2.5, 128.0, -1.0, math.nan, math.inf, -math.inf]),
    st.booleans(), st.none(),
    st.sampled_from(["abc", "128", "2", " 3 ", "1.5", "-4", "yes", "no", "true", "off", "0", "1", ""]))
KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
        "min_loss_scale", "auto_cast", "fp16_master_weights_and_grads")


def deepspeed_accepts(section):
    try:
        DeepSpeedFP16Config(**section)
    except ValueError:  # pydantic's ValidationError is a ValueError
        return False
    return True


def ampbridge_accepts(section):
    try:
        recipes.from_deepspeed({"fp16": section, "zero_optimization": {"stage": 2}})
    except PolicyError as e:
        assert "\n" not in str(e.problems[0]), "one line per problem"
        return False
    return True


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4), st.sampled_from([None, False, True]))
def test_the_fp16_section_is_refused_where_deepspeed_refuses_it(section, enabled):
    if enabled is not None:
        section = {**section, "enabled": enabled}
    theirs = deepspeed_accepts(section)
    if enabled:
        assert theirs or not ampbridge_accepts(section), section
    else:  # not enabled: nothing of it is read, so only DeepSpeed's own checks can refuse it
        assert ampbridge_accepts(section) == theirs, section


@pytest.mark.parametrize("value", [-1, math.nan, "abc", True])
def test_a_bad_loss_scale_stops_both_with_enabled_absent(value):
    assert not deepspeed_accepts({"loss_scale": value})
    with pytest.raises(PolicyError, match="fp16.loss_scale: DeepSpeed's config model rejects it"):
        recipes.from_deepspeed({"fp16": {"loss_scale": value}})


def test_what_deepspeed_coerces_is_read_as_deepspeed_reads_it():
    section = {"enabled": "true", "loss_scale": "128", "hysteresis": "3", "consecutive_hysteresis": "yes"}
    assert deepspeed_accepts(section)
    ls = recipes.from_deepspeed({"fp16": section}).result.loss_scale
    assert (ls.mode, ls.initial_scale) == ("static", DeepSpeedFP16Config(**section).loss_scale) == ("static", 128.0)

import pytest

import ampbridge
from ampbridge import Phase, Policy, PolicyError

SCHEDULE = """
compute_dtype = "float16"
keep_float32 = ["kind:embedding"]
[loss_scale]
growth_interval = 100

[[phase]]
until_epoch = 5
compute_dtype = "float32"

[[phase]]
until_epoch = 15

[[phase]]
keep_float32 = ["kind:norm", "kind:embedding"]
[phase.loss_scale]
reset = true
growth_factor = 4.0
"""


def test_at_resolves_the_phase_in_force():
    p = ampbridge.loads(SCHEDULE)
    assert [p.phase_index(epoch=e) for e in (0, 4, 5, 14, 15, 1000)] == [0, 0, 1, 1, 2, 2]
    assert p.at(epoch=4).compute_dtype == "float32"
    assert p.at(epoch=5).compute_dtype == "float16"
    late = p.at(epoch=20)
    assert late.keep_float32 == ("kind:norm", "kind:embedding")
    assert late.loss_scale.growth_factor == 4.0 and late.loss_scale.growth_interval == 100
    assert p.phases[2].reset_loss_scale and not p.phases[1].reset_loss_scale
    assert late.phases == () and p.phase_unit == "epoch"


def test_at_needs_the_schedules_unit():
    p = ampbridge.loads(SCHEDULE)
    with pytest.raises(ValueError, match="scheduled by epoch; pass epoch="):
        p.at(step=3)
    with pytest.raises(ValueError, match="integer >= 0"):
        p.at(epoch=-1)
    assert Policy().at(step=5) == Policy()


def test_after_a_closed_last_phase_the_top_level_applies():
    p = ampbridge.loads('compute_dtype = "bf16"\n[[phase]]\nuntil_step = 10\ncompute_dtype = "float32"\n')
    assert p.at(step=9).compute_dtype == "float32"
    assert p.at(step=10).compute_dtype == "bfloat16"
    assert p.phase_index(step=10) is None


@pytest.mark.parametrize("doc,key,message", [
    ("[[phase]]\nuntil_epoch = 5\n[[phase]]\nuntil_epoch = 3\n", "phase[1].until_epoch", "in order and must not overlap"),
    ("[[phase]]\nuntil_epoch = 5\n[[phase]]\nuntil_epoch = 5\n", "phase[1].until_epoch", "in order and must not overlap"),
    ("[[phase]]\nuntil_epoch = 5\n[[phase]]\nuntil_step = 900\n", "phase[1]", "mix until_epoch and until_step"),
    ("[[phase]]\ncompute_dtype = 'bf16'\n[[phase]]\nuntil_epoch = 2\n", "phase[0]", "only the last phase"),
    ("[[phase]]\nuntil_epoch = 5\ncolour = 'red'\n", "phase[0].colour", "unknown key in [[phase]] number 0"),
    ("[[phase]]\nuntil_epoch = 0\n", "phase[0].until_epoch", "integer >= 1"),
    ("[[phase]]\nuntil_epoch = 2\nuntil_step = 2\n", "phase[0]", "not both"),
    ("[[phase]]\nuntil_epoch = 2\nversion = 1\n", "phase[0].version", "unknown key"),
    ("[[phase]]\nuntil_epoch = 2\ncompute_dtype = 'fp64'\n", "phase[0].compute_dtype", "unknown compute dtype"),
    ("[[phase]]\nuntil_epoch = 2\n[phase.loss_scale]\nreset = 'yes'\n", "phase[0].loss_scale.reset", "boolean"),
    ("[[phase]]\nuntil_epoch = 2\n[phase.loss_scale]\ngrowth_factr = 2.0\n", "phase[0].loss_scale.growth_factr",
     "did you mean 'growth_factor'"),
])
def test_bad_schedules_name_the_phase(doc, key, message):
    with pytest.raises(PolicyError) as info:
        ampbridge.loads(doc, source="sched.toml")
    matching = [p for p in info.value.problems if p.key == key]
    assert matching, [str(p) for p in info.value.problems]
    assert message in str(matching[0])
    assert matching[0].file == "sched.toml" and matching[0].line is not None


def test_phase_errors_point_at_the_phase_line():
    doc = "compute_dtype = 'float16'\n\n[[phase]]\nuntil_epoch = 2\nparam_dtype = 'fp8'\n"
    with pytest.raises(PolicyError) as info:
        ampbridge.loads(doc, source="s.toml")
    assert info.value.line == 5 and info.value.key == "phase[0].param_dtype"


def test_python_constructed_schedules_are_checked_too():
    a = Phase(Policy(compute_dtype="float32"), until_epoch=5)
    b = Phase(Policy(), until_epoch=3)
    with pytest.raises(PolicyError, match="in order"):
        Policy(phases=(a, b))
    with pytest.raises(PolicyError, match="phases of its own"):
        Phase(Policy(phases=(a,)), until_epoch=9)

"""Fuzzing the loader: whatever the document, the outcome is a Policy or a PolicyError."""

import json
import string

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ampbridge
from ampbridge import Policy, PolicyError
from ampbridge.core.fields import LOSS_SCALE_KEYS, PHASE_KEYS, TOP_KEYS

KEYS = list(TOP_KEYS) + list(LOSS_SCALE_KEYS) + list(PHASE_KEYS) + ["match", "reset", "colour"]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5000), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["float16", "bf16", "auto", "fp8", "kind:norm", "kind:nrom", "re:(x", "a..b", "**",
                     "dynamic", "static", "none", "clamp", "error", "highest", "mixed_float16", "x.toml", ""]),
    st.text(max_size=8),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=5)),
    max_leaves=20,
)
DOCS = st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=8)


def outcome(load):
    try:
        result = load()
    except PolicyError as e:
        assert e.problems and all(str(p) for p in e.problems)
        return None
    assert isinstance(result, Policy)
    return result


SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(DOCS)
def test_random_documents_give_a_policy_or_a_policy_error(doc):
    p = outcome(lambda: ampbridge.Policy.from_dict(doc))
    if p is not None:  # anything that loads also round-trips
        assert ampbridge.loads(ampbridge.dumps(p)) == p


@SETTINGS
@given(DOCS, st.sampled_from(["json", "yaml"]))
def test_random_documents_as_text(doc, fmt):
    try:
        text = json.dumps(doc, allow_nan=True)
    except (TypeError, ValueError):
        return
    outcome(lambda: ampbridge.loads(text, format=fmt))


from ampbridge.cli.commands import EXAMPLES  # noqa: E402

REFERENCE = (EXAMPLES / "reference.toml").read_text()


@SETTINGS
@given(st.data())
def test_mutated_reference_documents(data):
    text = REFERENCE
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["delete", "insert", "swap_line", "duplicate_line"]))
        if not text:
            break
        i = data.draw(st.integers(0, len(text) - 1))
        if op == "delete":
            text = text[:i] + text[i + data.draw(st.integers(1, 12)):]
        elif op == "insert":
            text = text[:i] + data.draw(st.text(string.printable, min_size=1, max_size=6)) + text[i:]
        else:
            lines = text.splitlines()
            j, k = data.draw(st.integers(0, len(lines) - 1)), data.draw(st.integers(0, len(lines) - 1))
            if op == "swap_line":
                lines[j], lines[k] = lines[k], lines[j]
            else:
                lines.insert(k, lines[j])
            text = "\n".join(lines)
    outcome(lambda: ampbridge.loads(text, source="mutated.toml", base_dir="/nonexistent"))

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ampbridge import compile_pattern, join_path

CASES = [
    ("lm_head", "lm_head", True),
    ("lm_head", "model.lm_head", False),
    ("encoder.*.norm", "encoder.layers.norm", True),
    ("encoder.*.norm", "encoder.layers.0.norm", False),
    ("encoder.**.norm", "encoder.layers.0.norm", True),
    ("encoder.**.norm", "encoder.norm", True),
    ("encoder.**.norm", "encoder.layers.0.norm2", False),
    ("**.norm", "norm", True),
    ("**.norm", "a.b.norm", True),
    ("**.**.norm", "a.norm", True),
    ("decoder.**", "decoder", True),
    ("decoder.**", "decoder.x.y", True),
    ("decoder.**", "decoders", False),
    ("**", "anything.at.all", True),
    ("layers.?.attn", "layers.3.attn", True),
    ("layers.?.attn", "layers.12.attn", False),
    ("enc*", "encoder", True),
    ("enc*", "encoder.norm", False),
    ("a+b", "a+b", True),  # regex metacharacters in globs are literal
    ("a+b", "aab", False),
    ("re:.*head$", "model.lm_head", True),
    ("re:head", "lm_head", False),  # full match, not search
    ("re:(enc|dec)oder\\.norm", "decoder.norm", True),
]


@pytest.mark.parametrize("pattern,path,expected", CASES, ids=[f"{p}~{q}" for p, q, _ in CASES])
def test_path_patterns(pattern, path, expected):
    assert compile_pattern(pattern).matches(path) is expected


def test_kind_and_type_patterns():
    assert compile_pattern("kind:norm").matches("x", kind="norm", class_name="LayerNorm")
    assert not compile_pattern("kind:norm").matches("x", kind="linear", class_name="Linear")
    assert not compile_pattern("kind:norm").matches("norm")  # a kind never matches a path
    assert compile_pattern("type:LayerNorm").matches("x", class_name="LayerNorm")
    assert not compile_pattern("type:LayerNorm").matches("x", class_name="LayerNormalization")


@pytest.mark.parametrize("bad,message", [
    ("kind:nrom", "did you mean 'norm'"),
    ("kind:mlp", "accepted kinds: norm, embedding"),
    ("re:(open", "not a valid regular expression"),
    ("a..b", "empty path segment"),
    ("a.b**.c", "'\\*\\*' must be a whole path segment"),
    ("type:", "needs a class name"),
    ("knd:norm", "did you mean 'kind'"),
    ("", "non-empty"),
])
def test_bad_patterns(bad, message):
    with pytest.raises(ValueError, match=message):
        compile_pattern(bad)


def test_join_path_normalises_separators():
    assert join_path("encoder/layers_0/norm") == "encoder.layers_0.norm"
    assert join_path("encoder", "layers.0", "norm") == "encoder.layers.0.norm"
    assert join_path("") == ""


def test_join_path_drops_empty_segments_from_any_name():
    assert join_path("", "a") == join_path("a", "") == "a" and join_path("a/", "/b") == "a.b"
    assert join_path("a", "", "b") == join_path("a..b") == join_path(".a.b.") == "a.b"
    assert join_path(0, "layers", 3) == "0.layers.3"


@given(st.lists(st.one_of(st.text(alphabet="ab./", max_size=4), st.integers(0, 12)), max_size=5))
def test_join_path_is_split_on_both_separators_then_joined(names):
    expected = ".".join(p for n in names for p in str(n).replace("/", ".").split(".") if p)
    assert join_path(*names) == expected

"""A CPU LSTM whose own rule casts its inputs runs, and its row does not ask the user to cast them."""

import pytest

import ampbridge
import ampbridge._testing

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402
from ampbridge.backends.torch.environment import cpu_lstm_runs  # noqa: E402

nn = torch.nn


@pytest.mark.parametrize("enclosing", ["float32", "bfloat16"])
@pytest.mark.parametrize("lstm_dtype", ["float16", "bfloat16"])
def test_an_override_on_an_lstm_casts_its_inputs_and_says_so(enclosing, lstm_dtype):
    if enclosing == lstm_dtype or not cpu_lstm_runs(lstm_dtype, lstm_dtype):
        pytest.skip(f"no region change, or oneDNN has no {lstm_dtype} LSTM on this CPU")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 4, batch_first=True), )
    amp = abt.apply(model, ampbridge.Policy(compute_dtype=enclosing,
                                            overrides=(ampbridge.Rule("1", compute_dtype=lstm_dtype),)))
    note = amp.plan["1"].note or ""
    assert "pin it or feed" not in note
    if not abt.cpu_lstm_takes_float32_inputs(lstm_dtype):  # the note names the cast this CPU needs
        assert f"inputs cast to {lstm_dtype}" in note
    out, _ = model(torch.randn(2, 3, 4))  # runs: the region casts the float32 (or other) inputs
    assert out.dtype == torch.float32  # the model's output dtype (the policy's float32)
    assert amp.trace(torch.randn(2, 3, 4))["1"].compute_dtype == lstm_dtype


def test_without_a_region_change_the_row_still_asks_for_inputs():
    if abt.cpu_lstm_takes_float32_inputs("float16") or not cpu_lstm_runs("float16", "float16"):
        pytest.skip("this CPU's oneDNN takes float32 inputs under float16 autocast (or has no float16 LSTM)")
    row = abt.plan(nn.Sequential(nn.LSTM(4, 4)), ampbridge.Policy(compute_dtype="float16"), device_type="cpu")["0"]
    assert "needs float16 inputs on this CPU (oneDNN); pin it or feed float16" in row.note

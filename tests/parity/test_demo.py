"""`ampbridge demo` (the README's main job) trains in every framework and reports side by side."""

import importlib.util
import re

from ampbridge.cli.commands import main
from ampbridge._testing import require, required

for _name in ("torch", "keras", "jax", "flax", "optax", "jmp", "matplotlib"):
    require(_name)
if required("tf_keras"):
    require("tf_keras")
# tf.keras 2 is the fourth column where installed, trained in this same process beside Keras 3
FRAMEWORKS = ("torch", "keras", "jax") + (("tf_keras",) if importlib.util.find_spec("tf_keras") else ())


def test_demo_trains_everywhere_and_plots(tmp_path, capsys):
    png = tmp_path / "demo.png"
    assert main(["demo", "--steps", "12", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    names = ", ".join(FRAMEWORKS)
    assert f"== training 12 steps in {names}; step 4 gets an injected overflow" in out
    # the block's output is the one documented difference: torch carries the promoted float32 stream on
    assert f"Plan (identical in {names} but the output of block):" in out
    assert (f"  block: torch carries the promoted stream on (its row); {', '.join(FRAMEWORKS[1:])} cast the next "
            "layer's inputs") in " ".join(out.split("\n    "))
    assert max(len(line) for line in out.splitlines()) <= 120  # the Plan's notes are footnotes, its heading wrapped
    assert re.search(r"^4 +" + " +".join(["65536 skipped"] * len(FRAMEWORKS)) + r" *$", out, re.M)
    # the skipped column is a count with the steps it names (issue 23: "4" alone read as a count)
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^(torch|keras|jax|tf_keras)\s+(\S+)\s+1 \(step 4\)\s", out, re.M)}
    assert set(rows) == set(FRAMEWORKS)  # each skipped exactly step 4
    assert "Plan (torch):" not in out  # one Plan under the "identical" heading, not torch's
    assert "final losses agree to" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

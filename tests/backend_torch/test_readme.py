"""The README's torch example and its demo excerpt print what the README shows."""

import re
import subprocess
import sys
from pathlib import Path

from ampbridge.cli.commands import main
from ampbridge._testing import require

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
FINAL = re.compile(r"^step 29: loss (\d+\.\d{3}), loss scale (\d+)$")


def _block_after(marker: str, lang: str = "") -> str:
    """The first ``` block (of ``lang``) after ``marker``."""
    return README.split(marker, 1)[1].split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def _shown_lines_printed(shown: str, printed: str) -> None:
    """Every shown line is printed; a line cut with `` ...`` matches a printed line's start."""
    lines = printed.splitlines()
    for line in shown.splitlines():
        if line == "..." or FINAL.match(line):
            continue
        if line.endswith(" ..."):
            assert any(p.startswith(line[:-4]) for p in lines), f"no printed line starts {line[:-4]!r}"
        else:
            assert line in lines, f"{line!r} is not printed"


def test_readme_torch_example_trains_and_prints_the_plan_shown(tmp_path):
    require("torch")
    assert main(["init", str(tmp_path)]) == 0
    code = _block_after("Apply it to a PyTorch model", "python")
    (tmp_path / "example.py").write_text(code)
    proc = subprocess.run([sys.executable, "example.py"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after_code = README.split(code, 1)[1].removeprefix("```\n")
    shown = after_code.split("```\n", 1)[1].split("```", 1)[0]  # the output block right after the code
    _shown_lines_printed(shown, proc.stdout)
    # seeded: the loss scale grew 3 times from 65536 (no overflow in 30 steps); the loss is what
    # the README shows up to float16 rounding on another CPU
    want, got = FINAL.search(shown.rstrip().splitlines()[-1]), FINAL.match(proc.stdout.rstrip().splitlines()[-1])
    assert got and got.group(2) == want.group(2) == "524288"
    assert abs(float(got.group(1)) - float(want.group(1))) < 0.02


def test_readme_demo_excerpt_is_what_the_demo_prints(capsys):
    require("torch")
    require("numpy")
    assert main(["demo", "--frameworks", "torch", "--steps", "12"]) == 0
    out, err = capsys.readouterr()
    shown = _block_after("`ampbridge demo --frameworks torch --steps 12`, trimmed")
    final = [line for line in shown.splitlines() if line.startswith("torch  ")]
    _shown_lines_printed("\n".join(line for line in shown.splitlines() if line not in final), out + err)
    # the final row: the loss may differ in the last digits on another CPU; the skip and scale may not
    row = re.compile(r"^torch\s+(\d+\.\d+)\s+1 \(step 4\)\s+32768$")
    assert len(final) == 1 and row.match(final[0])
    printed = [m for m in map(row.match, out.splitlines()) if m]
    assert len(printed) == 1 and abs(float(printed[0].group(1)) - float(row.match(final[0]).group(1))) < 1e-3

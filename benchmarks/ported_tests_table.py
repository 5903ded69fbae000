"""Run the peers' ported loss-scale tests and rewrite their table in docs/porting.md.

    PYTHONPATH=$PWD python benchmarks/ported_tests_table.py            # run, print and rewrite the table
    PYTHONPATH=$PWD python benchmarks/ported_tests_table.py --check    # run and print only

Each port file is run by pytest with ``--junitxml``; every collected item is one upstream test (one
parameterisation). ampbridge's own checks in those files (after the "ampbridge's own check" comment,
or named in OWN) are left out. A test skipped as "not applicable: ..." counts as not applicable; one
skipped as "not applicable from here on: ..." ran every assertion before that one and counts as
applicable and passing, said in the last column; any other skip is upstream's own (a backend it
skips) and counts as not applicable too.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "porting.md"
START, END = "<!-- ported-tests-table:start -->", "<!-- ported-tests-table:end -->"

#: (peer file, port file, environment) in table order
PORTS = (
    ("DeepSpeed tests/unit/runtime/half_precision/test_dynamic_loss_scale.py", "tests/backend_torch/test_deepspeed_ported.py", "test_D_"),
    ("DeepSpeed tests/unit/runtime/half_precision/test_zero_optim_overflow.py", "tests/backend_torch/test_deepspeed_ported.py", "test_Z_"),
    ("DeepSpeed tests/unit/runtime/test_precision_config_dynamic_scale.py", "tests/backend_torch/test_deepspeed_ported.py", "test_P1_"),
    ("DeepSpeed tests/unit/runtime/test_precision_config_loss_scale.py", "tests/backend_torch/test_deepspeed_ported.py", "test_P2_"),
    ("optax optax/transforms/_conditionality_test.py", "tests/backend_jax/test_optax_ported.py", ""),
    ("jmp jmp/_src/loss_scale_test.py", "tests/backend_jax/test_jmp_ported.py", ""),
    ("PyTorch GradScaler tests (test_torch.py, test_cuda.py)", "tests/backend_torch/test_gradscaler_ported.py", ""),
    ("Keras keras/src/optimizers/loss_scale_optimizer_test.py (KERAS_BACKEND=jax)",
     "tests/backend_keras/test_lso_ported.py", ""),
)
#: ampbridge's own checks in files without the marker comment
OWN = {"tests/backend_keras/test_lso_ported.py": ("test_upscaling_through_a_policy",
                                                   "test_serialization_of_settings_keras_cannot_run")}
FLAX_ROW = ("| Flax DynamicScale (google/flax 0.12.8) | 0 | 0 | 0 | 0 | google/flax has no DynamicScale test at "
            "0.12.8 (its tests/ holds none); see the note below |")


def own_tests(path: str) -> set[str]:
    names, own = set(OWN.get(path, ())), False
    for line in (ROOT / path).read_text().splitlines():
        if line.startswith("# ---") and "ampbridge's own check" in line:
            own = True
        m = re.match(r"def (test_\w+)\(", line)
        if m and own:
            names.add(m[1])
    return names


def run(paths: list[str]) -> dict[str, list[tuple[str, str, str]]]:
    """Per file: (test name, outcome, skip message) for each item pytest ran."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KERAS_BACKEND": "jax"}
    for path in dict.fromkeys(paths):
        with tempfile.TemporaryDirectory() as tmp:
            xml = Path(tmp) / "r.xml"
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path,
                            f"--junitxml={xml}"], cwd=ROOT, env=env, check=False, capture_output=True)
            rows = []
            for case in ET.parse(xml).getroot().iter("testcase"):
                outcome, message = "passed", ""
                for child in case:
                    if child.tag in ("failure", "error"):
                        outcome = "failed"
                    elif child.tag == "skipped":
                        outcome, message = "skipped", child.get("message", "")
                rows.append((case.get("name", ""), outcome, message))
            out[path] = rows
    return out


def table(results: dict[str, list[tuple[str, str, str]]]) -> str:
    lines = ["| peer file | total | applicable | passing | failing | notes |", "|---|---|---|---|---|---|"]
    for peer, path, prefix in PORTS:
        own = own_tests(path)
        rows = [r for r in results[path] if r[0].split("[")[0] not in own and r[0].startswith(prefix)]
        partly = [r for r in rows if r[1] == "skipped" and "not applicable from here on" in r[2]]
        na = [r for r in rows if r[1] == "skipped" and r not in partly]
        applicable = len(rows) - len(na)
        passing = sum(r[1] == "passed" for r in rows) + len(partly)
        failing = sum(r[1] == "failed" for r in rows)
        notes = []
        if na:
            notes.append(f"{len(na)} not applicable (reasons in `{Path(path).name}`)")
        if partly:
            notes.append(f"{len(partly)} ran up to an assertion with no ampbridge counterpart (named there)")
        lines.append(f"| {peer} | {len(rows)} | {applicable} | {passing} | {failing} | {'; '.join(notes) or '-'} |")
    lines.append(FLAX_ROW)
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print the table, do not rewrite docs/porting.md")
    args = parser.parse_args()
    text = table(run([p for _, p, _ in PORTS]))
    print(text)
    if not args.check:
        doc = DOC.read_text()
        start, end = doc.index(START) + len(START), doc.index(END)
        DOC.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every command against every kind of bad input: the exit code, one line on stderr, no traceback.

Exit 1 for a bad or unreadable input (missing, a directory, empty, binary, an output that cannot
be written, an environment variable naming no policy), 2 for bad usage; a byte-order mark is no
error at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ampbridge.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "ampbridge" / "examples"
LOG = [{"kind": "run", "version": 1, "framework": "torch", "compute_dtype": "float16", "layers": ["a"],
        "min_scale": 1.0},
       {"kind": "step", "step": 0, "loss": 1.0, "loss_scale": 2.0, "found_inf": False, "skipped": False}]

# command -> (argv with {input} where the file goes, valid content of that file, suffix, argv with {out} for an output)
COMMANDS = {
    "validate": (["validate", "{input}"], (EXAMPLES / "amp.toml").read_text(), ".toml", None),
    "show": (["show", "{input}"], (EXAMPLES / "amp.toml").read_text(), ".toml", None),
    "explain": (["explain", "{input}", "--layers", str(EXAMPLES / "layers.json")], (EXAMPLES / "amp.toml").read_text(),
                ".toml", None),
    "explain --layers": (["explain", str(EXAMPLES / "amp.toml"), "--layers", "{input}"],
                         (EXAMPLES / "layers.json").read_text(), ".json", None),
    "convert": (["convert", "{input}", "--to", "lightning"], (EXAMPLES / "amp.toml").read_text(), ".toml",
                ["convert", str(EXAMPLES / "amp.toml"), "--to", "ampbridge", "-o", "{out}"]),
    "check": (["check", "{input}", "--against", "lightning:16-mixed"], 'extends = "mixed_float16"\n', ".toml", None),
    "check --against": (["check", "mixed_float16", "--against", "{input}"], "mixed_precision: fp16\n", ".yaml", None),
    "report": (["report", "{input}"], "\n".join(json.dumps(r) for r in LOG) + "\n", ".jsonl",
               ["report", "{input}", "--plot", "{out}"]),
    "demo": (["demo", "{input}", "--frameworks", "none"], (EXAMPLES / "amp.toml").read_text(), ".toml",
             None),  # --plot with nothing to train is refused before the directory is looked at (test_first_hour)
    "formats": (["formats"], None, None, None),
    "schema": (["schema"], None, None, None),
    "doctor": (["doctor", "--frameworks", "none-such"], None, None, None),  # "missing": an unknown name
}
CASES = ("missing", "directory", "empty", "binary", "bom", "unwritable", "bad usage", "env policy")


def _argv(template: list[str], **values: str) -> list[str]:
    return [a.format(**values) for a in template]


def _run(capsys, argv: list[str]) -> tuple[int, list[str]]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's exit for bad usage
        code = int(e.code or 0)
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()]


def _applies(command: str, case: str) -> bool:
    _, content, _, output = COMMANDS[command]
    if case in ("missing", "directory", "empty", "binary", "bom"):
        return content is not None or (command == "doctor" and case == "missing")
    if case == "unwritable":
        return output is not None
    return True


@pytest.mark.parametrize("command, case", [(c, k) for c in COMMANDS for k in CASES if _applies(c, k)])
def test_every_bad_input_is_one_line(command, case, tmp_path, capsys, monkeypatch):
    template, content, suffix, output = COMMANDS[command]
    takes_file = content is not None
    path = tmp_path / f"input{suffix or ''}"
    expected = 1
    if case == "missing" and takes_file:
        argv = _argv(template, input=str(path))
    elif case == "directory" and takes_file:
        path.mkdir()
        argv = _argv(template, input=str(path))
    elif case == "empty" and takes_file:
        path.write_text("")
        argv = _argv(template, input=str(path))
    elif case == "binary" and takes_file:
        path.write_bytes(bytes(range(128, 256)) * 4)
        argv = _argv(template, input=str(path))
    elif case == "bom" and takes_file:
        path.write_bytes(b"\xef\xbb\xbf" + content.encode())
        argv, expected = _argv(template, input=str(path)), 0
    elif case == "unwritable" and output is not None:
        if takes_file:
            path.write_text(content)
        argv = _argv(output, input=str(path), out=str(tmp_path / "no" / "such" / "dir" / "out.png"))
    elif case == "bad usage":
        argv, expected = [template[0], "--no-such-option"], 2
    elif case == "env policy":
        monkeypatch.setenv("AMPBRIDGE_POLICY", str(tmp_path / "nosuch.toml"))
        if takes_file:
            path.write_text(content)
        argv = _argv(template, input=str(path))
        # only commands that plan a model apply the bisect switch; the others ignore it
        expected = 1 if command.startswith("explain") else 0
        if command == "doctor":
            argv = ["doctor", "--frameworks", "torch"]
    elif command == "doctor" and case == "missing":
        argv, expected = template, 2  # an unknown framework name is bad usage
        case = "bad usage"
    else:
        raise AssertionError(f"{command} x {case}: no such case")
    code, err = _run(capsys, argv)
    assert code == expected, (argv, err)
    assert not any("Traceback" in line for line in err), err
    if expected:
        problems = [line for line in err if not line.startswith(("lost:", "note:", "warning:"))
                    and "could not be expressed" not in line]
        assert len(problems) == 1, err
        if case == "env policy":
            assert "AMPBRIDGE_POLICY" in problems[0]
        elif case in ("missing", "directory", "empty", "binary"):
            assert str(path) in problems[0] or path.name in problems[0], problems[0]

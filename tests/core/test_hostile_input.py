"""Hostile input is bounded: each case ends in one line and exit 1 (or 130 for Ctrl-C), with little memory.

| case                                          | exit | the line says                                   |
|-----------------------------------------------|------|-------------------------------------------------|
| YAML alias bomb, 460 bytes (9 levels x 9)     | 1    | expands to more than 100000 values ... aliases  |
| JSON nested 100,000 deep                      | 1    | nests too deep to read                          |
| JSON nested 500 deep (parses)                 | 1    | nests deeper than 32 levels                     |
| TOML nested 100,000 deep                      | 1    | nests too deep to read                          |
| growth_interval = 99999999999999999999        | 1    | out of range ... 1 to 2147483647                |
| Ctrl-C while the command waits                | 130  | interrupted                                     |

Peak memory of each child process is asserted under 200 MB (the alias bomb grew to 19 GB before).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

CASES = {
    "yaml-alias-bomb": ("bomb.yaml", "\n".join(
        ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
        + [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]) + "\n",
        "expands to more than 100000 values through YAML aliases"),
    "json-100000-deep": ("deep.json", "[" * 100000 + "]" * 100000, "nests too deep to read"),
    "json-500-deep": ("deep2.json", '{"version": 1, "keep_float32": ' + "[" * 500 + "]" * 500 + "}",
                      "nests deeper than 32 levels"),
    "toml-100000-deep": ("deep.toml", "x = " + "[" * 100000 + "]" * 100000 + "\n", "nests too deep to read"),
    "huge-integer": ("big.toml", "[loss_scale]\ngrowth_interval = 99999999999999999999\n",
                     "loss_scale.growth_interval: out of range; received 99999999999999999999"),
}


# the child's own peak: /proc's VmHWM belongs to the memory image exec made (getrusage's ru_maxrss
# survives exec, so a child forked from a large pytest process would report the parent's size)
_CHILD = """
import atexit, sys
def peak():
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return line.split()[1]
    except OSError:
        pass
    return "0"  # no /proc (not Linux): the memory bound is not measured
atexit.register(lambda: open(sys.argv[1], "w").write(peak()))
from ampbridge.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _run(argv, tmp_path):
    """The command in a child process; (its result, its own peak resident memory in KB)."""
    peak = tmp_path / "peak"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(peak), *argv], capture_output=True, text=True,
                          timeout=120)
    return proc, int(peak.read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_refused_in_one_line_with_bounded_memory(case, tmp_path):
    pytest.importorskip("yaml")
    name, text, says = CASES[case]
    path = tmp_path / name
    path.write_text(text)
    proc, peak_kb = _run(["validate", str(path)], tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert says in proc.stderr and str(path) in proc.stderr
    assert peak_kb < 200_000 or not os.path.exists("/proc/self/status"), f"{case}: {peak_kb} KB"


def test_loading_in_code_raises_the_policy_error():
    import ampbridge

    with pytest.raises(ampbridge.PolicyError, match="nests too deep to read"):
        ampbridge.loads("[" * 100000 + "]" * 100000, format="json")


def _wait_until_blocked_on_the_pipe(pid, limit=60.0):
    """Until the process sleeps opening the named pipe (Linux: /proc/PID/wchan), so the Ctrl-C lands
    there and not in the interpreter's start-up on a loaded machine; elsewhere a fixed 3 s."""
    wchan = f"/proc/{pid}/wchan"
    if not os.path.exists(wchan):
        time.sleep(3)
        return
    end = time.monotonic() + limit
    while time.monotonic() < end:
        with open(wchan) as f:
            if f.read().strip() == "wait_for_partner":  # the kernel's fifo open, waiting for a writer
                return
        time.sleep(0.05)
    raise AssertionError(f"ampbridge validate did not reach the named pipe in {limit:g} s")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a named pipe to block on")
def test_ctrl_c_ends_a_command_with_one_line_and_130(tmp_path):
    fifo = tmp_path / "policy.toml"
    os.mkfifo(fifo)  # validate blocks opening it until a writer comes: Ctrl-C lands there
    # as a terminal's foreground job gets it: SIGINT at its default (a background job of a non-interactive
    # shell inherits it ignored, and Python then leaves it ignored: the Ctrl-C would never arrive)
    proc = subprocess.Popen([sys.executable, "-m", "ampbridge", "validate", str(fifo)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_until_blocked_on_the_pipe(proc.pid)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == "ampbridge validate: interrupted\n" and out == ""

"""One Python process with 8 CPU devices, kept by a pytest process while it runs, that evaluates calls of test
modules' functions: the interpreted Mosaic GPU kernels' cases (``test_mla_decode_mgpu._in_subprocess``
says why they need a process of their own with that many devices).

One such process serves every case of a pytest process in turn, rather than one process a case:
each case skips the start-up and import of jax and reuses what earlier cases compiled. The calls
are functions of their arguments that leave no module state changed, so a case computes what it
would in a fresh process. A call that raises fails its test with the traceback; one that runs past
its timeout, or a process that dies, fails its test, and the next call starts a new process.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import selectors
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The server: a JSON request a line on stdin ({"module", "call"}), a JSON answer a line on a
# private copy of stdout ({"result"} or {"error": traceback}); what the calls print goes to stderr.
_SERVER = f"""
import importlib, json, os, sys, traceback
sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
for line in sys.stdin:
    request = json.loads(line)
    try:
        module = importlib.import_module(request["module"])
        answer = {{"result": eval(request["call"], vars(module))}}
    except BaseException:
        answer = {{"error": traceback.format_exc()}}
    answers.write(json.dumps(answer) + "\\n")
    answers.flush()
"""


class _Process:
    def __init__(self):
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu")
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], env=env, text=True, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr)

    def stderr_tail(self) -> str:
        self.stderr.seek(max(0, self.stderr.seek(0, os.SEEK_END) - 3000))
        return self.stderr.read().decode(errors="replace")

    def call(self, module: str, call: str, timeout: float):
        """(True, result) or (False, what went wrong); False also when the process must go."""
        try:
            self.proc.stdin.write(json.dumps({"module": module, "call": call}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return False, f"the interpreter process is gone:\n{self.stderr_tail()}"
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout
            if not sel.select(max(0.0, deadline - time.monotonic())):
                return False, f"{call} ran past {timeout} s (a hang?):\n{self.stderr_tail()}"
        line = self.proc.stdout.readline()
        if not line:
            return False, f"the interpreter process died (exit code {self.proc.wait()}):\n{self.stderr_tail()}"
        answer = json.loads(line)
        if "error" in answer:
            return None, answer["error"]
        return True, answer["result"]

    def close(self):
        self.proc.kill()
        self.proc.wait()
        self.stderr.close()


_process: _Process | None = None


def _close():
    global _process
    if _process is not None:
        _process.close()
        _process = None


atexit.register(_close)


def evaluate(module: str, call: str, timeout: float = 600):
    """``call`` (a call of a function of the test module ``module``, python source) evaluated in the
    process with 8 CPU devices that this pytest process keeps; returns its result (JSON-encodable). Fails the calling
    test with the traceback if it raises, or if it runs past ``timeout`` seconds or the process dies
    (the process is then replaced)."""
    global _process
    import pytest

    if _process is None:
        _process = _Process()
    ok, value = _process.call(module, call, timeout)
    if ok is False:
        _close()
    if not ok:
        pytest.fail(value, pytrace=False)
    return value

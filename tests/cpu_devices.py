"""Running Python in a fresh process that sees several CPU devices: XLA reads the device
count once, at start-up, so a test process cannot grow its own."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_with_cpu_devices(count: int, args, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python *args`` (e.g. ``["-c", code, ...]`` or ``["-m", module, ...]``) with ``count`` CPU
    devices and the repository on the path; output captured as text."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={count}", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    """A TCP port nothing listens on now (for a ``jax.distributed`` coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(count: int, code: str, *args, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """``python -c code PROCESS_ID COUNT PORT *args`` in ``count`` processes at once, one CPU device each,
    for a ``jax.distributed`` run of ``count`` processes coordinated on localhost:PORT; their
    outputs captured as text, in process order."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i), str(count), port, *map(str, args)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(count)]
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results

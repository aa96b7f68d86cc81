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

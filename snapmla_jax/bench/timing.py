"""Timing and ceilings shared by the benchmarks.

Device work is asynchronous: every sample ends in ``block_until_ready``. Each
measurement warms up first (compilation, autotuning), then takes ``iters``
samples of ``inner`` back-to-back calls (so that the host's dispatch overlaps
the device's work instead of adding a synchronisation per call) and reports the
median per-call time in milliseconds. Inputs are rotated
among several copies where the benchmark asks, so that repeated runs do not
measure the L2 cache.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import pathlib
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp


def time_ms(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, warmup: int = 3, iters: int = 20,
            inner: int = 10) -> float:
    """Median time in ms of one ``fn(*args)`` call, cycling through ``arg_sets``.

    Each of ``iters`` samples runs ``inner`` calls back to back and synchronises once.
    """
    warm_up(fn, arg_sets, warmup)
    return statistics.median(sample_ms(fn, arg_sets, iters=iters, inner=inner))


def warm_up(fn: Callable[..., Any], arg_sets: Sequence[tuple], calls: int) -> None:
    """``calls`` synchronised calls of ``fn`` (compilation, autotuning, module load)."""
    for i in range(calls):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))


def sample_ms(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, iters: int, inner: int = 10,
              first: int = 0) -> list[float]:
    """``iters`` samples (ms a call) of ``inner`` back-to-back calls each, synchronised once,
    cycling through ``arg_sets`` from call ``first``."""
    samples = []
    for i in range(iters):
        start = time.perf_counter()
        out = None
        for j in range(inner):
            out = fn(*arg_sets[(first + i * inner + j) % len(arg_sets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) * 1e3 / inner)
    return samples


def time_round_robin(runs: dict[str, tuple[Callable[..., Any], Sequence[tuple]]], *, rounds: int | None = None,
                     warmup: int = 2, iters: int = 10, inner: int = 10,
                     min_sample_ms: float = 0.0) -> dict[str, float | Exception]:
    """Median time in ms of one call of each of ``runs`` (name -> (fn, arg_sets)), measured
    side by side: every run is warmed up first, then ``rounds`` rounds (None: ``iters``, one
    sample a round) each take ceil(``iters`` / ``rounds``) samples (``sample_ms``) of every run
    in turn, in an order shuffled from round to round. A drift of the GPU's clocks or temperature
    over the measurement then falls on all runs alike, which times taken one run after the
    other do not ensure (H100, B=64 x 16k x 128: the BF16 twin measured 0.673 and 0.708 ms in
    two runs of the decode benchmark, the FP8 kernel 0.437 and 0.428). The drift is fast: an
    H100 under its software power cap (nvidia-smi clock event reason 0x4) moved its SM clock
    between 1740 and 1980 MHz within 0.5 s, and samples of one FP8 decode call (128 x 16k x
    128) from 0.76 to 0.87 ms over consecutive samples; so by default
    each round takes a single sample of each run. A run whose warm-up raises gets its
    exception instead of a time, and the others go on.

    A sample runs at least ``inner`` calls, and more if one sample of ``inner`` (taken after the
    warm-up, not counted) lasted under ``min_sample_ms``: enough that it lasts about that long.
    What a sample pays once, the host's dispatch before the GPU starts and the synchronisation
    at its end, is then a small share of each call (H100, the FP8 decode path at 32 x 16k x 128:
    ~50 us of host time between its first two launches on a sample's first call, ~5 us a call
    in samples of 10)."""
    rounds = iters if rounds is None else rounds
    per_round = -(-iters // rounds)
    samples: dict[str, list[float] | Exception] = {}
    calls: dict[str, int] = {}
    for name, (fn, arg_sets) in runs.items():
        try:
            warm_up(fn, arg_sets, warmup)
            samples[name] = []
        except Exception as err:  # reported by the caller
            samples[name] = err
            continue
        calls[name] = inner
        if min_sample_ms > 0:
            (probe_ms,) = sample_ms(fn, arg_sets, iters=1, inner=inner)
            calls[name] = max(inner, math.ceil(min_sample_ms / max(probe_ms, 1e-6)))
    timed = list(calls)  # the runs that warmed up, in order
    for r in range(rounds):
        # Each round in its own order (seeded: repeatable): a run's samples then follow different
        # runs. A fixed rotation puts each run after the same one in nearly every round, and the
        # GPU's clock after a sample depends on what that sample ran (its power draw).
        order = list(timed)
        random.Random(r).shuffle(order)
        for name in order:
            fn, arg_sets = runs[name]
            samples[name] += sample_ms(fn, arg_sets, iters=per_round, inner=calls[name],
                                       first=r * per_round * calls[name])
    return {name: s if isinstance(s, Exception) else statistics.median(s) for name, s in samples.items()}


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Rates measured on this device in this run: the roofline's two axes."""

    copy_gbps: float  # device-to-device copy, bytes read + written per second / 1e9
    bf16_tflops: float  # XLA bf16 GEMM
    fp8_tflops: float  # XLA e4m3 GEMM (bf16 out)



class GpuEvent(NamedTuple):
    """One GPU activity of a profiler trace (a kernel, a memset, a copy)."""
    line: str  # the trace line (a stream)
    name: str
    start_ns: int
    duration_ns: int


def gpu_events(fn: Callable[..., Any], args: tuple, *, calls: int = 3) -> list[GpuEvent]:
    """The GPU activities of ``calls`` warm ``fn(*args)`` calls run back to back under the JAX
    profiler, by start time (none on a machine without a GPU)."""
    jax.block_until_ready(fn(*args))  # compiled and warm before the trace
    return traced_events(lambda: [fn(*args) for _ in range(calls)][-1])


def traced_events(body: Callable[[], Any]) -> list[GpuEvent]:
    """The GPU activities of ``body()`` (whose result is waited for) under the JAX profiler, by
    start time (none on a machine without a GPU)."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(body())
        [path] = pathlib.Path(trace_dir).rglob("*.xplane.pb")
        planes = ProfileData.from_file(str(path)).planes
    events = [GpuEvent(line.name, event.name, event.start_ns, event.duration_ns)
              for plane in planes if plane.name.startswith("/device:GPU")
              for line in plane.lines for event in line.events]
    return sorted(events, key=lambda e: e.start_ns)


def kernel_us_by_call(events: Sequence[GpuEvent], order: Sequence[str], kernel: str) -> dict[str, list[float]]:
    """Durations in us of the launch of ``kernel`` (a substring of its name) of each call, by the
    name in ``order`` of the run that made it: ``events`` are a trace's (``traced_events``) of
    calls made in that order on one stream, each launching ``kernel`` once. An activity the trace
    repeats on another line (same name and start) counts once."""
    launches = sorted({(e.name, e.start_ns): e for e in events if kernel in e.name}.values(),
                      key=lambda e: e.start_ns)
    if len(launches) != len(order):
        raise ValueError(f"kernel: expected one launch of {kernel!r} a call ({len(order)}), the trace has "
                         f"{len(launches)}" + (" (no GPU activity: is there a GPU?)" if not events else ""))
    durations: dict[str, list[float]] = {name: [] for name in dict.fromkeys(order)}
    for name, launch in zip(order, launches):
        durations[name].append(launch.duration_ns / 1e3)
    return durations


def interleaved_kernel_us(runs: dict[str, tuple[Callable[..., Any], tuple]], *, kernel: str, rounds: int = 25,
                          warmup: int = 3) -> dict[str, float]:
    """Median GPU duration in us of ``kernel``'s launch (a substring of its name) in each of
    ``runs`` (name -> (fn, args), each call launching it once), from one profiler trace of
    ``rounds`` rounds, each calling every run once in an order shuffled per round, back to back.

    The kernels' own durations, side by side under the same clocks: what wall-clock samples
    (``time_round_robin``) cannot separate from the launches around a kernel, and from the clock
    a sample inherits from the one before it. On an H100 under its power cap two FP8 kernels
    4% apart here (32 x 16k and 64k x 128) measured wall-clock ratios from 1.00 to 1.05 over
    12 medians of round-robin runs.
    """
    for fn, args in runs.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    order = []
    for r in range(rounds):
        names = list(runs)
        random.Random(r).shuffle(names)
        order += names

    def body():
        for name in order:  # one stream: the last call's result is ready once all are
            result = runs[name][0](*runs[name][1])
        return result

    durations = kernel_us_by_call(traced_events(body), order, kernel)
    return {name: statistics.median(values) for name, values in durations.items()}


def kernel_totals_us(events: Sequence[GpuEvent], calls: int) -> dict[str, float]:
    """GPU time in us a call of each kernel (by name) in ``events`` of ``calls`` calls; largest first."""
    totals: dict[str, float] = {}
    for event in events:
        totals[event.name] = totals.get(event.name, 0.0) + event.duration_ns / 1e3 / calls
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def timeline_us(events: Sequence[GpuEvent], calls: int) -> dict[str, float]:
    """Where the GPU's time went over ``events`` of ``calls`` back-to-back calls, us a call:
    span (first start to last end), busy (the union of the activities' intervals) and idle
    (span - busy: the gaps between launches, which kernel durations alone do not show)."""
    if not events:
        return {"span": 0.0, "busy": 0.0, "idle": 0.0}
    busy, end = 0, None
    for event in sorted(events, key=lambda e: e.start_ns):
        stop = event.start_ns + event.duration_ns
        if end is None or event.start_ns >= end:
            busy += event.duration_ns
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = max(e.start_ns + e.duration_ns for e in events) - min(e.start_ns for e in events)
    return {"span": span / 1e3 / calls, "busy": busy / 1e3 / calls, "idle": (span - busy) / 1e3 / calls}


def kernel_times_us(fn: Callable[..., Any], args: tuple, *, calls: int = 3) -> dict[str, float]:
    """GPU time in us of each kernel (by name) one ``fn(*args)`` call launches, from the JAX
    profiler: ``calls`` warm calls traced, each kernel's durations summed and divided by
    ``calls``; largest first. For launches of 1-10 us, where a wall-clock median would
    measure the host's dispatch."""
    return kernel_totals_us(gpu_events(fn, args, calls=calls), calls)


def measure_copy_gbps(nbytes: int = 2 << 30) -> float:
    """Bandwidth of a large device-to-device copy (read + write), GB/s."""
    n = nbytes // 4
    srcs = [jax.random.normal(jax.random.key(i), (n,), jnp.float32) for i in range(2)]
    copy = jax.jit(lambda x: x * 1.0000001)  # one read and one write per element
    ms = time_ms(copy, [(s,) for s in srcs], warmup=2, iters=10)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


# Operand layouts of the ceiling GEMM, as dot_general contracting dims of (A, B): B as
# [K, N], and B as [N, K]. Hopper's 8-bit wgmma takes both operands K-major only, so an
# FP8 GEMM may run at another rate (or through another library) in each; the ceiling is
# the faster one.
GEMM_LAYOUTS = {"b_kn": ((1,), (0,)), "b_nk": ((1,), (1,))}


def gemm_programs(dtype, size: int) -> dict[str, tuple[Callable[..., Any], tuple]]:
    """Per ``GEMM_LAYOUTS`` entry, a jitted ``size``^3 product with ``dtype`` operands (bf16
    result) and its random arguments: ``fn(*args)`` is A @ B in every layout."""
    keys = jax.random.split(jax.random.key(1), 2)
    a = jax.random.normal(keys[0], (size, size), jnp.float32).astype(dtype)
    b = jax.random.normal(keys[1], (size, size), jnp.float32).astype(dtype)
    programs = {}
    for name, contracting in GEMM_LAYOUTS.items():
        mm = jax.jit(functools.partial(jax.lax.dot_general, dimension_numbers=(contracting, ((), ())),
                                       preferred_element_type=jnp.bfloat16))
        programs[name] = (mm, (a, b if contracting[1] == (0,) else b.T))
    return programs


def measure_gemm_tflops(dtype, size: int = 8192) -> float:
    """Rate of the faster of the ``GEMM_LAYOUTS`` XLA ``size``^3 GEMMs with ``dtype`` operands
    (bf16 result), TFLOP/s."""
    best_ms = min(time_ms(fn, [args], warmup=2, iters=10) for fn, args in gemm_programs(dtype, size).values())
    return 2 * size**3 / (best_ms * 1e-3) / 1e12


def measure_ceilings() -> Ceilings:
    return Ceilings(copy_gbps=measure_copy_gbps(), bf16_tflops=measure_gemm_tflops(jnp.bfloat16),
                    fp8_tflops=measure_gemm_tflops(jnp.float8_e4m3fn))


def missing_gpu(program: str, what: str = "needs a CUDA GPU") -> bool:
    """True, after "``program``: ``what``" on stderr, when the default backend is not a GPU:
    the benchmarks then exit with status 2."""
    if jax.default_backend() == "gpu":
        return False
    print(f"{program}: {what}", file=sys.stderr)
    return True


def command_text(program: str, argv: Sequence[str]) -> str:
    """The command line a results table names: ``program`` and ``argv`` without where the results
    went (--out DIR, --out=DIR, --publish), after XLA_PYTHON_CLIENT_MEM_FRACTION where it is set
    (it decides what fits beside the weights)."""
    words, skip = [], False
    for word in map(str, argv):
        if skip:
            skip = False
        elif word == "--out":
            skip = True
        elif word != "--publish" and not word.startswith("--out="):
            words.append(word)
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    return " ".join([*([f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction}"] if fraction else []), program, *words])


def environment() -> dict[str, str]:
    """Device, software versions and date, to stamp every table."""
    dev = jax.devices()[0]
    return {
        "device": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def write_results(out_dir: str | pathlib.Path, name: str, env: dict, rows: list[dict], markdown: str) -> None:
    """Save ``rows`` as ``{name}.json`` and ``markdown`` as ``{name}.md`` under ``out_dir``."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    (out / f"{name}.md").write_text(markdown)


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"

"""The roofline's ceilings on this GPU, each way we can reach them: XLA per operand layout, and cuBLAS.

    python scripts/measure_ceilings.py --out $OUT [--sizes 4096 8192]

The decode benchmarks divide by ``timing.measure_ceilings()`` (XLA GEMMs, the faster
of ``timing.GEMM_LAYOUTS``). This script shows what that leaves out: each XLA layout's
own rate, and torch's cuBLAS rates for the same products (``torch.matmul`` for bf16,
``torch._scaled_mm`` for e4m3 with unit scales, bf16 out), when torch sees a GPU. A
roofline quoted against the XLA ceiling is only honest if cuBLAS is not much faster;
this is the check. Writes ceilings.json under --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax.numpy as jnp

from snapmla_jax.bench import timing


def xla_rates(dtype, size: int) -> dict[str, float]:
    """TFLOP/s of each ``timing.GEMM_LAYOUTS`` program for a ``size``^3 product."""
    rates = {}
    for name, (fn, args) in timing.gemm_programs(dtype, size).items():
        ms = timing.time_ms(fn, [args], warmup=2, iters=10)
        rates[name] = 2 * size**3 / (ms * 1e-3) / 1e12
    return rates


def cublas_rates(size: int, iters: int = 20) -> dict[str, float] | None:
    """TFLOP/s of torch's bf16 matmul and e4m3 ``_scaled_mm`` (median of CUDA-event timings of
    10 back-to-back calls each), or None without torch or a CUDA device."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    a = torch.randn(size, size, device="cuda")
    b = torch.randn(size, size, device="cuda")
    one = torch.ones((), device="cuda")
    products = {
        "bf16": lambda x=a.bfloat16(), y=b.bfloat16(): x @ y,
        # _scaled_mm takes its second operand column-major: K-major for both, as wgmma wants.
        "fp8": lambda x=a.to(torch.float8_e4m3fn), y=b.to(torch.float8_e4m3fn).t().contiguous().t():
            torch._scaled_mm(x, y, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
    }
    rates = {}
    for name, product in products.items():
        for _ in range(3):
            product()
        samples = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                product()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 10)
        samples.sort()
        rates[name] = 2 * size**3 / (samples[len(samples) // 2] * 1e-3) / 1e12
    return rates


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/measure_ceilings")
    parser.add_argument("--sizes", type=int, nargs="*", default=[4096, 8192])
    args = parser.parse_args(argv)
    if timing.missing_gpu("measure_ceilings"):
        return 2
    result = {"environment": timing.environment(), "copy_gbps": timing.measure_copy_gbps(), "sizes": {}}
    for size in args.sizes:
        entry = {"xla_bf16": xla_rates(jnp.bfloat16, size), "xla_fp8": xla_rates(jnp.float8_e4m3fn, size),
                 "cublas": cublas_rates(size)}
        result["sizes"][str(size)] = entry
        print(size, json.dumps(entry), flush=True)
    print("copy GB/s", round(result["copy_gbps"], 1))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ceilings.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

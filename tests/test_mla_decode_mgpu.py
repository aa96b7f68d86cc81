"""The Mosaic GPU FP8 decode kernels (pallas_kernels/mla_decode_mgpu.py, mla_decode_mgpu_small.py).

CPU: the kernels lower for CUDA (Mosaic GPU layout
inference and SMEM allocation run without a GPU), and the interpreter runs the
kernel against ``mla_decode_reference(..., block_n=128)``. The interpreter
neither aliases ``RefUnion`` views nor runs inline PTX, so there the kernel
keeps V token-major and P' unpacked: the V transpose, the byte packing
(``mgpu_bytes``) and the RoPE product accumulated onto the FP8 scores are
checked on the GPU only (``pytest -m gpu``), by the same cases compiled.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import snapmla_jax.pallas_kernels.mla_decode_mgpu as mgpu_kernel
from snapmla_jax.pallas_kernels.fp8 import quantize_per_token
from snapmla_jax.pallas_kernels.mla_decode_reference import mla_decode_reference
import interpreter_process
from script_loader import load_script
from snapmla_jax.backend import lower_for_cuda

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_step_profile_summary_times_phases_per_warpgroup():
    """tools/profile_mgpu_steps.py's summary of an on-device profiler trace (Chrome events, one
    trace a warpgroup, ts in SM clocks / 1000): per warpgroup the median over CTAs of each phase's
    cycles a step, over the steps after the first two and before the last; a phase nested in
    another is reported and not summed twice."""
    profile = load_script("profile_mgpu_steps", "tools")
    rng = np.random.default_rng(0)
    phases = {0: {"wait_step": 300.0, "qk": 1700.0, "pv": 2000.0}, 1: {"wait_step": 90.0, "qk": 1800.0, "pv": 2100.0}}
    nested = {1: ("wait_step", "issue", 60.0)}  # warpgroup 1's issue, from the start of its wait_step
    traces, num_ctas, num_steps = [], 3, 9
    for cta in range(num_ctas):
        for wg in range(2):
            tid, t = 1 + wg + 2 * cta, 1000.0 * (cta + 1)
            events = [{"name": "Init", "ph": "B", "ts": t / 1e3, "tid": tid}]
            for step in range(num_steps):
                # The first two steps and the last (prologue, epilogue) are slower: not counted.
                slow = 5.0 if step < 2 or step == num_steps - 1 else 1.0
                for name, cycles in phases[wg].items():
                    events.append({"name": name, "ph": "B", "ts": t / 1e3, "tid": tid})
                    if wg in nested and nested[wg][0] == name:
                        inner = nested[wg][1]
                        events.append({"name": inner, "ph": "B", "ts": t / 1e3, "tid": tid})
                        events.append({"name": inner, "ph": "E", "tid": tid,
                                       "ts": (t + nested[wg][2] * slow * (1 + 0.01 * cta)) / 1e3})
                    t += cycles * slow * (1 + 0.01 * cta)
                    events.append({"name": name, "ph": "E", "ts": t / 1e3, "tid": tid})
                t += 50.0 + rng.uniform(0, 1e-3)  # time outside any phase
            events.append({"name": "Init", "ph": "E", "ts": t / 1e3, "tid": tid})
            traces.append(events)
    # The profiler's dump: each trace's events in order, the traces one after another (in an
    # order of their own: here shuffled).
    rng.shuffle(traces)
    trace = {"traceEvents": [event for events in traces for event in events]}
    summary = profile.summarize(profile.ranges_per_trace(trace), traces_per_block=2)
    for wg, expected in phases.items():
        got = summary[f"wg{wg}"]
        for name, cycles in expected.items():
            assert got[name] == pytest.approx(cycles * 1.01, rel=1e-3), (wg, name)  # the median CTA
        if wg in nested:
            assert got[nested[wg][1]] == pytest.approx(nested[wg][2] * 1.01, rel=1e-3)
        assert got["(sum of phases)"] == pytest.approx(sum(expected.values()) * 1.01, rel=1e-3)
        assert got["(step period)"] == pytest.approx(sum(expected.values()) * 1.01 + 50.0, rel=1e-3)


def _inputs(seed, *, batch, heads, pages_per_row, seq_lens, s_q=1):
    """Random FP8 cache with outlier tokens and empty slots, scrambled pages.

    The empty slots (3% of the tokens) hold a zero latent and a zero scale, as a cache's slots
    before anything is written there, and RoPE keys 4x the others', so that their RoPE scores
    give them a share of the softmax. The 64-row kernel's softmax runs on score + log2 k_scale and
    sums P' / k_scale: a zero scale there is kept finite by the floor under its logarithm and
    reciprocal (``mgpu_decode_inputs.SCALE_FLOOR``), without which the output is NaN."""
    rng = np.random.default_rng(seed)
    num_pages = batch * pages_per_row + 2
    x = rng.standard_normal((num_pages, 64, 512)).astype(np.float32)
    x[rng.random((num_pages, 64)) < 0.02] *= 300.0  # outlier tokens: scales 300x apart
    rope = rng.standard_normal((num_pages, 64, 64))
    block_table = jnp.asarray(rng.permutation(num_pages)[:batch * pages_per_row].reshape(batch, pages_per_row),
                              jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, s_q, heads, 512)) * 0.3, jnp.bfloat16)
    q_rope = jnp.asarray(rng.standard_normal((batch, s_q, heads, 64)) * 0.3, jnp.bfloat16)
    zero = rng.random((num_pages, 64)) < 0.03
    x[zero] = 0.0
    rope[zero] *= 4.0
    latent, scale = quantize_per_token(jnp.asarray(x))
    scale = jnp.where(jnp.asarray(zero), 0.0, scale)
    return q, q_rope, latent, scale, jnp.asarray(rope, jnp.bfloat16), block_table, jnp.asarray(seq_lens, jnp.int32)


def _kernel_and_rows(kernel: str):
    """"mgpu": pallas_kernels/mla_decode_mgpu.py (64-row blocks); "small":
    pallas_kernels/mla_decode_mgpu_small.py (16-row blocks, transposed products); "small32":
    the same kernel in 32-row blocks."""
    from snapmla_jax.pallas_kernels import mla_decode_mgpu, mla_decode_mgpu_small
    small = mla_decode_mgpu_small.mla_decode_mgpu_small
    return {"mgpu": (mla_decode_mgpu.mla_decode_mgpu, mla_decode_mgpu.BLOCK_M),
            "small": (small, mla_decode_mgpu_small.ROWS),
            "small32": (functools.partial(small, block_rows=32), 32)}[kernel]


def _call_kernel(q, q_rope, latent, scale, rope, block_table, seq_lens, softmax_scale, *, layer_pages=0, num_splits=1,
                 balanced=False, interpret=False, kernel="mgpu", pad_rows=False, **kernel_kw):
    """A Mosaic kernel (``_kernel_and_rows``) on the API's shapes: s_q x H rows (padded to its
    block here with ``pad_rows``; else the kernel's inputs launch pads them), the cache
    flattened; ``balanced``: its split plan follows the rows' seq_lens
    (``split_plan.balanced_plan``, sized for ``num_splits`` a row).

    ``layer_pages`` > 0 puts a layer of NaN pages in front of the cache and reads
    the second layer through ``layer_offset``, as a multi-layer cache does. ``kernel_kw``: more
    keyword arguments of the kernel (``query_in_kernel``).
    """
    kernel_fn, block_rows = _kernel_and_rows(kernel)
    batch, s_q, heads, rank = q.shape
    rows = s_q * heads
    padded = -(-rows // block_rows) * block_rows if pad_rows else rows
    to_rows = lambda a: jnp.pad(a.reshape(batch, rows, a.shape[-1]), [(0, 0), (0, padded - rows), (0, 0)])
    n = latent.shape[0] * latent.shape[1]
    cache = [latent.reshape(n, rank), scale.reshape(n), rope.reshape(n, 64)]
    if layer_pages:
        cache = [jnp.concatenate([jnp.full((layer_pages * 64, *a.shape[1:]), jnp.nan, a.dtype), a]) for a in cache]
    out, lse = kernel_fn(to_rows(q), to_rows(q_rope), tuple(cache), block_table, seq_lens,
                         jnp.full((1,), layer_pages * 64, jnp.int32), softmax_scale=softmax_scale,
                         page_size=64, s_q=s_q, num_heads=heads, num_splits=num_splits, balanced=balanced,
                         interpret=interpret, **kernel_kw)
    return out[:, :rows].reshape(q.shape), lse[:, :rows].reshape(batch, s_q, heads)


@pytest.mark.parametrize("kernel", ["mgpu", "small", "small32"])
@pytest.mark.parametrize("s_q,num_splits,dtype,balanced", [
    (1, 1, "bfloat16", False), (2, 1, "bfloat16", False), (1, 4, "bfloat16", False), (1, 1, "float32", False),
    (1, 2, "float32", False), (2, 2, "bfloat16", True), (1, 1, "float32", True)])
def test_kernel_lowers_for_cuda(kernel, s_q, num_splits, dtype, balanced):
    """Layout inference, SMEM allocation (fits in an H100's 227 KB) and lowering to MLIR, without a
    GPU. float32 queries (a float32 model) give a float32 output: the 16-row kernel stores it
    transposed, as its split partials (a 32-bit transposed store does not lower). ``balanced``:
    the split plan read from the items array, outputs to the row or the item's partial slot."""
    heads = 64 if kernel == "mgpu" else 16
    q, q_rope, *cache = _inputs(0, batch=2, heads=heads, pages_per_row=3, seq_lens=[100, 0], s_q=s_q)
    args = (q.astype(dtype), q_rope.astype(dtype), *cache)
    call = lambda *a: _call_kernel(*a, 0.1, num_splits=num_splits, balanced=balanced, kernel=kernel)
    lower_for_cuda(call, *args)


@pytest.mark.parametrize("kernel", ["mgpu", "small", "small32"])
def test_kernel_lowers_for_cuda_under_a_wave_plan(kernel):
    """A wave plan's items (launch order and steps read from the plan) lower, with partials."""
    heads = 64 if kernel == "mgpu" else 16
    q, q_rope, *cache = _inputs(0, batch=3, heads=heads, pages_per_row=3, seq_lens=[100, 0, 190], s_q=1)
    lower_for_cuda(lambda *a: _call_kernel(*a, 0.1, num_splits=2, kernel=kernel, segments=2), q, q_rope, *cache)


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("kernel,rows,query_in_kernel", [("mgpu", 128, None), ("small", 16, None),
                                                         ("small", 16, False), ("small32", 32, None)])
def test_kernels_lower_for_cuda_over_small_pages(kernel, rows, query_in_kernel, page_size):
    """Pages of 16 and 32 tokens, 8 or 4 a step: the 64-row kernel (its producer's warps sharing
    the issue, ``producer_by_warps``), the 16-row one taking its query and scales
    itself (a scale copy of two pages at 16 tokens) or from the inputs launch, the 32-row one; a
    balanced plan (the uniform one's code at 64-token pages: ``test_kernel_lowers_for_cuda``)."""
    S = jax.ShapeDtypeStruct
    batch, max_pages, tokens = 2, 12, 28 * page_size
    args = (S((batch, rows, 512), jnp.bfloat16), S((batch, rows, 64), jnp.bfloat16),
            (S((tokens, 512), jnp.float8_e4m3fn), S((tokens,), jnp.float32), S((tokens, 64), jnp.bfloat16)),
            S((batch, max_pages), jnp.int32), S((batch,), jnp.int32), S((1,), jnp.int32))
    kernel_fn = _kernel_and_rows(kernel)[0]
    kw = {} if query_in_kernel is None else dict(query_in_kernel=query_in_kernel)
    lower_for_cuda(functools.partial(kernel_fn, softmax_scale=0.1, page_size=page_size, s_q=1, num_heads=rows,
                                     num_splits=2, balanced=True, **kw), *args)


@pytest.mark.parametrize("heads,query_in_kernel", [(16, None), (16, False), (4, None)])
def test_small_kernel_lowers_for_cuda_with_two_query_terms(heads, query_in_kernel):
    """The second query term's tiles fit the 16-row blocks' SMEM (227 KB) beside the bf16 staging
    tile of a query quantized in the kernel, and beside the inputs launch's rows (4 heads: rows
    padded to the block), under a balanced plan."""
    q, q_rope, *cache = _inputs(0, batch=2, heads=heads, pages_per_row=3, seq_lens=[100, 0])
    kw = {} if query_in_kernel is None else dict(query_in_kernel=query_in_kernel)
    lower_for_cuda(lambda *a: _call_kernel(*a, 0.1, num_splits=2, balanced=True, kernel="small", query_terms=2, **kw),
                   q, q_rope, *cache)


def test_register_split_must_fit_the_kernels_registers(monkeypatch):
    """The consumers' ``set_max_registers`` increase waits for registers the producer's decrease
    frees: a split above 3 x 168 a thread hung an H100 (48 / 232), so it is refused, and the
    shipped split is within it. (The split exists only with the producer warpgroup, which the
    kernel leaves out where ptxas ignores ``setmaxnreg``.)"""
    monkeypatch.setattr(mgpu_kernel, "PRODUCER_WG", True)
    mgpu_kernel.check_registers(mgpu_kernel.PRODUCER_REGISTERS, mgpu_kernel.CONSUMER_REGISTERS)
    mgpu_kernel.check_registers(24, 240)
    for producer, consumer in [(48, 232), (24, 248), (28, 240)]:
        with pytest.raises(ValueError, match="PRODUCER_REGISTERS"):
            mgpu_kernel.check_registers(producer, consumer)
    monkeypatch.setattr(mgpu_kernel, "PRODUCER_REGISTERS", 48)
    monkeypatch.setattr(mgpu_kernel, "CONSUMER_REGISTERS", 232)
    jax.clear_caches()
    q, q_rope, *cache = _inputs(0, batch=2, heads=64, pages_per_row=3, seq_lens=[100, 0])
    with pytest.raises(ValueError, match="48 / 232"):
        lower_for_cuda(lambda *a: _call_kernel(*a, 0.1, kernel="mgpu"), q, q_rope, *cache)
    monkeypatch.undo()
    jax.clear_caches()


_MODULE_TEXTS = {}


def _mosaic_module_text(kernel: str) -> str:
    """The Mosaic GPU module a kernel ("mgpu" or "small") lowers to for CUDA with a uniform plan
    (MLIR text without debug info; scripts/mosaic_module_text.py), no GPU needed.

    The lowering is a function of the kernels' module constants (the flags these tests set), so
    each text is kept for the process under those constants' values: the shipped kernels' texts,
    read by several tests, are lowered once."""
    constants = tuple((name, key, repr(value)) for name, module in sorted(sys.modules.items())
                      if name.startswith("snapmla_jax.pallas_kernels.")
                      for key, value in sorted(vars(module).items()) if key.isupper())
    if (kernel, constants) not in _MODULE_TEXTS:
        _MODULE_TEXTS[kernel, constants] = load_script("mosaic_module_text").lowered_module(kernel, "uniform")
    return _MODULE_TEXTS[kernel, constants]


def test_consumers_meet_at_their_own_named_barriers(monkeypatch):
    """``NAMED_SYNC``: the two consumer warpgroups exchange statistics and P' at hardware named
    barriers of their 256 threads, whose ids Mosaic GPU does not use itself (0 is the CTA's,
    1..3 the warpgroups' own): each step meets at both, and without the flag at neither."""
    import snapmla_jax.pallas_kernels.mla_decode_mgpu as mgpu_module
    ids = (mgpu_module.STATS_SYNC_ID, mgpu_module.P_SYNC_ID)
    assert len(set(ids)) == 2 and all(mgpu_module.NUM_WGS + 1 < i < 16 for i in ids), ids
    text = _mosaic_module_text("mgpu")
    for barrier_id in ids:
        # Two step loops (unmasked, masked), each meeting once at each barrier.
        assert text.count(f"bar.sync {barrier_id}, 256;") == 2, barrier_id
    monkeypatch.setattr(mgpu_module, "NAMED_SYNC", False)
    jax.clear_caches()
    text = _mosaic_module_text("mgpu")
    assert all(f"bar.sync {barrier_id}," not in text for barrier_id in ids)
    monkeypatch.undo()
    jax.clear_caches()


def test_step_hands_over_behind_named_barriers_only(monkeypatch):
    """``UNSYNCED_ROW_STORES`` and ``FENCE_ONLY_COMMIT``: inside the step loops the published
    statistics, the fold's factors and P''s commit take no barrier of the warpgroup (Pallas puts
    one before and one after every SMEM store, and one after ``commit_smem``'s fence): 5 a step
    loop fewer (the row max, the fold's ratio, the commit), the named barriers that order them
    instead. Each flag removes its own."""
    import re
    import snapmla_jax.pallas_kernels.mla_decode_mgpu as mgpu_module

    def warpgroup_barriers(rows: bool, commit: bool) -> int:
        monkeypatch.setattr(mgpu_module, "UNSYNCED_ROW_STORES", rows)
        monkeypatch.setattr(mgpu_module, "FENCE_ONLY_COMMIT", commit)
        jax.clear_caches()
        # Mosaic GPU's warpgroup barrier: bar.sync with the warpgroup's id in a register, 128 threads.
        return len(re.findall(r"bar\.sync \$0, 128;", _mosaic_module_text("mgpu")))

    lean, rows_only, commit_only, synced = (warpgroup_barriers(*flags) for flags in
                                            ((True, True), (True, False), (False, True), (False, False)))
    loops = 2  # unmasked and masked steps
    assert synced - lean == loops * 5, (synced, lean)
    assert synced - rows_only == loops * 4 and synced - commit_only == loops * 1, (rows_only, commit_only)
    monkeypatch.undo()
    jax.clear_caches()


def test_small_kernel_stores_its_row_vectors_without_warpgroup_barriers(monkeypatch):
    """The 16-row kernel's ``UNSYNCED_ROW_STORES``: each warpgroup's row max of a step, published
    for the other where the warpgroups exchange their own (``ONE_EXCHANGE_ROWS`` empty), takes
    neither of the two warpgroup barriers Pallas puts around an SMEM store (the statistics' named
    barrier orders it): 2 a step loop fewer."""
    import re
    import snapmla_jax.pallas_kernels.mla_decode_mgpu_small as small_module
    monkeypatch.setattr(small_module, "ONE_EXCHANGE_ROWS", ())

    def warpgroup_barriers(unsynced: bool) -> int:
        monkeypatch.setattr(small_module, "UNSYNCED_ROW_STORES", unsynced)
        jax.clear_caches()
        return len(re.findall(r"bar\.sync \$0, 128;", _mosaic_module_text("small")))

    loops = 2  # unmasked and masked steps
    assert warpgroup_barriers(False) - warpgroup_barriers(True) == loops * 2
    monkeypatch.undo()
    jax.clear_caches()


def test_small_kernel_row_max_meets_in_one_exchange(monkeypatch):
    """``ONE_EXCHANGE_ROWS``: each warp's maxima of a step go to SMEM and cross the warps and the
    warpgroups at the statistics' named barrier alone. The reduction across a warpgroup's warps
    (``token_reduce``: at 16 rows one round between two warpgroup barriers) leaves each step
    loop; the named barrier stays, once a loop (and once before the loops)."""
    import re
    import snapmla_jax.pallas_kernels.mla_decode_mgpu_small as small_module

    def barriers(one_exchange_rows: tuple) -> tuple[int, int]:
        monkeypatch.setattr(small_module, "ONE_EXCHANGE_ROWS", one_exchange_rows)
        jax.clear_caches()
        text = _mosaic_module_text("small")
        return (len(re.findall(r"bar\.sync \$0, 128;", text)),
                text.count(f"bar.sync {mgpu_kernel.STATS_SYNC_ID}, 256;"))

    (one_warpgroup, one_named), (two_warpgroup, two_named) = barriers((16,)), barriers(())
    loops = 2  # unmasked and masked steps
    assert two_warpgroup - one_warpgroup == loops * 2, (one_warpgroup, two_warpgroup)
    assert one_named == two_named == 3
    monkeypatch.undo()
    jax.clear_caches()


def test_small_kernel_warpgroups_meet_twice_a_step():
    """Both warpgroups of the 16-row kernel score half of each step: they meet at the 64-row
    kernel's two named barriers (the statistics, then P'^T), once a step loop each, and (the
    module's uniform plan: its query quantized in the kernel) once more at the first before the
    loops, when both halves of the query are in SMEM."""
    text = _mosaic_module_text("small")
    for barrier_id, meetings in ((mgpu_kernel.STATS_SYNC_ID, 3), (mgpu_kernel.P_SYNC_ID, 2)):
        assert text.count(f"bar.sync {barrier_id}, 256;") == meetings, barrier_id


def test_qk_precision_tool_runs_interpreted(tmp_path):
    """tools/qk_precision.py (its GPU run sets ``QK_PROMOTION``) on the interpreter, one
    case: the interpreter's wgmma is exact, so a chain setting matches the e4m3 emulation
    within the interpreted kernel's bound, and the emulation sits at e4m3's few percent from exact
    float64 attention (with no outliers: 2.7e-2 measured). One variant, a chain setting other than
    the shipped ``QK_PROMOTION`` (the tool's loop is the same for each; the shipped setting is
    what every other interpreted case of the 64-row kernel runs)."""
    # The interpreter runs each warpgroup as a thread: a fresh process with 8 CPU devices, as
    # ``_in_subprocess`` explains.
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    variant = "promotion_256" if mgpu_kernel.QK_PROMOTION != 256 else "promotion_512"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "qk_precision.py"), "--interpret",
                           "--seeds", "1", "--cases", "1", "--outlier-scale", "1",
                           "--variants", variant, "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "qk_precision.json").read_text())
    assert set(results["variants"]) == {variant}
    summary = results["variants"][variant]["summary"]
    assert summary["vs_emulation_max_max"] < 1e-2, summary  # as the interpreted kernel test
    # Q and P rounded to e4m3 (2**-4 relative each) over many tokens: a few 1e-2, not 0, not O(1).
    assert 5e-3 < summary["vs_exact_rel_l2_max"] < 0.1, summary


@pytest.mark.parametrize("max_pages", [1, 2, 5, 8])
def test_step_page_columns_are_the_pages_of_the_step_in_the_table(max_pages):
    """A step's two block-table columns (``step_page_columns``): pages 2s and 2s + 1, the one past
    an odd table's end clamped onto its last page; with an even width, adjacent (one 64-bit load)."""
    from snapmla_jax.pallas_kernels.mla_decode_mgpu import step_page_columns
    for step in range(-(-max_pages // 2)):  # the steps a row of the table's capacity walks
        columns = [int(c) for c in step_page_columns(jnp.int32(step), max_pages)]
        assert columns == [min(2 * step, max_pages - 1), min(2 * step + 1, max_pages - 1)], (step, columns)
        if max_pages % 2 == 0:
            assert columns[1] == columns[0] + 1


def test_no_kernel_reduces_through_the_shared_scratch():
    """Pallas Mosaic GPU lowers a reduction across warps through an SMEM scratch at one static
    offset, and both warpgroups run the same program: two warpgroups reducing at once
    overwrite each other's partials (on the GPU only; the interpreter cannot show it). The
    64-row kernel reduces along its rows, inside warps; the 16-row kernel reduces along the
    tokens, across warps, through a scratch of each warpgroup's own (``token_reduce``). Neither
    may use Pallas' scratch. A kernel that reduces across warps the Pallas way shows that the
    check sees it."""
    # Pallas' scratch, at its static offset (a warpgroup's own is a view at a traced offset).
    scratch_view = (f"memref<{plgpu.CompilerParams().reduction_scratch_bytes // 4}xf32, "
                    "#gpu.address_space<workgroup>")
    assert scratch_view not in _mosaic_module_text("mgpu")
    assert scratch_view not in _mosaic_module_text("small")

    def column_max(o_ref, o_s):
        x = plgpu.broadcasted_iota(jnp.int32, (64, 16), 0, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        o_s[...] = x.max(axis=0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_ref)
        plgpu.wait_smem_to_gmem(0)

    def call():
        return plgpu.kernel(column_max, out_type=jax.ShapeDtypeStruct((16,), jnp.float32),
                            scratch_types=[plgpu.SMEM((16,), jnp.float32)])()

    from snapmla_jax.backend import mosaic_module_texts
    [text] = mosaic_module_texts(lower_for_cuda(call))
    assert scratch_view in text


@pytest.mark.parametrize("approx", [True, False])
def test_64_row_kernel_takes_one_instruction_log2(monkeypatch, approx):
    """``APPROX_MATH``: the log2 of a step's token scales is one ``lg2.approx`` a value; without
    it, it compiled to a ~28-instruction polynomial, a quarter of the step's instructions on the
    H100. The lowered module names the instruction only when the flag is on."""
    monkeypatch.setattr(mgpu_kernel, "APPROX_MATH", approx)
    jax.clear_caches()
    assert ("lg2.approx.ftz.f32" in _mosaic_module_text("mgpu")) == approx
    monkeypatch.undo()
    jax.clear_caches()  # later tests lower the shipped kernel, not a cached variant


# Steps before a row's last one run unmasked (a second loop runs the masked
# tail): the cases mix whole-step rows, 1-token tails and, with s_q = 4, rows
# whose last two steps both need the causal mask.
# The 64-row kernel's bound against the e4m3 emulation on the GPU (test_kernel_matches_reference).
MGPU_TOL = 7e-2
CASES = pytest.mark.parametrize("heads,s_q,seq_lens,layer_pages,splits", [
    (64, 1, [100, 300, 0], 0, 1),    # ragged, a partial page, seq_len 0; 3 steps: both ring slots reused
    (128, 1, [129, 64, 1], 3, 1),    # a 1-token last step; a second layer (NaN first layer) via layer_offset
    (64, 1, [320, 257, 128], 0, 2),  # split-KV: splits of 2 and 1 steps, an empty split, a whole-step row
    (16, 2, [200, 2, 77], 0, 1),     # s_q = 2 (causal rule), H padded to 64 rows
    (16, 4, [129, 4, 258], 0, 1),    # s_q = 4: two masked steps in a row
])
# The same situations for the 16-row kernel, plus several row blocks; then the same
# kernel in 32-row blocks ("small32": every product has N = 32, and P'^T, twice the
# bytes, shares the RoPE slot with 2 tiles a slot instead of 4; H = 16 at s_q = 2 is
# multi-token prediction).
SMALL_CASES = pytest.mark.parametrize("kernel,heads,s_q,seq_lens,layer_pages,splits", [
    ("small", 16, 1, [100, 300, 0], 0, 1),
    ("small", 16, 1, [129, 64, 1], 3, 1),
    ("small", 16, 1, [320, 257, 128], 0, 2),
    ("small", 8, 2, [200, 2, 77], 0, 1),
    ("small", 4, 4, [129, 4, 258], 0, 1),
    ("small", 24, 2, [300, 5, 130], 0, 3),    # 48 rows: three blocks of 16; splits of 1 step
    ("small32", 16, 2, [200, 2, 77], 0, 1),   # one block, the causal rule between the two positions
    ("small32", 32, 1, [320, 257, 128], 3, 2),  # split-KV, a layer offset
    ("small32", 8, 4, [129, 4, 258], 0, 1),   # s_q = 4: two masked steps in a row
    ("small32", 24, 2, [300, 5, 130], 0, 1),  # 48 rows: two blocks of 32, the second half padding
])


def _nan_past_seq_lens(latent, scale, rope, block_table, seq_lens):
    """The cache with NaN in every slot of a row's pages past its seq_len (latent, scale if not
    None, and RoPE part; [..., pages, page_size, ...]: in every layer of a layered cache), as
    never-written or recycled pages may hold: a kernel must mask them, not multiply them by 0."""
    arrays = [None if a is None else np.array(a, np.float32) for a in (latent, scale, rope)]
    page_size = latent.shape[-2]
    for row, length in enumerate(seq_lens):
        for slot, page in enumerate(np.asarray(block_table)[row]):
            past = np.arange(page_size) + slot * page_size >= length
            for a, trailing in zip(arrays, (1, 0, 1)):
                if a is not None:
                    a[(Ellipsis, page, past) + (slice(None),) * trailing] = np.nan
    return tuple(None if a is None else jnp.asarray(a, b.dtype) for a, b in zip(arrays, (latent, scale, rope)))


def _check(heads, s_q, seq_lens, layer_pages, splits, *, interpret, kernel="mgpu", dtype="bfloat16",
           balanced=False, pages_per_row=5, segments=0, query_terms=1, qk_promotion=None):
    """Kernel vs ``mla_decode_reference(block_n=128)``, queries in ``dtype``; returns (max error /
    max |ref|, max lse error, lse scale). ``segments`` > 0: a wave plan (``split_plan.wave_plan``);
    ``query_terms``: the query's FP8 terms in the kernel and the reference; ``qk_promotion``: the
    kernel's (None: its default)."""
    q, q_rope, latent, scale, rope, block_table, lens = _inputs(heads + s_q, batch=len(seq_lens), heads=heads,
                                                                pages_per_row=pages_per_row, seq_lens=seq_lens,
                                                                s_q=s_q)
    q, q_rope = q.astype(dtype), q_rope.astype(dtype)
    latent, scale, rope = _nan_past_seq_lens(latent, scale, rope, block_table, seq_lens)
    softmax_scale = 576 ** -0.5
    out, lse = _call_kernel(q, q_rope, latent, scale, rope, block_table, lens, softmax_scale,
                            layer_pages=layer_pages, num_splits=splits, balanced=balanced, interpret=interpret,
                            kernel=kernel, **({"segments": segments} if segments else {}),
                            **({"query_terms": query_terms} if query_terms != 1 else {}),
                            **({"qk_promotion": qk_promotion} if qk_promotion is not None else {}))
    # The reference rounds Q and P' to e4m3 as the kernel does (P' factor per
    # 128-token step), with exact products, on the same pages without a layer offset.
    ref, ref_lse = mla_decode_reference(q, q_rope, latent, scale, rope, block_table, lens,
                                        softmax_scale=softmax_scale, block_n=128, query_terms=query_terms)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    seen = np.asarray(lens) > 0
    assert np.all(out[~seen] == 0)
    assert np.all(np.isneginf(lse[~seen]))
    err = np.max(np.abs(out[seen] - ref[seen])) / np.max(np.abs(ref[seen]))
    return float(err), float(np.max(np.abs(lse[seen] - ref_lse[seen]))), float(np.max(np.abs(ref_lse[seen])))


def _check_in_subprocess(heads, s_q, seq_lens, layer_pages, splits, kernel="mgpu", dtype="bfloat16", **kw):
    """``_check`` in interpret mode in the process that has 8 CPU devices (``_in_subprocess``);
    ``kw``: more keyword arguments of ``_check`` (python literals)."""
    more = "".join(f", {k}={v!r}" for k, v in kw.items())
    return _in_subprocess(f"_check({heads}, {s_q}, {seq_lens!r}, {layer_pages}, {splits}, interpret=True, "
                          f"kernel={kernel!r}, dtype={dtype!r}{more})")


def _in_subprocess(call: str, module: str = "test_mla_decode_mgpu"):
    """``call``, a call of a function of the test module ``module``, in a process of its own that
    has 8 CPU devices (``interpreter_process``: one such process serves this pytest process's
    cases in turn); returns its result, passed through JSON.

    The interpreter runs each warpgroup as a thread whose memory operations
    are host callbacks. With two warpgroups waiting on each other's barriers,
    the callbacks of one can starve behind the other's blocked wait when the
    CPU client has few devices (on a 2-core machine it hung in about 1 run of
    3; with 8 CPU devices, 18 of 18 runs finished). The device count is fixed
    at start-up, hence the subprocess; a hang still fails, by the timeout.
    """
    return interpreter_process.evaluate(module, call, timeout=600)


@pytest.mark.parametrize("kernel,asked", [("mgpu", None), ("mgpu", 128), ("mgpu", 256), ("small", None),
                                          ("small", 512), ("small32", None), ("small32", 256)])
def test_fp8_kernels_sum_qk_over_the_features_a_call_asks_for(monkeypatch, kernel, asked):
    """``qk_promotion`` reaches the Q.K chains of every FP8 kernel, and None leaves each its own
    (the 64-row kernel one 512-feature chain, the 16-row kernel 128 in both row blocks). Traced
    only: interpreted, every chain length gives the same float32 sums up to their order; compiled,
    the FP8 wgmma's ~14-bit accumulation is what the length changes."""
    import snapmla_jax.pallas_kernels.mla_decode_mgpu_small as small_kernel
    used = []
    if kernel == "mgpu":
        chains = mgpu_kernel.qk8_promoted
        monkeypatch.setattr(mgpu_kernel, "qk8_promoted", lambda *a: used.append(a[-1]) or chains(*a))
        default = mgpu_kernel.QK_PROMOTION
    else:
        scores = small_kernel.half_scores_t
        monkeypatch.setattr(small_kernel, "half_scores_t",
                            lambda *a, **kw: used.append(kw["qk_promotion"]) or scores(*a, **kw))
        default = small_kernel.QK_PROMOTION if kernel == "small" else small_kernel.QK_PROMOTION_32_ROWS
    heads, s_q = (64, 1) if kernel == "mgpu" else (16, 1 if kernel == "small" else 2)
    q, q_rope, latent, scale, rope, block_table, lens = _inputs(5, batch=2, heads=heads, pages_per_row=2,
                                                                seq_lens=[100, 3], s_q=s_q)
    jax.clear_caches()  # the kernels trace afresh, through the recorders
    call = lambda *arrays: _call_kernel(*arrays, 576 ** -0.5, interpret=True, kernel=kernel,
                                        **({} if asked is None else {"qk_promotion": asked}))
    jax.eval_shape(call, q, q_rope, latent, scale, rope, block_table, lens)
    assert default in (128, 512) and used and set(used) == {default if asked is None else asked}


@CASES
def test_kernel_interpreted_matches_reference(heads, s_q, seq_lens, layer_pages, splits):
    """On CPU: paging through the token-pair views, step order, the unmasked and masked
    loops, s_q, layer offset, split-KV, the barriers between the two warpgroups and the
    ring's reuse.

    Not covered here: the V transpose, the byte packing and the RoPE product
    accumulated onto the FP8 scores; the GPU test below covers them.
    """
    err, lse_err, _ = _check_in_subprocess(heads, s_q, seq_lens, layer_pages, splits)
    # Same roundings in fp32 on both sides: what differs is summation order (and, with
    # ``softmax_frame``, P' as one exp2 of score + log2 k_scale), which can move a value across a
    # rounding boundary. The bf16 output's boundary is the larger: one ulp there is 2**-7 of a
    # value at the bottom of its binade, so up to 2**-7 = 7.8e-3 of max |ref| (one flip measured
    # 4.4e-3: 696 vs 692 beside a largest output of 916). With splits the partials are bf16 too
    # (``partial_dtype``), one more rounding (half an ulp of a partial); the split case measured
    # 4.0e-3 (2.0e-3 with float32 partials). A wrong mask, permutation or factor errs by O(1): 1e-2.
    assert err < 1e-2, err
    assert lse_err < 1e-4, lse_err  # fp32 log-sum-exp of O(10) values, different order


@pytest.mark.parametrize("kernel,heads,s_q,qk_promotion", [("mgpu", 64, 1, 128), ("small", 16, 1, 512)])
def test_kernels_interpreted_match_reference_with_other_qk_chains(kernel, heads, s_q, qk_promotion):
    """The 64-row kernel's Q.K in four 128-feature chains and the 16-row kernel's in one of 512
    (``qk_promotion``), against the same reference: a ragged batch with a seq_len 0 and splits.
    Bounds as test_kernel_interpreted_matches_reference's: the chains change only the order of
    float32 sums here."""
    err, lse_err, _ = _check_in_subprocess(heads, s_q, [100, 300, 0], 0, 2, kernel=kernel,
                                           qk_promotion=qk_promotion)
    assert err < 1e-2, err
    assert lse_err < 1e-4, lse_err


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,heads,s_q,qk_promotion", [("mgpu", 64, 1, 128), ("mgpu", 16, 2, 256),
                                                          ("small", 16, 1, 512)])
def test_kernels_match_reference_with_other_qk_chains(kernel, heads, s_q, qk_promotion):
    err, lse_err, lse_scale = _check(heads, s_q, [100, 300, 0], 0, 2, interpret=False, kernel=kernel,
                                     qk_promotion=qk_promotion)
    # Hopper's FP8 accumulation over chains of 128 to 512 features: within the bound of
    # test_kernel_matches_reference, whose comment has the measurements (512: 0.056, 128: 0.020).
    assert err < MGPU_TOL, err
    assert lse_err < 2**-9 * lse_scale, (lse_err, lse_scale)


@pytest.mark.gpu
@CASES
def test_kernel_matches_reference(heads, s_q, seq_lens, layer_pages, splits):
    err, lse_err, lse_scale = _check(heads, s_q, seq_lens, layer_pages, splits, interpret=False)
    # As in the interpreter, plus Hopper's FP8 MMA accumulating Q.K in ~14 bits
    # (test_mla_decode_gpu.py) over one 512-feature chain (QK_PROMOTION): each of
    # its 16 K=32 additions may drop ~2**-13 of the running sum, so a score moves by
    # up to ~2**-9 of the magnitude of its products, and the 300x outlier tokens'
    # scores (~300x the others) shift P' roundings and softmax weights most.
    # Measured on an H100 over these cases with 6 seeds each (and 128-row cases),
    # max over cases: 0.056 (256-feature chains 0.030, 128 0.020); on an H200 over
    # 16 cases of up to 4k tokens (tools/qk_precision.py): 0.048 (256: 0.028).
    # Against exact attention the three settings differ by < 0.3% of their own
    # error. 7e-2: a wrong page,
    # scale or mask moves outputs by O(1).
    assert err < MGPU_TOL, err
    assert lse_err < 2**-9 * lse_scale, (lse_err, lse_scale)


@SMALL_CASES
def test_small_kernel_interpreted_matches_reference(kernel, heads, s_q, seq_lens, layer_pages, splits):
    """The 16-row kernel (in 16- or 32-row blocks) on CPU: as the test above, plus the
    transposed products (S^T = K.Q^T, O^T = V^T.P'^T on f16 tiles) and the softmax along the
    tokens. Not covered here: the RoPE product accumulated onto the FP8 scores."""
    err, lse_err, _ = _check_in_subprocess(heads, s_q, seq_lens, layer_pages, splits, kernel=kernel)
    # As test_kernel_interpreted_matches_reference: same roundings, another order (measured ~1e-11
    # without splits). With splits the bf16 partials (``partial_dtype``) add a rounding of half an
    # ulp of a partial, <= 2**-8 of the largest (~ max |ref|), which the output's rounding can then
    # carry across a boundary: measured 3.5e-3 (1e-11 with float32 partials).
    assert err < (4e-3 if splits == 1 else 4e-3 + 2.0 ** -8), err
    assert lse_err < 1e-4, lse_err


def _check_with_producer(*args, **kw):
    """``_check`` with a producer warpgroup issuing the 16-row kernel's ring in both of its row
    blocks (``PRODUCER_ROWS``), the register split forced on where jax would leave it out
    (``mla_decode_mgpu.PRODUCER_WG``). Traces afresh: the constants are read at trace time."""
    import snapmla_jax.pallas_kernels.mla_decode_mgpu_small as small_kernel
    saved = mgpu_kernel.PRODUCER_WG, small_kernel.PRODUCER_ROWS
    mgpu_kernel.PRODUCER_WG, small_kernel.PRODUCER_ROWS = True, (16, 32)
    jax.clear_caches()
    try:
        return _check(*args, **kw)
    finally:
        mgpu_kernel.PRODUCER_WG, small_kernel.PRODUCER_ROWS = saved
        jax.clear_caches()


# (kernel, heads, s_q, seq_lens, layer_pages, splits): the query quantized in the kernel with
# splits and a row of seq_len 0; 32-row blocks with the causal rule, a layer offset and splits.
PRODUCER_CASES = pytest.mark.parametrize("kernel,heads,s_q,seq_lens,layer_pages,splits", [
    ("small", 16, 1, [320, 257, 0], 0, 2),
    ("small32", 16, 2, [200, 2, 77], 3, 2),
])


@PRODUCER_CASES
def test_small_kernel_interpreted_with_a_producer(kernel, heads, s_q, seq_lens, layer_pages, splits):
    """The 16-row kernel with a third warpgroup issuing its ring (consumers' ring waits only, the
    producer's query and first-step copies, its drain of the last steps): as
    test_small_kernel_interpreted_matches_reference, with its bounds."""
    err, lse_err, _ = _in_subprocess(f"_check_with_producer({heads}, {s_q}, {seq_lens!r}, {layer_pages}, {splits}, "
                                     f"interpret=True, kernel={kernel!r})")
    assert err < 4e-3 + 2.0 ** -8, err
    assert lse_err < 1e-4, lse_err


@pytest.mark.gpu
@PRODUCER_CASES
def test_small_kernel_with_a_producer_matches_reference(kernel, heads, s_q, seq_lens, layer_pages, splits):
    err, lse_err, lse_scale = _check_with_producer(heads, s_q, seq_lens, layer_pages, splits, interpret=False,
                                                   kernel=kernel)
    assert err < MGPU_TOL, err  # as test_small_kernel_matches_reference
    assert lse_err < 2**-9 * lse_scale, (lse_err, lse_scale)


@pytest.mark.gpu
@SMALL_CASES
def test_small_kernel_matches_reference(kernel, heads, s_q, seq_lens, layer_pages, splits):
    err, lse_err, lse_scale = _check(heads, s_q, seq_lens, layer_pages, splits, interpret=False, kernel=kernel)
    # Hopper's FP8 accumulation over chains of this kernel's QK_PROMOTION features (128 in
    # 16- and 32-row blocks; the 64-row kernel's are 512): within the bound of
    # test_kernel_matches_reference, whose comment has the measurements (128: 0.020).
    assert err < MGPU_TOL, err
    assert lse_err < 2**-9 * lse_scale, (lse_err, lse_scale)


# Balanced split plans (``split_plan.balanced_plan``, rows of 10 pages): a long row cut into
# one-step items beside rows of one item (written directly, no merge), a row of seq_len 0 and
# unused items (their CTAs write nothing); with s_q = 2 the long row's items end in masked steps.
# (kernel, heads, s_q, seq_lens, splits the budget is sized for, query dtype)
BALANCED_CASES = pytest.mark.parametrize("kernel,heads,s_q,seq_lens,splits,dtype", [
    ("mgpu", 64, 1, [640, 40, 0], 2, "bfloat16"),    # items 5 + 1 + 1 of a budget of 9
    ("mgpu", 16, 2, [600, 129, 3], 1, "bfloat16"),   # items of 3 and 2 steps, 2 + 1 + 1 of 6
    ("mgpu", 64, 1, [640, 40, 0], 2, "float32"),     # float32 partials and output
    ("small", 16, 1, [640, 40, 0], 2, "bfloat16"),
    ("small", 16, 1, [600, 129, 3], 1, "float32"),   # transposed float32 output and partials
])


def _balanced_tolerance(dtype):
    # As test_kernel_interpreted_matches_reference: same roundings, another order; the bf16
    # output's rounding (up to 2**-7 of max |ref| across a boundary) plus, for merged rows, the
    # bf16 partials' (half an ulp, 2**-8). float32 outputs and partials: the bound of
    # test_kernel_interpreted_float32_splits (P' computed as one exp2 of score + log2 k_scale may
    # cross an e4m3 rounding boundary the reference does not).
    return 1e-2 + 2.0 ** -8 if dtype == "bfloat16" else 4e-3


@BALANCED_CASES
def test_balanced_plan_interpreted_matches_reference(kernel, heads, s_q, seq_lens, splits, dtype):
    """On CPU: each CTA finds its row and steps in the plan's items, rows of one item land in the
    output directly, the others in partial slots merged by ``combine_items``."""
    err, lse_err, _ = _check_in_subprocess(heads, s_q, seq_lens, 0, splits, kernel=kernel, dtype=dtype,
                                           balanced=True, pages_per_row=10)
    assert err < _balanced_tolerance(dtype), err
    assert lse_err < 1e-4, lse_err


@pytest.mark.gpu
@BALANCED_CASES
def test_balanced_plan_matches_reference(kernel, heads, s_q, seq_lens, splits, dtype):
    err, lse_err, lse_scale = _check(heads, s_q, seq_lens, 0, splits, interpret=False, kernel=kernel, dtype=dtype,
                                     balanced=True, pages_per_row=10)
    assert err < MGPU_TOL, err  # the compiled kernels' bound (test_kernel_matches_reference)
    assert lse_err < 2**-9 * lse_scale, (lse_err, lse_scale)


# Wave plans (``split_plan.wave_plan``, rows of 10 pages): the batch's steps in equal segments,
# so rows cut mid-step-run into items of unequal length, launched out of row order (each
# segment's opening piece first), a row of seq_len 0 and unused items; with s_q = 2 items end in
# masked steps. (kernel, heads, s_q, seq_lens, segments, query dtype)
WAVE_CASES = pytest.mark.parametrize("kernel,heads,s_q,seq_lens,segments,dtype", [
    ("mgpu", 64, 1, [640, 40, 0, 500], 3, "bfloat16"),   # 11 steps in segments of 4: items 2 + 1 + 1 + 2
    ("mgpu", 16, 2, [600, 129, 3], 4, "float32"),       # float32 partials and output, masked tails
    ("mgpu", 32, 4, [300, 0, 129, 640], 3, "bfloat16"), # 128 rows: two CTAs an item, masked steps in a row
    ("small", 16, 1, [640, 40, 0, 500], 3, "bfloat16"),
    ("small", 16, 2, [600, 129, 3], 2, "float32"),      # transposed float32 output and partials
])


@WAVE_CASES
def test_wave_plan_interpreted_matches_reference(kernel, heads, s_q, seq_lens, segments, dtype):
    """On CPU: each CTA finds its item through the plan's launch order and takes the item's own
    steps; rows of one item land in the output directly, the others are merged."""
    err, lse_err, _ = _check_in_subprocess(heads, s_q, seq_lens, 0, 2, kernel=kernel, dtype=dtype,
                                           pages_per_row=10, segments=segments)
    assert err < _balanced_tolerance(dtype), err
    assert lse_err < 1e-4, lse_err


@pytest.mark.gpu
@WAVE_CASES
def test_wave_plan_matches_reference(kernel, heads, s_q, seq_lens, segments, dtype):
    err, lse_err, lse_scale = _check(heads, s_q, seq_lens, 0, 2, interpret=False, kernel=kernel, dtype=dtype,
                                     pages_per_row=10, segments=segments)
    assert err < MGPU_TOL, err  # the compiled kernels' bound (test_kernel_matches_reference)
    assert lse_err < 2**-9 * lse_scale, (lse_err, lse_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,heads,s_q,balanced", [
    ("mgpu", 16, 2, True), ("mgpu", 24, 2, False), ("small", 8, 1, True), ("small32", 16, 1, False)])
def test_rows_padded_in_the_launch_give_the_callers_bits(kernel, heads, s_q, balanced):
    """Rows short of whole blocks, padded by the FP8 kernels' inputs launch (with the plan's
    programs, or without), give the bits of the same rows padded by the caller with jnp.pad."""
    args = _inputs(5, batch=3, heads=heads, pages_per_row=5, seq_lens=[300, 0, 129], s_q=s_q)
    run = lambda pad: _call_kernel(*args, 0.1, num_splits=2, balanced=balanced, kernel=kernel, pad_rows=pad)
    (out, lse), (want, want_lse) = run(False), run(True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    assert np.isfinite(np.asarray(out, np.float32)).all()


# Through the public API: (heads, s_q, table tokens a row) with 48 rows (past 16384 tokens of
# capacity the 64-row kernel, rows padded; below, three 16-row blocks), 16 (the 16-row kernel) and
# 32 (this small problem: two 16-row blocks), as ``mosaic_kernel`` routes them.
API_SHAPES = pytest.mark.parametrize("heads,s_q,row_tokens", [(24, 2, 8192), (24, 2, 256), (16, 1, 256),
                                                             (16, 2, 256)])


def test_mosaic_kernel_routes_by_rows():
    from snapmla_jax.pallas_kernels.mla_decode_mgpu import mla_decode_mgpu
    from snapmla_jax.pallas_kernels.mla_decode_mgpu_small import mla_decode_mgpu_small
    from snapmla_jax.decode import mosaic_kernel
    def small(num_rows):
        fn, rows = mosaic_kernel(num_rows)
        assert fn.func is mla_decode_mgpu_small and fn.keywords == {"block_rows": rows}
        return rows

    assert small(16) == small(8) == 16
    assert small(17) == small(32) == 32   # H = 16 at s_q = 2, H = 32
    assert mosaic_kernel(33) == (mla_decode_mgpu, 64)
    assert mosaic_kernel(48) == (mla_decode_mgpu, 64)
    # Two query terms: 16-row blocks at any row count (the block rows the split plan counts).
    for num_rows in (4, 32, 128):
        fn, rows = mosaic_kernel(num_rows, "fp8", jnp.bfloat16, None, 2)
        assert fn.func is mla_decode_mgpu_small and fn.keywords == {"block_rows": 16, "query_terms": 2}
        assert rows == 16
    assert mosaic_kernel(128, "bf16", jnp.bfloat16, None, 2) == mosaic_kernel(128, "bf16")  # no FP8 query


def test_bf16_rows_of_a_small_fp8_problem_run_16_row_blocks():
    """bf16 rows in whole 16-row blocks up to ``SMALL_BLOCKS_MAX_TOKENS`` of capacity and
    ``SMALL_BLOCKS_MAX_WORK`` rows x capacity: 16-row blocks, which quantize their query in the
    kernel; more capacity or work, float32 rows or rows that are not whole 16-row blocks: the
    32- or 64-row blocks."""
    from snapmla_jax.decode import SMALL_BLOCKS_MAX_TOKENS, SMALL_BLOCKS_MAX_WORK, mosaic_kernel
    rows = lambda *args: mosaic_kernel(*args)[1]
    small, large = SMALL_BLOCKS_MAX_TOKENS, SMALL_BLOCKS_MAX_TOKENS + 64
    assert rows(32, "fp8", jnp.bfloat16, small) == rows(16, "fp8", jnp.bfloat16, large) == 16
    assert rows(32, "fp8", jnp.bfloat16, large) == rows(32, "fp8", jnp.bfloat16) == 32
    assert rows(32, "fp8", jnp.float32, small) == rows(24, "fp8", jnp.bfloat16, small) == 32
    fits = SMALL_BLOCKS_MAX_WORK // 128  # 8192 tokens at 128 rows (H = 128)
    assert rows(128, "fp8", jnp.bfloat16, fits) == rows(256, "fp8", jnp.bfloat16, fits // 2) == 16
    assert rows(128, "fp8", jnp.bfloat16, fits + 64) == rows(128, "fp8", jnp.float32, fits) == 64
    assert rows(48, "fp8", jnp.bfloat16, small) == 16 and rows(40, "fp8", jnp.bfloat16, 64) == 64


def test_small_kernel_takes_its_query_in_the_kernel_where_it_can():
    """``runs_query_in_kernel``: 16-row blocks of bf16 rows that are whole blocks, whatever the
    split plan; asked for elsewhere, a ValueError."""
    from snapmla_jax.pallas_kernels.mla_decode_mgpu_small import runs_query_in_kernel

    def can(rows=16, dtype=jnp.bfloat16, block_rows=16, batch=2):
        q = jax.ShapeDtypeStruct((batch, rows, 512), dtype)
        q_rope = jax.ShapeDtypeStruct((batch, rows, 64), dtype)
        return runs_query_in_kernel(q, q_rope, block_rows=block_rows)

    assert can() and can(rows=48) and can(batch=1)
    assert not any([can(rows=8), can(dtype=jnp.float32), can(rows=32, block_rows=32)])
    q, q_rope, latent, scale, rope, block_table, lens = _inputs(0, batch=2, heads=16, pages_per_row=3,
                                                                seq_lens=[100, 0])
    with pytest.raises(ValueError, match="query_in_kernel"):
        _call_kernel(q.astype(jnp.float32), q_rope.astype(jnp.float32), latent, scale, rope, block_table, lens, 0.1,
                     num_splits=2, balanced=True, interpret=True, kernel="small", query_in_kernel=True)


def _query_paths(heads, s_q, seq_lens, layer_pages, splits, balanced=False):
    """The 16-row kernel interpreted with its query quantized in the kernel and from the inputs
    launch, on the same inputs (NaN past the rows' seq_lens) and split plan (``balanced``: the
    plan-only launch's against the inputs launch's): (max |out difference|, max |lse
    difference|) over the rows that see a token."""
    q, q_rope, latent, scale, rope, block_table, lens = _inputs(7, batch=len(seq_lens), heads=heads,
                                                                pages_per_row=5, seq_lens=seq_lens, s_q=s_q)
    latent, scale, rope = _nan_past_seq_lens(latent, scale, rope, block_table, seq_lens)
    seen = np.asarray(lens) > 0
    (out_a, lse_a), (out_b, lse_b) = [
        (np.asarray(out, np.float64)[seen], np.asarray(lse, np.float64)[seen])
        for out, lse in (_call_kernel(q, q_rope, latent, scale, rope, block_table, lens, 576 ** -0.5,
                                      layer_pages=layer_pages, num_splits=splits, balanced=balanced, interpret=True,
                                      kernel="small", query_in_kernel=flag) for flag in (True, False))]
    return float(np.max(np.abs(out_a - out_b))), float(np.max(np.abs(lse_a - lse_b)))


def test_small_kernel_query_in_kernel_matches_its_inputs_launch():
    """The query quantized in the kernel (``quantize_query``) and the token scales read from the
    cache's pages (``parity_scales``) against the inputs launch's, through the split merge and a
    layer offset: the interpreter runs the same float32 operations on the same values either way
    (the quantizer's division as the inputs launch writes it, the scales gathered, not computed),
    so the outputs are the same bits; a wrong row, parity or page differs by O(1)."""
    out_diff, lse_diff = _in_subprocess("_query_paths(16, 1, [129, 64, 1], 3, 2)")
    assert out_diff == 0.0 and lse_diff == 0.0, (out_diff, lse_diff)


def test_small_kernel_query_in_kernel_under_a_balanced_plan():
    """The same under a balanced plan (items that start mid-row, rows of several items, a row of
    none): the kernel quantizes its query and reads its scales itself beside the plan-only
    launch, with the same bits as beside the inputs launch that also computes the plan. s_q = 2
    (query positions masked differently in a row's last step), ragged rows, a partial page."""
    out_diff, lse_diff = _in_subprocess("_query_paths(8, 2, [300, 0, 40, 257], 2, 3, balanced=True)")
    assert out_diff == 0.0 and lse_diff == 0.0, (out_diff, lse_diff)


# The 16-row kernel with the query as two FP8 terms: rows quantized by the inputs launch (4 or 8
# heads: rows padded to the block) and in the kernel (16 bf16 heads: whole blocks), ragged rows, a
# row of seq_len 0, a partial page, splits and a layer offset. (heads, s_q, seq_lens, layer_pages,
# splits)
QUERY_TERMS_CASES = pytest.mark.parametrize("heads,s_q,seq_lens,layer_pages,splits", [
    (4, 1, [129, 0, 300], 2, 2), (16, 1, [129, 0, 300], 0, 1), (4, 2, [65, 257], 1, 3)])


def _exact_scores(q, q_rope, latent, scale, rope, block_table, lens, softmax_scale):
    """float64 attention scores on the cache's FP8 values, natural log: (scores [B, s_q, H, T],
    sum of |q_i k_i| of each (softmax-scaled) [B, s_q, H, T], visible bool [B, s_q, 1, T])."""
    s_q = q.shape[1]
    table = np.asarray(block_table)
    batch = table.shape[0]
    keys = (np.asarray(latent, np.float64) * np.asarray(scale, np.float64)[..., None])[table].reshape(batch, -1, 512)
    rope_keys = np.asarray(rope, np.float64)[table].reshape(batch, -1, 64)
    q64, qr64 = np.asarray(q, np.float64), np.asarray(q_rope, np.float64)
    scores = (np.einsum("bihd,btd->biht", q64, keys) + np.einsum("bihd,btd->biht", qr64, rope_keys)) * softmax_scale
    magnitude = np.einsum("bihd,btd->biht", np.abs(q64), np.abs(keys)) * softmax_scale  # sum of |q_i k_i|
    t = np.arange(keys.shape[1])
    visible = t[None, None, :] < (np.asarray(lens)[:, None] - s_q + np.arange(s_q)[None, :] + 1)[..., None]
    return scores, magnitude, visible[:, :, None, :]


def _largest_score_magnitude(heads, s_q, seq_lens) -> float:
    """The largest sum of |q_i k_i| (softmax-scaled) of a visible score of ``_check``'s inputs."""
    q, q_rope, latent, scale, rope, block_table, lens = _inputs(heads + s_q, batch=len(seq_lens), heads=heads,
                                                                pages_per_row=5, seq_lens=seq_lens, s_q=s_q)
    _, magnitude, visible = _exact_scores(q, q_rope, latent, scale, rope, block_table, lens, 576 ** -0.5)
    return float(np.where(visible, magnitude, 0.0).max())


def _query_terms_errors(heads, s_q, seq_lens, layer_pages, splits, *, interpret=True):
    """The 16-row kernel's lse with one and with two FP8 query terms against float64 attention on
    the cache's FP8 values (every score's error is then the query's rounding, to within float32):
    (max |lse error| with 1 term, with 2, the bound for 2 terms)."""
    q, q_rope, latent, scale, rope, block_table, lens = _inputs(11 + heads, batch=len(seq_lens), heads=heads,
                                                                pages_per_row=5, seq_lens=seq_lens, s_q=s_q)
    softmax_scale = 576 ** -0.5
    errors = []
    for terms in (1, 2):
        _, lse = _call_kernel(q, q_rope, latent, scale, rope, block_table, lens, softmax_scale,
                              layer_pages=layer_pages, num_splits=splits, interpret=interpret, kernel="small",
                              query_terms=terms)
        errors.append(np.asarray(lse, np.float64))
    scores, magnitude, visible = _exact_scores(q, q_rope, latent, scale, rope, block_table, lens, softmax_scale)
    top = np.where(visible, scores, -np.inf).max(-1, keepdims=True)
    seen = np.asarray(lens) > 0
    exact = (top[..., 0] + np.log(np.where(visible, np.exp(scores - top), 0.0).sum(-1)))[seen]
    one, two = (float(np.max(np.abs(lse[seen] - exact))) for lse in errors)
    # e4m3 keeps 3 mantissa bits: a value's rounding is at most 2^-4 of it, a subnormal's at most
    # 2^-10 of its row's scale (amax / 448); the second term rounds what the first leaves, so each
    # feature of the query errs by at most 2^-8 of itself plus subnormal steps, and a score by
    # 2^-8 of the sum of |q_i k_i| (a log-sum-exp moves by at most its largest score's error).
    # 1e-4: float32 sums of O(10) scores and exp2 / log2 (the lse bound of the reference tests).
    bound = 2.0 ** -8 * float(np.where(visible, magnitude, 0.0).max()) + 1e-4
    return one, two, bound


@QUERY_TERMS_CASES
def test_small_kernel_interpreted_two_query_terms_match_reference(heads, s_q, seq_lens, layer_pages, splits):
    """Two FP8 query terms through the inputs launch (rows padded to the block, the second term
    from ``query_rest``) and in the kernel (``quantize_query``): the kernel against
    ``mla_decode_reference(query_terms=2)``."""
    err, lse_err, _ = _check_in_subprocess(heads, s_q, seq_lens, layer_pages, splits, kernel="small",
                                           query_terms=2)
    assert err < (4e-3 if splits == 1 else 4e-3 + 2.0 ** -8), err  # as test_small_kernel_interpreted_matches_reference
    # One term's products of e4m3 values sum exactly in float32 in any order; the second term's,
    # 2^-4 of the first's, do not: float32 sums of 512 products in two orders differ by at most
    # 512 x 2^-24 of the sum of their magnitudes (measured: 1.8e-3 at a score of 141 whose
    # magnitude is ~2^13 times float32's spacing there). 1e-4: as the one-term test.
    assert lse_err < 2.0 ** -15 * _largest_score_magnitude(heads, s_q, seq_lens) + 1e-4, lse_err


@QUERY_TERMS_CASES
def test_small_kernel_interpreted_two_query_terms_remove_the_querys_rounding(heads, s_q, seq_lens, layer_pages,
                                                                             splits):
    """The second term takes the query's rounding from 2^-4 to 2^-8 of each feature: the lse
    against float64 attention on the same FP8 cache stays within that bound, and at least 8x
    below the one-term kernel's error (16x in the worst case of both bounds; 8x leaves room for
    float32)."""
    one, two, bound = _in_subprocess(f"_query_terms_errors({heads}, {s_q}, {seq_lens!r}, {layer_pages}, {splits})")
    assert two < bound, (two, bound)
    assert two * 8 < one, (one, two)


@pytest.mark.gpu
@QUERY_TERMS_CASES
def test_small_kernel_two_query_terms_remove_the_querys_rounding(heads, s_q, seq_lens, layer_pages, splits):
    """Compiled: as interpreted, plus Hopper's FP8 accumulation over chains of QK_PROMOTION
    features (both terms' products), up to ~2^-9 of a score's products over 512 features
    (test_kernel_matches_reference): the bound doubles."""
    one, two, bound = _query_terms_errors(heads, s_q, seq_lens, layer_pages, splits, interpret=False)
    assert two < 2 * bound, (two, bound)
    assert two * 4 < one, (one, two)


def test_small_kernel_refuses_other_query_terms():
    """The second term's SMEM tile fits 16-row blocks only; 1 and 2 terms are what exist."""
    q, q_rope, latent, scale, rope, block_table, lens = _inputs(0, batch=1, heads=16, pages_per_row=2,
                                                                seq_lens=[100])
    for kernel, terms in (("small32", 2), ("small", 3), ("small", 0)):
        with pytest.raises(ValueError, match="query_terms"):
            _call_kernel(q, q_rope, latent, scale, rope, block_table, lens, 0.1, interpret=True, kernel=kernel,
                         query_terms=terms)


def test_small_kernel_interpreted_float32_output():
    """float32 queries, one split: the 16-row kernel's float32 output leaves transposed, as
    its split partials do, and the launcher transposes it back."""
    err, lse_err, _ = _check_in_subprocess(16, 1, [100, 300, 0], 0, 1, kernel="small", dtype="float32")
    assert err < 4e-3, err  # as test_kernel_interpreted_matches_reference
    assert lse_err < 1e-4, lse_err


@pytest.mark.parametrize("kernel,heads", [("mgpu", 64), ("small", 16)])
def test_kernel_interpreted_float32_splits(kernel, heads):
    """float32 queries with splits: float32 partials (``partial_dtype``; the 16-row kernel's
    leave transposed), merged into a float32 output."""
    err, lse_err, _ = _check_in_subprocess(heads, 1, [320, 257, 128], 0, 2, kernel=kernel, dtype="float32")
    assert err < 4e-3, err  # as test_small_kernel_interpreted_matches_reference without a bf16 rounding
    assert lse_err < 1e-4, lse_err


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,s_q", [("small", 1), ("small32", 2)])  # 32-row blocks: the most SMEM
def test_small_kernel_float32_output(kernel, s_q):
    err, lse_err, lse_scale = _check(16, s_q, [100, 300, 0], 0, 1, interpret=False, kernel=kernel, dtype="float32")
    assert err < 2e-2, err  # as test_small_kernel_matches_reference
    assert lse_err < 2**-9 * lse_scale, (lse_err, lse_scale)


def _layered_fp8_cache(rng, pages: int, layers: int = 2):
    """A random fp8 LatentCache [layers, pages, 64, ...] with outlier tokens (300x, 2%)."""
    from snapmla_jax.cache import LatentCache

    x = rng.standard_normal((layers, pages, 64, 512)).astype(np.float32)
    x[rng.random((layers, pages, 64)) < 0.02] *= 300.0  # outlier tokens
    latent, scale = quantize_per_token(jnp.asarray(x))
    return LatentCache(latent=latent, scale=scale,
                       rope=jnp.asarray(rng.standard_normal((layers, pages, 64, 64)), jnp.bfloat16))


def _api_check(seed: int, backend: str = "interpret", heads: int = 24, s_q: int = 2,
               page_size: int = 64, row_tokens: int = 256) -> tuple[float, float, float]:
    """``mla_decode`` (a Mosaic kernel), ``backend`` vs xla, through the public API.

    A 2-layer fp8 cache of ``page_size``-token pages (768 tokens a layer) read at layer 1,
    ``heads`` x ``s_q`` rows (API_SHAPES), ragged lengths incl. 0, 2 KV splits, each row's
    pages scrambled over the cache; a table of ``row_tokens`` a row (past 256 tokens its columns
    repeat the row's pages: they widen its capacity, which ``mosaic_kernel`` routes by). Returns (max output error / max |xla|, max lse error,
    max |lse|).
    """
    from snapmla_jax.decode import mla_decode

    rng = np.random.default_rng(seed)
    pages, batch = 12, 3
    cache = _layered_fp8_cache(rng, pages)
    if page_size != 64:  # the same tokens in pages of page_size
        cache = jax.tree.map(lambda a: a.reshape(2, pages * 64 // page_size, page_size, *a.shape[3:]), cache)
    num_pages, per_row = pages * 64 // page_size, -(-256 // page_size)
    # Rows share pages where the layer has fewer than the table (pages of 48 tokens).
    ids = np.concatenate([rng.permutation(num_pages) for _ in range(-(-batch * per_row // num_pages))])
    block_table = ids[:batch * per_row].reshape(batch, per_row)
    block_table = jnp.asarray(np.tile(block_table, (1, row_tokens // 256)), jnp.int32)
    seq_lens = jnp.asarray([250, 0, 131], jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, s_q, heads, 512)) * 0.3, jnp.bfloat16)
    q_rope = jnp.asarray(rng.standard_normal((batch, s_q, heads, 64)) * 0.3, jnp.bfloat16)
    run = lambda backend: mla_decode(q, q_rope, cache, block_table, seq_lens, softmax_scale=576 ** -0.5, layer=1,
                                     backend=backend, return_lse=True, num_splits=2)
    (out, lse), (ref, ref_lse) = run(backend), run("xla")
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    seen = np.asarray(seq_lens) > 0
    assert np.all(out[~seen] == 0) and np.all(np.isneginf(np.asarray(lse)[~seen]))
    err = np.max(np.abs(out[seen] - ref[seen])) / np.max(np.abs(ref[seen]))
    ref_lse = np.asarray(ref_lse)[seen]
    return float(err), float(np.max(np.abs(np.asarray(lse)[seen] - ref_lse))), float(np.max(np.abs(ref_lse)))


# ``_api_check`` interpreted against the XLA path: the bound test_kernel_interpreted_matches_reference
# derives, a bf16 output flip (up to 2**-7 of max |ref|) and with its two splits half an ulp of a
# bf16 partial (2**-8 with the flip it moves); one such flip measured 4.03e-3 (16-token pages). A
# wrong page, scale or mask errs by O(1).
API_TOL = 2.0 ** -7 + 2.0 ** -8


@API_SHAPES
def test_mla_decode_mosaic_config_interpreted_matches_xla(heads, s_q, row_tokens):
    """The path through ``snapmla_jax.mla_decode``: kernel choice, row padding, layer offset, splits, the merge."""
    err, lse_err, _ = _in_subprocess(f"_api_check(3, heads={heads}, s_q={s_q}, row_tokens={row_tokens})")
    assert err < API_TOL, err
    assert lse_err < 1e-4, lse_err


# Pages other than 64 tokens: 128 and 256 (several 64-token pages, ``decode.mosaic_pages``), 32
# and 16 (four and eight a step), 48 (three 16-token pages); the 16-row kernel taking its query
# itself (16 and 32 rows of this small problem: a scale copy a page, of two pages at 16 tokens)
# and the 64-row one behind the inputs launch (48 rows, a wide table).
OTHER_PAGES = pytest.mark.parametrize("heads,s_q,page_size,row_tokens", [
    (16, 1, 128, 256), (24, 2, 256, 8192), (16, 1, 32, 256), (24, 2, 32, 8192), (16, 2, 32, 256),
    (16, 1, 16, 256), (24, 2, 16, 8192), (16, 2, 48, 256)])


@OTHER_PAGES
def test_mosaic_kernels_read_other_page_sizes(heads, s_q, page_size, row_tokens):
    """Against the XLA path on the same pages, with splits, a layer offset and a row whose last
    page is partial."""
    err, lse_err, _ = _in_subprocess(f"_api_check(3, heads={heads}, s_q={s_q}, page_size={page_size}, "
                                     f"row_tokens={row_tokens})")
    assert err < API_TOL, err
    assert lse_err < 1e-4, lse_err


@pytest.mark.gpu
@OTHER_PAGES
def test_mosaic_kernels_read_other_page_sizes_compiled(heads, s_q, page_size, row_tokens):
    err, lse_err, lse_scale = _api_check(3, backend="pallas", heads=heads, s_q=s_q, page_size=page_size,
                                         row_tokens=row_tokens)
    assert err < (MGPU_TOL if heads * s_q > 16 else 2e-2), err  # as test_mla_decode_mosaic_config_compiled_...
    assert lse_err < 2**-9 * lse_scale, (lse_err, lse_scale)


def test_mosaic_pages_clip_before_they_split():
    """Page ids out of range are clipped to the cache's pages before each becomes its 64-token
    pages, so the kernels read the tokens of the page the other backends clip it to."""
    from snapmla_jax.decode import mosaic_pages

    table, num_pages, page_size = mosaic_pages(jnp.asarray([[2, -1], [7, 0]], jnp.int32), 4, 128)
    assert (num_pages, page_size) == (8, 64)
    np.testing.assert_array_equal(np.asarray(table), [[4, 5, 0, 1], [6, 7, 0, 1]])
    # The largest page size the kernels read that divides the cache's: 48 = 3 x 16, 96 = 3 x 32.
    for size, sub_page in ((48, 16), (96, 32)):
        table, num_pages, page_size = mosaic_pages(jnp.asarray([[1, 9]], jnp.int32), 4, size)
        assert (num_pages, page_size) == (12, sub_page)
        np.testing.assert_array_equal(np.asarray(table), [[3, 4, 5, 9, 10, 11]])
    for size in (64, 32, 16):  # 64 tokens or fewer go as they are: the kernels clip them
        same, count, same_size = mosaic_pages(jnp.asarray([[9]], jnp.int32), 4, size)
        assert (count, same_size, int(same[0, 0])) == (4, size, 9)


@pytest.mark.gpu
@API_SHAPES
def test_mla_decode_mosaic_config_compiled_matches_xla(heads, s_q, row_tokens):
    err, lse_err, lse_scale = _api_check(3, backend="pallas", heads=heads, s_q=s_q, row_tokens=row_tokens)
    # As test_kernel_matches_reference (64-row kernel) / test_small_kernel_matches_reference.
    assert err < (MGPU_TOL if heads * s_q > 16 else 2e-2), err
    assert lse_err < 2**-9 * lse_scale, (lse_err, lse_scale)


def _clip_check(seed: int, backend: str = "interpret", heads: int = 64, s_q: int = 1) -> list:
    """``mla_decode`` (a Mosaic kernel) under jit on a traced block table with
    pages past the layer's end, negative and 10**6, and a seq_len past the table's capacity,
    against the same program on the inputs clipped as documented (pages into [0, num_pages),
    seq_lens into the capacity). A 2-layer cache read at layer 0: an unclipped page past the
    end reads layer 1, or nothing. Returns [max |difference| of outputs, of lse
    values, whether all outputs are finite]."""
    from snapmla_jax.decode import mla_decode

    rng = np.random.default_rng(seed)
    pages, batch = 10, 3
    cache = _layered_fp8_cache(rng, pages)
    table = rng.permutation(pages)[:batch * 3].reshape(batch, 3).astype(np.int32)
    table[0, 1], table[1, 0], table[2, 2] = pages + 3, -5, 10**6
    lens = np.asarray([3 * 64 - 5, 2 * 64, 3 * 64 + 40], np.int32)
    q = jnp.asarray(rng.standard_normal((batch, s_q, heads, 512)) * 0.3, jnp.bfloat16)
    q_rope = jnp.asarray(rng.standard_normal((batch, s_q, heads, 64)) * 0.3, jnp.bfloat16)
    run = jax.jit(lambda bt, sl: mla_decode(q, q_rope, cache, bt, sl, softmax_scale=576 ** -0.5, layer=0,
                                            backend=backend, return_lse=True))
    out, lse = (np.asarray(a, np.float64) for a in run(jnp.asarray(table), jnp.asarray(lens)))
    want, want_lse = (np.asarray(a, np.float64) for a in run(jnp.asarray(np.clip(table, 0, pages - 1)),
                                                              jnp.asarray(np.clip(lens, 0, 3 * 64))))
    return [float(np.max(np.abs(out - want))), float(np.max(np.abs(lse - want_lse))), bool(np.isfinite(out).all())]


@pytest.mark.parametrize("heads,s_q", [(64, 1), (16, 1)])  # the 64-row kernel and the 16-row one
def test_mosaic_kernels_clip_traced_pages_and_lengths(heads, s_q):
    """Both Mosaic kernels (and their scale gather) read what the clipped inputs read, bit for bit,
    as the XLA path does (test_mla_decode.py)."""
    out_diff, lse_diff, finite = _in_subprocess(f"_clip_check(4, heads={heads}, s_q={s_q})")
    assert finite and out_diff == 0 and lse_diff == 0, (out_diff, lse_diff, finite)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,s_q", [(64, 1), (16, 1)])
def test_mosaic_kernels_clip_traced_pages_and_lengths_compiled(heads, s_q):
    """On the GPU an unclipped page id of 10**6 would address far outside the cache."""
    out_diff, lse_diff, finite = _clip_check(4, backend="pallas", heads=heads, s_q=s_q)
    assert finite and out_diff == 0 and lse_diff == 0, (out_diff, lse_diff, finite)


def test_pages_no_kernel_reads_run_the_xla_path_with_a_warning_saying_why():
    """Pages that are not a multiple of 16 tokens: no Mosaic kernel reads them, so "interpret" (and
    "pallas") run the XLA path, the same math, with a RuntimeWarning naming the page size."""
    from snapmla_jax.cache import LatentCache
    from snapmla_jax.decode import mla_decode

    q, q_rope = jnp.ones((1, 1, 16, 512), jnp.bfloat16), jnp.ones((1, 1, 16, 64), jnp.bfloat16)
    table, lens = jnp.asarray([[1, 0]], jnp.int32), jnp.asarray([10], jnp.int32)
    for cache in (LatentCache.create(8, page_size=8, dtype="bf16"), LatentCache.create(8, page_size=24)):
        with pytest.warns(RuntimeWarning, match=f"pages of {cache.page_size} tokens .* multiple of 16 tokens"):
            out = mla_decode(q, q_rope, cache, table, lens, softmax_scale=0.1, backend="interpret")
        want = mla_decode(q, q_rope, cache, table, lens, softmax_scale=0.1, backend="xla")
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_the_interpreter_on_few_cpu_devices_is_refused_in_one_line():
    """With fewer than ``INTERPRETER_CPU_DEVICES`` CPU devices the interpreted Mosaic kernels can
    hang (``decode.INTERPRETER_CPU_DEVICES``): a ValueError naming backend and the fix."""
    from snapmla_jax import decode
    from snapmla_jax.cache import LatentCache

    if len(jax.devices("cpu")) >= decode.INTERPRETER_CPU_DEVICES:
        pytest.skip("this process has enough CPU devices")
    q, q_rope = jnp.ones((1, 1, 16, 512), jnp.bfloat16), jnp.ones((1, 1, 16, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r'backend: "interpret" .* JAX_NUM_CPU_DEVICES=8\), found 1; or use '):
        decode.mla_decode(q, q_rope, LatentCache.create(8, page_size=64), jnp.zeros((1, 2), jnp.int32),
                          jnp.asarray([10], jnp.int32), softmax_scale=0.1, backend="interpret")


def test_mla_decode_balances_splits_unless_num_splits_is_given(monkeypatch):
    """Left to ``mla_decode``, the Mosaic kernels get the plan ``planned_split`` gives past
    ``UNIFORM_PLAN_MAX_TOKENS`` of block-table capacity (a balanced split plan, or past a wave of
    rows a wave plan), and a uniform plan up to it; an explicit ``num_splits`` keeps every row at
    that count."""
    import snapmla_jax.decode as decode
    from snapmla_jax.cache import LatentCache

    calls = []

    def fake_kernel(q_rows, *args, **kw):
        calls.append((kw["num_splits"], kw["balanced"], kw["segments"]))
        return jnp.zeros(q_rows.shape, q_rows.dtype), jnp.zeros(q_rows.shape[:2], jnp.float32)

    monkeypatch.setattr(decode, "mosaic_kernel",
                        lambda rows, dtype="fp8", q_dtype=None, capacity=None, query_terms=1: (fake_kernel, 64))
    cache = LatentCache.create(8, page_size=64)
    q, q_rope = jnp.ones((2, 1, 64, 512), jnp.bfloat16), jnp.ones((2, 1, 64, 64), jnp.bfloat16)
    # 2 rows x 128 pages: one page past the uniform plan's capacity; then 4 pages a row.
    pages = decode.UNIFORM_PLAN_MAX_TOKENS // (2 * 64) + 1
    large, small = jnp.zeros((2, pages), jnp.int32), jnp.zeros((2, 4), jnp.int32)
    lens = jnp.asarray([200, 10], jnp.int32)
    monkeypatch.setattr(decode, "check_interpreter_devices", lambda: None)  # the kernel is faked
    kw = dict(softmax_scale=0.1, backend="interpret")
    decode.mla_decode(q, q_rope, cache, large, lens, **kw)
    decode.mla_decode(q, q_rope, cache, large, lens, num_splits=3, **kw)
    decode.mla_decode(q, q_rope, cache, small, lens, **kw)
    # 67 rows of 16k tokens x 128 heads: one row past a wave of two-block items.
    wide = jnp.ones((67, 1, 128, 512), jnp.bfloat16), jnp.ones((67, 1, 128, 64), jnp.bfloat16)
    long_table = jnp.zeros((67, 256), jnp.int32)
    decode.mla_decode(*wide, cache, long_table, jnp.full((67,), 16384, jnp.int32), **kw)
    planned = decode.planned_split(q, cache, large)
    assert planned[1] == 0  # two short rows: split, no wave plan
    wave = decode.planned_split(wide[0], cache, long_table)
    assert wave[1] == 66, wave
    assert calls == [(planned[0], True, 0), (3, False, 0), (decode.planned_num_splits(q, cache, small), False, 0),
                     (wave[0], True, 66)]


def test_mosaic_kernels_run_compiled_on_hopper_and_interpreted_over_pages_of_a_multiple_of_16(monkeypatch):
    import snapmla_jax.decode as decode

    assert not decode.mosaic_runs(64, "pallas")  # this CPU is no Hopper GPU: no wgmma
    assert "Hopper" in decode.no_kernel_reason(64)
    monkeypatch.setattr(decode, "_on_hopper", lambda: True)
    # Pages of any multiple of 16 tokens, read as pages of 16, 32 or 64 (``decode.mosaic_pages``).
    for dtype in ("fp8", "bf16"):
        for page_size in (16, 32, 48, 64, 96, 128):
            assert decode.mosaic_runs(page_size, "pallas", dtype), (dtype, page_size)
            assert decode.mosaic_runs(page_size, "interpret", dtype), (dtype, page_size)
            assert not decode.mosaic_runs(page_size, "xla", dtype), (dtype, page_size)
        for page_size in (8, 24, 40):
            assert not decode.mosaic_runs(page_size, "pallas", dtype), (dtype, page_size)
            assert not decode.mosaic_runs(page_size, "interpret", dtype), (dtype, page_size)
            assert f"pages of {page_size} tokens" in decode.no_kernel_reason(page_size, dtype)


def test_mla_decode_runs_small_fp8_problems_without_an_inputs_launch(monkeypatch):
    """``mla_decode``'s default routing on Hopper (faked) at H = 16: B = 1 x 4k (within
    ``UNIFORM_PLAN_MAX_TOKENS``) lowers to the 16-row Mosaic kernel taking its query itself, its
    merge on Mosaic GPU; B = 8 x 4k (32k tokens of capacity) to the same kernel,
    still taking its query itself, behind the plan-only launch of its balanced plan (what each
    lowers to, without a GPU)."""
    import snapmla_jax.decode as decode
    from snapmla_jax.cache import LatentCache

    monkeypatch.setattr(decode, "_on_hopper", lambda: True)
    monkeypatch.setattr(decode, "resolve_backend", lambda backend: "pallas")  # lowered for CUDA here
    cache = LatentCache.create(8 * 64 + 2, page_size=64)
    kernels = {}
    for batch in (1, 8):
        q = jnp.zeros((batch, 1, 16, 512), jnp.bfloat16)
        q_rope = jnp.zeros((batch, 1, 16, 64), jnp.bfloat16)
        table = jnp.zeros((batch, 64), jnp.int32)  # 4096 tokens of capacity a row
        call = lambda q, qr, t: decode.mla_decode(q, qr, cache, t, jnp.full((t.shape[0],), 100, jnp.int32),
                                                  softmax_scale=0.1, backend="pallas")
        text = lower_for_cuda(call, q, q_rope, table).as_text()
        kernels[batch] = ("snapmla_decode_fp8_mgpu_small" in text, "snapmla_mgpu_decode_inputs" in text,
                          "snapmla_split_plan" in text)
    assert kernels == {1: (True, False, False), 8: (True, False, True)}, kernels


def test_small_kernel_refuses_other_row_blocks():
    from snapmla_jax.pallas_kernels.mla_decode_mgpu_small import mla_decode_mgpu_small
    q, q_rope, latent, scale, rope, block_table, lens = _inputs(0, batch=1, heads=16, pages_per_row=2, seq_lens=[70])
    with pytest.raises(ValueError, match="block_rows"):
        mla_decode_mgpu_small(q[:, 0], q_rope[:, 0], (latent.reshape(-1, 512), scale.reshape(-1), rope.reshape(-1, 64)),
                              block_table, lens, jnp.zeros((1,), jnp.int32), softmax_scale=0.1, page_size=64, s_q=1,
                              num_heads=16, block_rows=24)


def _frame_steps(steps):
    """The 64-row kernel's per-step softmax (``softmax_frame``) and fold over ``steps`` [(scores base 2
    [R, T], k_scale [T], v [T, D])] in float32 jnp, without e4m3 rounding: O' = O' * ratio + P'.V,
    O = O' / l at the end. Returns (O, 0 for rows that saw nothing, as the kernel writes them; the
    lse in base 2; P' of every step; the accumulator before the end's scaling)."""
    rows = steps[0][0].shape[0]
    m = jnp.full((rows,), -jnp.inf, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    f = jnp.full((rows,), -jnp.inf, jnp.float32)
    o = jnp.zeros((rows, steps[0][2].shape[1]), jnp.float32)
    p_all = []
    for scores, k_scale, v in steps:
        log_pv = scores + jnp.log2(k_scale)[None]
        m, l, f, p, ratio = mgpu_kernel.softmax_frame(log_pv, 1.0 / k_scale, m, l, f, log_pv.max(axis=1))
        o = o * ratio[:, None] + p @ v
        p_all.append(p)
    accumulated = o
    seen = l > 0
    out = jnp.where(seen[:, None], o / jnp.where(seen, l, 1.0)[:, None], 0.0)
    lse2 = jnp.where(seen, f + jnp.log2(jnp.where(seen, l, 1.0)) - mgpu_kernel.LOG2_FP8_MAX, -jnp.inf)
    return out, lse2, p_all, accumulated


def test_softmax_frame_rounds_p_as_the_block_max_rule():
    """``softmax_frame``: each step's P' is 448 * P * k_scale / its row's largest P * k_scale (the
    reference's rule: ``mla_decode_reference``), its largest exactly 448 (an e4m3 value), and the
    fold's output and lse are the float64 softmax's (float32 rounding apart, bounded below); a step
    100 (base 2) below the running max (frame clamped, its P' then underflows as fp32 would beside
    the max token) neither overflows nor changes the output beyond that; a first step whose rows
    see nothing stays 0, not NaN."""
    rng = np.random.default_rng(7)
    rows, tokens, dim = 8, 64, 16

    def step(offset):
        scores = jnp.asarray(rng.standard_normal((rows, tokens)) * 4 + offset, jnp.float32)
        k_scale = jnp.asarray(np.exp(rng.standard_normal(tokens) * 2), jnp.float32)  # scales ~50x apart
        return scores, k_scale, jnp.asarray(rng.standard_normal((tokens, dim)), jnp.float32)

    steps = [step(0.0), step(6.0), step(-3.0)]
    out, lse2, p_all, _ = _frame_steps(steps)
    for (scores, k_scale, _), p in zip(steps, p_all):
        pv = np.exp2(np.asarray(scores, np.float64)) * np.asarray(k_scale, np.float64)[None]
        np.testing.assert_allclose(np.asarray(p), 448.0 * pv / pv.max(axis=1, keepdims=True), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(p).max(axis=1), 448.0, rtol=2.0 ** -20)
    scores64 = np.concatenate([np.asarray(s, np.float64) for s, _, _ in steps], axis=1)
    # V is the stored latent: the value a token carries is k_scale * v.
    v64 = np.concatenate([np.asarray(k, np.float64)[:, None] * np.asarray(v, np.float64) for _, k, v in steps],
                         axis=0)
    weights = np.exp2(scores64 - scores64.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    # The output is a weighted sum whose terms cancel (the smallest |O| here is ~1e-3 of its
    # terms'), so its float32 error is bounded relative to the terms' size, sum_i w_i |x_i|, not
    # relative to O. With eps = 2^-24: each P' is off by under 48 eps relative (its exponent,
    # below 32 in size, is rounded in float32 about three times (+ log2 k, - frame, + log2 448):
    # <= 3 x 2^-20 absolute, ~33 eps relative after x ln 2, plus log2's and exp2's own ulps;
    # measured: 19 eps), and the same factor sits in l, so O moves by
    # <= 2 x 48 eps x sum_i w_i |x_i|; the P'.V dot over 64 tokens, the 3 steps' rescaled
    # fold and the final division add <= gamma_68 ~ 68 eps of it whatever the summation order
    # (which XLA's CPU dot is free to change between jax releases). Together ~164 eps = 1e-5.
    # Measured: 9 eps (jax 0.11.2) and 12.5 eps (0.12.0.1) of the terms' size.
    terms = weights @ np.abs(v64)

    def assert_within_rounding(actual, expected):
        np.testing.assert_array_less(np.abs(np.asarray(actual, np.float64) - expected), 1e-5 * terms)

    assert_within_rounding(out, weights @ v64)
    np.testing.assert_allclose(np.asarray(lse2), np.log2(np.exp2(scores64).sum(axis=1)), rtol=1e-6)

    far = steps + [step(-100.0)]  # every P * k_scale ~2^-100 of the max token's: the frame clamps
    out_far, _, _, accumulated = _frame_steps(far)
    assert np.all(np.isfinite(np.asarray(accumulated)))
    assert_within_rounding(out_far, np.asarray(out, np.float64))

    # Rows that see nothing in their first step, then a real one: nothing NaN accumulates.
    unseen = (jnp.full((rows, tokens), -jnp.inf, jnp.float32), steps[0][1], steps[0][2])
    o_unseen, lse_unseen, _, accumulated = _frame_steps([unseen])
    assert np.all(np.asarray(accumulated) == 0) and np.all(np.asarray(o_unseen) == 0)
    assert np.all(np.asarray(lse_unseen) == -np.inf)
    late, _, _, _ = _frame_steps([unseen] + steps)
    assert_within_rounding(late, np.asarray(out, np.float64))


@pytest.mark.parametrize("kernel,rows", [("mgpu", 128), ("small", 16)])
def test_a_batch_past_cudas_grid_y_is_refused_at_trace_time_naming_it(kernel, rows):
    """The decode kernels put their work items in CUDA's grid y, which takes at most 65535: a call
    of more is refused when traced, saying what to do, not at launch (CUDA_ERROR_INVALID_VALUE)."""
    S = jax.ShapeDtypeStruct
    batch, tokens = 65536, 256
    args = (S((batch, rows, 512), jnp.bfloat16), S((batch, rows, 64), jnp.bfloat16),
            (S((tokens, 512), jnp.float8_e4m3fn), S((tokens,), jnp.float32), S((tokens, 64), jnp.bfloat16)),
            S((batch, 1), jnp.int32), S((batch,), jnp.int32), S((1,), jnp.int32))
    kernel_fn = _kernel_and_rows(kernel)[0]
    with pytest.raises(ValueError, match="seq_lens: 65536 work items for 65536 batch rows, past the 65535 a CUDA "
                                         "grid's y takes; decode the batch in parts"):
        lower_for_cuda(functools.partial(kernel_fn, softmax_scale=0.1, page_size=64, s_q=1, num_heads=rows, num_splits=1),
                       *args)

"""``mla_decode``: Multi-head Latent Attention decode over the paged latent cache.

Validates arguments, picks the backend (``snapmla_jax.backend``), chooses the
split-KV count from the shapes and the GPU's SM count, and lays queries out as
the kernel's rows. The Mosaic GPU kernels live in ``pallas_kernels/mla_decode_mgpu*.py``, the
pure-jnp path (backend "xla", and where no kernel serves the call) in
``pallas_kernels/mla_decode_reference.py``.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from snapmla_jax.pallas_kernels.mla_decode_mgpu import BLOCK_M as MOSAIC_BLOCK_M
from snapmla_jax.pallas_kernels.mla_decode_mgpu import PAGE_SIZES as MOSAIC_FP8_PAGE_SIZES
from snapmla_jax.pallas_kernels.mla_decode_mgpu import STEP as MOSAIC_STEP
from snapmla_jax.pallas_kernels.mla_decode_mgpu import mla_decode_mgpu
from snapmla_jax.pallas_kernels.mla_decode_mgpu import QK_PROMOTIONS, check_qk_promotion
from snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16 import PAGE_SIZES as MOSAIC_TWIN_PAGE_SIZES
from snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16 import STEP as MOSAIC_TWIN_STEP
from snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16 import mla_decode_mgpu_bf16
from snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16_small import ROWS as MOSAIC_BF16_SMALL_ROWS
from snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16_small import mla_decode_mgpu_bf16_small
from snapmla_jax.pallas_kernels.mla_decode_mgpu_bf16_small import takes as bf16_small_takes
from snapmla_jax.pallas_kernels.mla_decode_mgpu_small import BLOCK_ROWS as MOSAIC_SMALL_BLOCK_ROWS
from snapmla_jax.pallas_kernels.mla_decode_mgpu_small import QUERY_IN_KERNEL_ROWS as MOSAIC_QUERY_IN_KERNEL_ROWS
from snapmla_jax.pallas_kernels.mla_decode_mgpu_small import QUERY_TERMS, mla_decode_mgpu_small
from snapmla_jax.pallas_kernels.mla_decode_reference import mla_decode_reference
from snapmla_jax.backend import on_hopper as _on_hopper  # a module name the tests fake
from snapmla_jax.backend import resolve_backend
from snapmla_jax.backend import sm_count as _sm_count
from snapmla_jax.cache import LatentCache, check_kernel_addressable, check_layer

# Up to this many tokens of block-table capacity over the batch the Mosaic kernels take a uniform
# split plan (``uniform_plan_only``).
UNIFORM_PLAN_MAX_TOKENS = 16384
# Up to this many tokens of block-table capacity over the batch, 17-32 bf16 query rows over a bf16
# cache run a 16-row kernel in two row blocks, above it the 64-row one (``mosaic_kernel``). Over an
# fp8 cache, bf16 rows in whole 16-row blocks run the 16-row kernel up to this capacity and up to
# SMALL_BLOCKS_MAX_WORK query rows x tokens of capacity.
SMALL_BLOCKS_MAX_TOKENS = 16384
SMALL_BLOCKS_MAX_WORK = 2**20
# The Mosaic decode kernels in Pallas' interpreter run each warpgroup as a thread whose memory
# operations are host callbacks; with two warpgroups waiting on each other's barriers, one's
# callbacks can starve behind the other's blocked wait when the CPU client has few devices (on a
# 2-core machine 1 run in 3 hung; with 8 CPU devices 18 of 18 finished). The count is fixed when
# JAX starts, so ``mla_decode`` refuses to interpret them on fewer (``check_interpreter_devices``).
INTERPRETER_CPU_DEVICES = 8
# Past this the merge's float32 partials outweigh the extra parallelism. (H100, H=16,
# B=1 x 64k: 128 splits 0.047 ms, 64 splits 0.062 ms; scripts/sweep_splits.py.)
MAX_SPLITS = 128


# choose_num_splits' cost model, in steps of one CTA: a work item's fixed cost (its query's
# load, the pipeline's fill, its output's store), and the merge's launch and its read of the
# partials (about one step a wave of partial tiles: a 64 x 512 bf16 tile against a 128-token
# FP8 step of 82 KB a CTA).
ITEM_STEPS = 2.0
MERGE_STEPS = 1.5
MERGE_STEPS_PER_WAVE = 1.0


def split_cost(batch: int, row_blocks: int, steps: int, splits: int, slots: int, overhead: float = 1.0) -> float:
    """Modelled time, in steps of one CTA, of a call whose ``batch`` x ``row_blocks`` CTAs each
    walk ``steps`` steps cut into ``splits`` items, ``slots`` CTAs running at a time: whole waves
    of items (a partial wave costs as much as a full one), each item its steps plus
    ``ITEM_STEPS``, and the merge of the partials when there are splits; the fixed costs times
    ``overhead`` (their size in this kernel's steps against the steps they were fitted to)."""
    ctas = batch * row_blocks * splits
    cost = -(-ctas // slots) * (-(-steps // splits) + ITEM_STEPS * overhead)
    if splits > 1:
        cost += (MERGE_STEPS + MERGE_STEPS_PER_WAVE * ctas / slots) * overhead
    return cost


def choose_num_splits(batch: int, row_blocks: int, max_tokens: int, num_sms: int, min_tokens: int,
                      overhead: float = 1.0) -> int:
    """Split-KV count: the one of least ``split_cost`` for rows of ``max_tokens`` tokens in steps
    of ``min_tokens`` (no split shorter than a step), at most MAX_SPLITS, with ``num_sms`` CTAs
    running at a time and the fixed costs times ``overhead`` (``split_overhead``). One CTA an SM:
    each Mosaic kernel keeps its SM busy from its own TMA pipeline (H100, H=128 x 16k: B=32
    2 splits 0.426 ms vs 4 splits 0.444; B=16 4 splits 0.247 vs 8 splits 0.268).

    Counting whole waves is what keeps the time smooth in the batch size: one more row than a
    wave holds would otherwise cost a second wave as long as the first (H=128 x 16k: B=72 runs
    144 CTAs on 132 SMs); cut into five, its 720 items fill six waves of a fifth of the steps.
    """
    steps = max(1, -(-max_tokens // min_tokens))
    slots = num_sms
    candidates = range(1, min(MAX_SPLITS, steps) + 1)
    return min(candidates, key=lambda splits: (split_cost(batch, row_blocks, steps, splits, slots, overhead), splits))


# A wave plan's own cost beyond its items, in steps: its XLA launches (a sort and a few fused ops).
WAVE_PLAN_STEPS = 2.0


def wave_cost(batch: int, row_blocks: int, steps: int, slots: int, overhead: float = 1.0) -> float:
    """Modelled time, in steps of one CTA, of a wave plan (``pallas_kernels.split_plan.wave_plan``)
    for ``batch`` rows of ``steps`` steps in ``row_blocks`` blocks of query rows: the batch's
    steps cut into ``wave_segments`` segments, one a CTA slot, each run as its pieces (on
    average (B + segments) / segments of them, each with its ``ITEM_STEPS``), then the merge of
    the partials and the plan's own launches (fixed costs times ``overhead`` as in
    ``split_cost``)."""
    segments = wave_segments(row_blocks, slots)
    pieces = (batch + segments) / segments
    cost = -(-batch * steps // segments) + ITEM_STEPS * overhead * pieces
    return cost + (MERGE_STEPS + MERGE_STEPS_PER_WAVE * pieces + WAVE_PLAN_STEPS) * overhead


def wave_segments(row_blocks: int, slots: int) -> int:
    """A wave plan's segments: as many as the items whose ``row_blocks`` CTAs fill ``slots``."""
    return max(1, slots // row_blocks)


def choose_plan(batch: int, row_blocks: int, max_tokens: int, num_sms: int, min_tokens: int,
                overhead: float = 1.0) -> tuple[int, int]:
    """(num_splits, segments) of a call whose plan follows the rows (``mla_decode``'s default
    above ``UNIFORM_PLAN_MAX_TOKENS``): ``choose_num_splits``' count and segments 0, or, where
    its modelled time is below that of the best split count, a wave plan (``wave_cost``) with
    its segments and, as num_splits, the items a full row has at most (what the merge loads at
    a time). The wave plan wins where whole waves of items leave SMs idle: past a multiple of a
    wave of rows (H = 128 x 16k on 132 SMs: B = 67, 72, 100, 140, 200), not at B = 64 or 66."""
    splits = choose_num_splits(batch, row_blocks, max_tokens, num_sms, min_tokens, overhead)
    steps = max(1, -(-max_tokens // min_tokens))
    if wave_cost(batch, row_blocks, steps, num_sms, overhead) >= split_cost(batch, row_blocks, steps, splits, num_sms,
                                                                          overhead):
        return splits, 0
    segments = wave_segments(row_blocks, num_sms)
    per_segment = -(-batch * steps // segments)
    return min(MAX_SPLITS, -(-steps // per_segment) + 1), segments


def uniform_plan_only(capacity_tokens: int) -> bool:
    """Whether a Mosaic kernel call over ``capacity_tokens`` tokens of block-table capacity (B x
    max_pages x page_size) takes a uniform split plan (``num_splits`` items a row) even where
    ``mla_decode`` picks the split count: up to ``UNIFORM_PLAN_MAX_TOKENS``. A balanced plan is
    computed on the device, in the launch that prepares the query (``mgpu_decode_inputs``) or,
    for the 16-row kernel, which takes its query itself, in a launch of its own; a uniform one is
    a constant: one launch fewer, which is much of a small call. Small problems have few steps a
    row, so there is little left to balance."""
    return capacity_tokens <= UNIFORM_PLAN_MAX_TOKENS


def min_tokens_per_split(cache_dtype: str = "fp8") -> int:
    """The shortest split ``choose_num_splits`` makes for the Mosaic kernels over a ``cache_dtype``
    cache: one step of them. 128 tokens for the FP8 kernels, a 64-token page for the BF16 twins.

    A one-page split for the twins, against two pages, at B = 1: 10.98 vs 12.50 us a call at
    1 x 1k x 16 heads, 13.24 vs 15.02 at 1 x 1k x 128; no slower at 1 x 4k, 2 x 2k-4k and 8 x 1k
    (H200, jax 0.11.2, round-robin, calls chained over the layers of the cache)."""
    return MOSAIC_TWIN_STEP if cache_dtype == "bf16" else MOSAIC_STEP


def split_overhead(cache_dtype: str = "fp8") -> float:
    """``split_cost``'s fixed costs in steps of the Mosaic kernel of a ``cache_dtype`` cache
    (``min_tokens_per_split``): they were fitted in 128-token steps of the FP8 kernels, so the
    twins' one-page steps count them twice. So the twins' split counts stay near those of
    128-token splits, and double at small batches of short rows, where one-page items fill the
    SMs (1-8 rows of 1k-4k tokens: the measurements in ``min_tokens_per_split``)."""
    return MOSAIC_STEP / min_tokens_per_split(cache_dtype)


def planned_num_splits(q_latent: jax.Array, cache: LatentCache, block_table: jax.Array, query_terms: int = 1) -> int:
    """The split-KV count ``mla_decode`` gives its Mosaic kernel for these arguments when
    ``num_splits`` is None (q_latent [B, s_q, H, R])."""
    batch, s_q, heads, _ = q_latent.shape
    block_m = mosaic_kernel(s_q * heads, cache.dtype, q_latent.dtype, capacity_tokens(block_table, cache),
                            query_terms)[1]
    return choose_num_splits(batch, -(-(s_q * heads) // block_m), block_table.shape[1] * cache.page_size,
                             _sm_count(), min_tokens_per_split(cache.dtype), split_overhead(cache.dtype))


def planned_split(q_latent: jax.Array, cache: LatentCache, block_table: jax.Array,
                  query_terms: int = 1) -> tuple[int, int]:
    """``choose_plan``'s (num_splits, segments) for a call of ``mla_decode`` with these arguments
    whose plan follows the rows (num_splits None, above ``UNIFORM_PLAN_MAX_TOKENS``)."""
    batch, s_q, heads, _ = q_latent.shape
    block_m = mosaic_kernel(s_q * heads, cache.dtype, q_latent.dtype, capacity_tokens(block_table, cache),
                            query_terms)[1]
    return choose_plan(batch, -(-(s_q * heads) // block_m), block_table.shape[1] * cache.page_size, _sm_count(),
                       min_tokens_per_split(cache.dtype), split_overhead(cache.dtype))


def capacity_tokens(block_table: jax.Array, cache: LatentCache) -> int:
    """Tokens of block-table capacity over the batch: B x max_pages x page_size."""
    return block_table.shape[0] * block_table.shape[1] * cache.page_size


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _validate(q_latent, q_rope, cache, block_table, seq_lens, softmax_scale, layer) -> None:
    if not isinstance(cache, LatentCache):
        raise ValueError(f"cache: expected a LatentCache, got {type(cache).__name__}")
    rank, rope_dim = cache.kv_lora_rank, cache.rope_dim
    if q_latent.ndim != 4 or q_latent.shape[3] != rank:
        raise ValueError(f"q_latent: expected shape [B, s_q, H, {rank}], got {list(q_latent.shape)}")
    batch, s_q, heads, _ = q_latent.shape
    if tuple(q_rope.shape) != (batch, s_q, heads, rope_dim):
        raise ValueError(f"q_rope: expected shape {[batch, s_q, heads, rope_dim]} (B, s_q, H as q_latent), "
                         f"got {list(q_rope.shape)}")
    for name, arr in (("q_latent", q_latent), ("q_rope", q_rope)):
        if arr.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
            raise ValueError(f"{name}: expected bfloat16/float16/float32, got {arr.dtype}")
    if batch == 0 or s_q == 0 or heads == 0:
        raise ValueError(f"q_latent: expected non-empty B, s_q, H, got {list(q_latent.shape)}")
    if block_table.ndim != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table: expected shape [{batch}, max_pages], got {list(block_table.shape)}")
    if block_table.dtype != jnp.int32:
        raise ValueError(f"block_table: expected int32, got {block_table.dtype}")
    if tuple(seq_lens.shape) != (batch,):
        raise ValueError(f"seq_lens: expected shape [{batch}], got {list(seq_lens.shape)}")
    if seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens: expected int32, got {seq_lens.dtype}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        raise ValueError(f"softmax_scale: expected a positive python float, got {softmax_scale!r}")
    check_layer(cache, layer)
    if _is_concrete(seq_lens):
        lens = np.asarray(seq_lens)
        capacity = block_table.shape[1] * cache.page_size
        if (lens < 0).any() or (lens > capacity).any():
            bad = int(np.flatnonzero((lens < 0) | (lens > capacity))[0])
            raise ValueError(f"seq_lens: expected values in [0, {capacity}] (block_table holds "
                             f"{block_table.shape[1]} pages of {cache.page_size}), got {int(lens[bad])} at row {bad}")
        if _is_concrete(block_table):
            table = np.asarray(block_table)
            used = np.arange(table.shape[1])[None, :] < -(-lens[:, None] // cache.page_size)
            bad = used & ((table < 0) | (table >= cache.num_pages))
            if bad.any():
                row, col = (int(v[0]) for v in np.nonzero(bad))
                raise ValueError(f"block_table: expected page ids in [0, {cache.num_pages}) for the pages "
                                 f"seq_lens uses, got {int(table[row, col])} at [{row}, {col}]")


def mosaic_page_sizes(cache_dtype: str) -> tuple:
    """The page sizes the Mosaic GPU kernels of a ``cache_dtype`` cache read (several pages a step
    below 64 tokens): 16, 32 and 64, for the FP8 kernels and the BF16 twins alike."""
    return MOSAIC_TWIN_PAGE_SIZES if cache_dtype == "bf16" else MOSAIC_FP8_PAGE_SIZES


def mosaic_sub_page(page_size: int, cache_dtype: str) -> int | None:
    """The pages the Mosaic GPU kernels read a ``cache_dtype`` cache of ``page_size``-token pages
    as: the largest of ``mosaic_page_sizes`` dividing it (``mosaic_pages``), None if none does."""
    sizes = [size for size in mosaic_page_sizes(cache_dtype) if page_size % size == 0]
    return max(sizes) if sizes else None


def mosaic_takes(page_size: int, cache_dtype: str) -> bool:
    """Whether the Mosaic GPU kernels take a ``cache_dtype`` cache of ``page_size``-token pages:
    a multiple of one of ``mosaic_page_sizes`` (16 tokens)."""
    return mosaic_sub_page(page_size, cache_dtype) is not None


def mosaic_runs(page_size: int, backend: str, cache_dtype: str = "fp8") -> bool:
    """Whether ``mla_decode`` runs a Mosaic GPU kernel for a ``cache_dtype`` cache of
    ``page_size``-token pages under the resolved ``backend``: compiled ("pallas") on a Hopper GPU
    or interpreted ("interpret"), over pages they take (``mosaic_takes``). Elsewhere it runs the
    XLA path of the same math (``no_kernel_reason``)."""
    return mosaic_takes(page_size, cache_dtype) and (backend == "interpret" or (backend == "pallas" and _on_hopper()))


def no_kernel_reason(page_size: int, cache_dtype: str = "fp8") -> str:
    """Why no Mosaic GPU kernel serves a compiled or interpreted call over a ``cache_dtype`` cache
    of ``page_size``-token pages (``mosaic_runs`` is False there), in words."""
    if not mosaic_takes(page_size, cache_dtype):
        return (f"its pages of {page_size} tokens (the Mosaic GPU kernels read pages of a multiple of "
                f"{min(mosaic_page_sizes(cache_dtype))} tokens)")
    return f"a {jax.devices()[0].device_kind} (the Mosaic GPU kernels need a Hopper GPU: wgmma and TMA)"


def check_interpreter_devices() -> None:
    """ValueError naming ``backend`` where Pallas' interpreter would run a Mosaic decode kernel on
    fewer than ``INTERPRETER_CPU_DEVICES`` CPU devices."""
    found = len(jax.devices("cpu"))
    if found < INTERPRETER_CPU_DEVICES:
        raise ValueError(f'backend: "interpret" runs the Mosaic GPU decode kernels in Pallas\' interpreter, which '
                         f"needs {INTERPRETER_CPU_DEVICES} CPU devices (start Python with "
                         f"JAX_NUM_CPU_DEVICES={INTERPRETER_CPU_DEVICES}), found {found}; or use backend=\"xla\"")


def mosaic_pages(block_table: jax.Array, num_pages: int, page_size: int,
                 cache_dtype: str = "fp8") -> tuple[jax.Array, int, int]:
    """The block table [B, max_pages], page count and page size of a ``cache_dtype`` cache of
    ``page_size``-token pages as the Mosaic kernels read it: pages of S = ``mosaic_sub_page``
    tokens, k = page_size / S of them a page (page p's tokens are rows p * page_size .. of the
    flat arrays, the same rows as S-token pages k p .. k p + k - 1): (block table
    [B, max_pages * k], num_pages * k, S). Pages the kernels read as they are, as they are (no
    launch). Page ids are clipped into [0, num_pages) first, as every backend clips a traced
    table's, so that a bad id reads the same tokens everywhere."""
    sub_page = mosaic_sub_page(page_size, cache_dtype)
    k = page_size // sub_page
    if k == 1:
        return block_table, num_pages, page_size
    pages = jnp.clip(block_table, 0, num_pages - 1)
    sub_pages = pages[:, :, None] * k + jnp.arange(k, dtype=block_table.dtype)
    return sub_pages.reshape(block_table.shape[0], -1), num_pages * k, sub_page


def mosaic_kernel(num_rows: int, cache_dtype: str = "fp8", q_dtype=jnp.bfloat16, capacity: int | None = None,
                  query_terms: int = 1):
    """The Mosaic GPU kernel for ``num_rows`` query rows (s_q x heads) of ``q_dtype`` a batch row
    over a ``cache_dtype`` cache of ``capacity`` tokens of block-table capacity over the batch
    (``capacity_tokens``; None: large), with the fp8 query in ``query_terms`` FP8 terms
    (``mla_decode``'s), and its rows per CTA: (kernel function, block rows).

    A bf16 cache: up to 16 bf16 rows, and 17-32 of them up to ``SMALL_BLOCKS_MAX_TOKENS`` of
    capacity, the BF16 twin in 16-row blocks (``mla_decode_mgpu_bf16_small``, rows on the wgmma N
    dimension); else ``mla_decode_mgpu_bf16`` in 64-row blocks (its output may be float32). At 32
    rows (H = 16 x s_q = 2) two 16-row blocks read each page twice where one 64-row block reads it
    once with half its rows padding: 1.36-1.44x the 64-row twin at 1 x 1k, 8 x 1k and 1 x 16k, and
    0.70-0.78x at 8 x 32k, 32 x 16k, 128 x 16k and 64 x 16k x 32 x 1 (H200, jax 0.11.2, round-robin:
    0.0114 vs 0.0164 ms at 1 x 1k, 0.0201 vs 0.0276 at 1 x 16k, 0.140 vs 0.109 at 8 x 32k).

    An fp8 cache: up to 32 rows, ``mla_decode_mgpu_small`` in the smallest of its blocks (16 or 32
    rows) that holds them, the query rows on the wgmma N dimension; above, the 64-row
    ``mla_decode_mgpu``, its rows padded to whole blocks. All compute the same math. At 16 rows (H =
    16 at s_q = 1: DeepSeek-V2-Lite, V3 over 8 GPUs by heads) the small FP8 kernel runs 1.65-1.72x
    FlashMLA on an H100 (B >= 32) where the 64-row one, 48 of its rows padding, ran 0.74-0.79x the
    BF16 twin. At 17-32 rows (H = 16 at s_q = 2, multi-token prediction; H = 32) its 32-row blocks
    run 1.04-1.11x the 64-row kernel (H100, one process, round-robin: 0.504 vs 0.535 ms at 128 x 16k
    x 16 x 2, 0.147 vs 0.162 at 32 x 16k x 16 x 2, 0.266 vs 0.280 at 64 x 16k x 32 x 1).
    bf16 rows of a small problem in whole 16-row blocks (up to ``SMALL_BLOCKS_MAX_TOKENS`` of
    capacity and ``SMALL_BLOCKS_MAX_WORK`` rows x capacity) run its 16-row blocks instead: they
    quantize their query in the kernel, so the call saves the inputs launch, which there outweighs
    reading each page once a block. At 32 rows 1.26-1.39x the 32-row blocks at 1 x 1k, 8 x 1k,
    1 x 16k, 2 x 4k (H = 16, s_q = 2) and 4 x 4k x 32, 0.72-0.87x at 8 x 32k, 32 x 16k x 16 x 2
    and 64 x 16k x 32 (H200, jax 0.11.2, round-robin: 0.0118 vs 0.0156 ms at 1 x 1k, 0.0168 vs
    0.0223 at 1 x 16k, 0.090 vs 0.078 at 8 x 32k). At 64-256 rows against the 64-row kernel
    1.07-1.45x at 1 x 1k x 128, 1 x 4k x 128, 2 x 4k x 128, 1 x 4k x 128 x 2, 1 x 1k x 64 and
    4 x 4k x 64 (rows x capacity up to 2^20), 0.44-0.90x at 1 x 16k x 128, 8 x 2k x 128 (2^21)
    and 8 x 16k x 128 (0.0117 vs 0.0169 ms at 1 x 1k x 128, 0.0276 vs 0.0249 at 1 x 16k x 128).
    """
    small_problem = capacity is not None and capacity <= SMALL_BLOCKS_MAX_TOKENS
    if cache_dtype == "fp8" and query_terms == 2:  # only 16-row blocks hold the second term
        return functools.partial(mla_decode_mgpu_small, block_rows=MOSAIC_QUERY_IN_KERNEL_ROWS,
                                 query_terms=2), MOSAIC_QUERY_IN_KERNEL_ROWS
    if cache_dtype == "bf16":
        small = num_rows <= MOSAIC_BF16_SMALL_ROWS or (num_rows <= 2 * MOSAIC_BF16_SMALL_ROWS and small_problem)
        if small and bf16_small_takes(q_dtype):
            return mla_decode_mgpu_bf16_small, MOSAIC_BF16_SMALL_ROWS
        return mla_decode_mgpu_bf16, MOSAIC_BLOCK_M
    # The 16-row blocks that take their query in the kernel (``runs_query_in_kernel``'s rows).
    small_rows = MOSAIC_QUERY_IN_KERNEL_ROWS
    small_blocks = (q_dtype == jnp.bfloat16 and num_rows % small_rows == 0 and small_problem
                    and num_rows * capacity <= SMALL_BLOCKS_MAX_WORK)
    if num_rows <= small_rows or small_blocks:
        rows = small_rows
    elif num_rows <= MOSAIC_SMALL_BLOCK_ROWS[-1]:
        rows = MOSAIC_SMALL_BLOCK_ROWS[-1]
    else:
        return mla_decode_mgpu, MOSAIC_BLOCK_M
    return functools.partial(mla_decode_mgpu_small, block_rows=rows), rows


def mla_decode(q_latent: jax.Array, q_rope: jax.Array, cache: LatentCache, block_table: jax.Array,
               seq_lens: jax.Array, *, softmax_scale: float, layer: int | jax.Array | None = None,
               backend: str = "auto", return_lse: bool = False, num_splits: int | None = None,
               query_terms: int = 1, qk_promotion: int | None = None):
    """MLA decode attention (absorbed form) over the paged latent cache.

    q_latent    [B, s_q, H, R] bf16/f16/f32: queries in latent space (R = 512).
    q_rope      [B, s_q, H, Dr] same dtype family: rotated RoPE queries (Dr = 64).
    cache       LatentCache, fp8 or bf16, with or without a layer axis.
    block_table [B, max_pages] int32: pages of each batch row, in token order.
    seq_lens    [B] int32: cached tokens per row INCLUDING the s_q new ones;
                query i (0-based) sees tokens [0, seq_len - s_q + i]. 0 is
                allowed (out 0, lse -inf).
    softmax_scale: python float multiplying q.k (e.g. 1/sqrt(qk_head_dim)).
    layer       None for a cache without a layer axis, else an int or traced
                int32 scalar (an out-of-range traced layer yields out 0, lse -inf).
    backend     "auto" | "pallas" | "interpret" | "xla" (see snapmla_jax.backend). "pallas" and
                "interpret" run a Mosaic GPU kernel (``mosaic_kernel`` picks it by the cache,
                the query rows and their dtype) where one serves the call (``mosaic_runs``:
                pages of a multiple of 16 tokens, and compiled, a Hopper GPU); elsewhere the
                XLA path of the same math runs, with a RuntimeWarning saying why
                (``no_kernel_reason``). "interpret" needs ``INTERPRETER_CPU_DEVICES`` CPU devices.
    num_splits  split-KV count for the Mosaic kernels, the same for every row; None picks
                it from the shapes and the GPU's SM count (``planned_split``) and gives
                each row a share of the CTAs in proportion to its seq_len
                (``pallas_kernels.split_plan.balanced_plan``: a long row among short ones
                is not left to a few SMs), or where whole waves of items would leave SMs
                idle cuts the batch's steps into one segment an SM (``wave_plan``), but
                for small problems (``uniform_plan_only``).

    query_terms 1 or 2, over an fp8 cache: the latent query rounded to e4m3 once a row
                (SnapMLA's), or as two FP8 terms, that rounding and what it leaves, each
                with its own row scale and both multiplied with the same FP8 keys: the query's
                rounding drops from 2^-4 to 2^-8 of each feature. 2 runs the 16-row kernel
                (``mla_decode_mgpu_small``, whose SMEM holds the second term) at any row count:
                at up to 16 query rows a batch row that is the kernel that runs anyway; above,
                it reads each page once a 16-row block. No effect over a bf16 cache.
    qk_promotion None, 128, 256 or 512, over an fp8 cache on the Mosaic kernels: the features
                a float32 sum of the FP8 Q.K products covers. Hopper's FP8 wgmma accumulates
                with ~14 significant bits, so shorter chains keep more of each score. None:
                the kernel's own, 512 in the 64-row kernel (above 32 query rows; 128 costs
                it 8-25% at 128 heads and halves FP8's cost in answer bits on passkeys
                decoded at 64k, docs/fidelity.md) and 128 in the 16-row kernel. No effect
                over a bf16 cache or on the XLA path, which sums in float32.

    Returns out [B, s_q, H, R] in q_latent's dtype, and with ``return_lse``
    also lse [B, s_q, H] float32 (natural log of the softmax denominator).
    Over an fp8 cache every path rounds P' to e4m3 with a factor per row and 128-token step
    (``mla_decode_reference``), so the kernels and the XLA path differ by float32 rounding.
    Raises ValueError naming the argument on a shape/dtype mismatch or a num_splits that is
    not a positive int (on every backend), and when concrete, on seq_lens outside the block
    table's capacity or page ids out of range.
    Traced (under jit) they cannot be checked: every backend then clips seq_lens into
    [0, max_pages * page_size] and page ids into [0, num_pages), so no read leaves the
    cache and all backends agree; such a row's output is that of the clipped input.
    """
    _validate(q_latent, q_rope, cache, block_table, seq_lens, softmax_scale, layer)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits: expected None or a positive int, got {num_splits!r}")
    if type(query_terms) is not int or query_terms not in QUERY_TERMS:
        raise ValueError(f"query_terms: expected 1 or 2, got {query_terms!r}")
    check_qk_promotion(qk_promotion)
    backend = resolve_backend(backend)
    batch, s_q, heads, rank = q_latent.shape
    softmax_scale = float(softmax_scale)
    if backend != "xla" and not mosaic_runs(cache.page_size, backend, cache.dtype):
        warnings.warn(f"mla_decode: no Pallas kernel takes this call, for {no_kernel_reason(cache.page_size, cache.dtype)}; "
                      "it runs the XLA path of the same math (slower)", RuntimeWarning, stacklevel=2)
        backend = "xla"
    if backend == "interpret":
        check_interpreter_devices()
    if layer is not None and not _is_concrete(layer):
        # Documented behaviour for a traced out-of-range layer: nothing visible.
        seq_lens = jnp.where((layer >= 0) & (layer < cache.num_layers), seq_lens, 0)
    if backend == "xla":
        # As the kernels do for traced inputs (validated above when concrete).
        seq_lens = jnp.clip(seq_lens, 0, block_table.shape[1] * cache.page_size)
        one = cache.layer_arrays(layer)
        out, lse = mla_decode_reference(q_latent, q_rope, one.latent, one.scale, one.rope, block_table, seq_lens,
                                        softmax_scale=softmax_scale, block_n=MOSAIC_STEP, query_terms=query_terms)
        return (out, lse) if return_lse else out

    check_kernel_addressable(cache)
    num_rows = s_q * heads
    capacity = capacity_tokens(block_table, cache)
    # The kernels pad the rows to whole blocks themselves, in one launch with other inputs (the
    # FP8 kernels' query quantization, the BF16 twin's split plan): no XLA pad launches of q and
    # q_rope (2-3 us each at 64 x 32 rows on an H100).
    to_rows = lambda q: q.reshape(batch, num_rows, q.shape[-1])
    flat = lambda a: None if a is None else a.reshape(-1, *a.shape[cache.latent.ndim - 1:])
    cache_arrays = tuple(a for a in (flat(cache.latent), flat(cache.scale), flat(cache.rope)) if a is not None)
    layer_offset = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32) * cache.num_slots, (1,))
    layer_offset = jnp.clip(layer_offset, 0, (cache.num_layers or 1) * cache.num_slots - cache.num_slots)
    balanced = num_splits is None and not uniform_plan_only(capacity)
    segments = 0
    if balanced:
        num_splits, segments = planned_split(q_latent, cache, block_table, query_terms)
    elif num_splits is None:
        num_splits = planned_num_splits(q_latent, cache, block_table, query_terms)
    table, num_pages, page_size = mosaic_pages(block_table, cache.num_pages, cache.page_size, cache.dtype)
    # Only the FP8 kernels sum FP8 products.
    precision = {} if cache.dtype != "fp8" or qk_promotion is None else {"qk_promotion": qk_promotion}
    out, lse = mosaic_kernel(num_rows, cache.dtype, q_latent.dtype, capacity, query_terms)[0](
        to_rows(q_latent), to_rows(q_rope), cache_arrays, table, seq_lens, layer_offset,
        softmax_scale=softmax_scale, page_size=page_size, s_q=s_q, num_heads=heads, num_splits=num_splits,
        balanced=balanced, num_pages=num_pages, segments=segments, interpret=backend == "interpret", **precision)
    out = out[:, :num_rows].reshape(batch, s_q, heads, rank)
    lse = lse[:, :num_rows].reshape(batch, s_q, heads)
    return (out, lse) if return_lse else out

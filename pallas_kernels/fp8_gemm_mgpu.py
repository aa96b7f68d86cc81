"""Block-scaled FP8 GEMMs for decode-sized token counts on Mosaic GPU (Hopper wgmma + TMA): one
product, or a MoE layer's experts in one launch.

DeepSeek's recipe: a weight W [N, K] stored as e4m3 with one float32 scale per 128 x 128 block,
activations x [M, K] quantized per token and 128 channels on the fly, FP8 x FP8 products summed
in float32 per 128-channel block and scaled there:

  y[m, n] = sum_kb  x_scale[m, kb] * w_scale[n // 128, kb] * sum_{k in kb} x8[m, k] * w8[n, k]

For a decode step M is a few tokens and the product reads W once: its time is W's bytes. The
tokens go on the wgmma N dimension and the weight's rows on M, so W is the A operand straight
from its K-major rows and no token padding reaches 64 ("swap AB"). Each CTA computes y^T for
TILE_N = 64 weight rows and one token tile (all M up to MAX_TOKENS, else LARGE_TILE tokens) over
one split of K, its weight and token tiles streaming through a TMA pipeline; the splits' partial
sums [splits, ..., N, M] float32 are added by XLA (a 16-bit result of one split leaves as [...,
M, N] through transposed stores into SMEM, as its consumers read it). A CTA keeps a running [64,
tokens] float32 sum and a fresh accumulator for each 128-channel block of a pipeline step (the
block's scale is applied before the fresh product joins the sum, so the FP8 accumulator never
carries more than 128 channels: Hopper's FP8 wgmma keeps ~14 bits). A step issues all its
blocks' products before it reads the first, so a block's scaling runs under the next block's
product: against reading each product before issuing the next, 70.1 vs 74.7 us at 18432 x 7168 x
128 tokens, 115 vs 125 at 256, 383 vs 403 at a V2-Lite layer's 64 gate matrices x 512 tokens,
the same at 64 tokens and fewer (H200, side by side).

Groups (``fp8_grouped_gemm_mgpu``): a stack of E weight matrices [E, N, K] (a MoE layer's
experts) and G groups of tokens in one launch, grid (group, weight tile, split, token tile).
Group g multiplies its tokens (or tokens all groups share) by matrix ``matrices[g]``, read
where it lies (the MoE's gathered dispatch: one group an assignment; its sorted dispatch: one
group a chunk of one expert's tokens, negative ids skipping the chunks a call leaves unused), or
by matrix g (dense: one group an expert). Summed, the groups are the splits' contraction: a CTA's pipeline runs over
its groups' whole K, so the MoE's down projection sums over the experts inside the launch.
Several stacks of one shape (gate and up) share a launch and their tokens' quantization: the
group axis runs over each stack's groups in turn. Gated (``gated``, a MoE's gate and up), a CTA
instead multiplies its token tile by both stacks' weight rows and writes silu(gate) * up, in
bf16 where asked: neither product is written out and read back. V2-Lite's dense experts at 64
tokens (the gated launch, the down projection and the XLA between them; H100, wall, round-robin):
0.243 ms against 0.282 with gate and up written in float32 (the launches between the GEMMs 23 us
against 51), 0.250 with one 128-channel block a step instead of two (four fresh accumulators of
32 registers a step fit beside the two totals).

Either way the kernel reads each weight block's scale by matrix id. The tokens may come
quantized (x8 e4m3 and their scales [K / 128, M], streamed beside their tiles; one launch makes
both, ``quantize_activations_mgpu``) or as they are (bf16, f16, f32; ``x_scales`` None): then
each CTA quantizes its token tile per token and 128 channels in shared memory as it arrives
(``quantize_tile``; rows past M arrive as the TMA's zeros, so M needs no padding), so no launch
runs before the product. Every weight tile's CTA reads the same
tokens (from L2) in bf16, twice e4m3's bytes, against the launches it saves (the token array's TMA
takes rows in whole 8s past 8: ``tma_rows``). Compiled on an H100 at the token counts of
tests/test_fp8_gemm_mgpu.py (1, 5, 11, 16, 32, 64, 100, 256); where it pays, docs/models.md.

Measured (``scripts/bench_fp8_gemm.py``, the product chained over weight copies of >= 384 MiB,
round-robin with XLA's bf16 product of the same shape; docs/benchmarks/fp8_gemm_h100.md): on an H100
1.87-1.92x the bf16 GEMM at 16 tokens and 1.77-1.83x at 64 at 18432 x 7168 / 7168 x 18432 (76-85% of
the copy ceiling, as fast as cuBLAS' FP8 product with per-tensor scales), 1.45-1.75x at 24576 x
1536, and 1.18-1.53x at the 14-43 MiB matrices (2048 x 7168, 7168 x 2048, 10944 x 2048; 45-58% of
copy), where the launches around the kernel (the activation quantization and the partials' sum)
weigh; one launch over a layer's experts reads them at 46-83% of the copy bandwidth (H200,
scripts/bench_fp8_experts.py). Above 64 tokens each token tile re-reads its weight tile and the
CTA's one warpgroup, waiting for each block's product before it scales it, sets the pace: 0.94x /
0.81x the bf16 GEMM at 128 / 256 tokens (H200, 18432 x 7168); there ``fp8_matmul`` runs
``fp8_gemm_tiles_mgpu`` (128 x 128 output tiles, 1.08-1.76x this kernel at 128-512 tokens) where the
weight is whole 128-blocks, and this kernel serves the grouped launches. M = 8 fails the tensor
map's alignment on large shapes (tokens are padded to a multiple of TOKEN_MULTIPLE).

Arguments of ``fp8_gemm_mgpu`` (``fp8_gemm_reference`` is its float32 twin):

  x         [M, K] e4m3, M a multiple of TOKEN_MULTIPLE up to MAX_TOKENS, of LARGE_TILE above; or
            bf16 / f16 / f32 with x_scales None (quantized in the kernel)
  x_scales  [K / 128, M] float32 (``fp8_weights.quantize_activations``: the transpose of [M, K / 128]),
            or [K / 128, ``scale_columns``] (the columns past M unread)
  w8        [N, K] e4m3, N a multiple of 64, K of 128 (of 256 for two blocks a pipeline step)
  w_scales  [ceil(N / 128), K / 128] float32
  -> y [M, N] float32
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from snapmla_jax.pallas_kernels.mgpu_bytes import BYTE_TILE_TRANSFORMS, output_transforms
from snapmla_jax.pallas_kernels.mgpu_decode_inputs import GROUP_ROWS, quantized_rows
from snapmla_jax.pallas_kernels.write_kv import row_layout

BLOCK = 128  # channels (and weight rows) a scale covers
TILE_N = 64  # weight rows a CTA: one wgmma M
MAX_TOKENS = 64  # tokens of a call that one CTA takes whole (the wgmma N); more come in tiles of
LARGE_TILE = 128  # tokens (``token_tile``): a wgmma of N = 128 reads shared memory for twice the products
SMEM_BYTES = 227 * 1024  # shared memory a CTA may use on Hopper: the pipeline's depth gives way to it
# SMEM kept back for alignment where the kernel quantizes its tokens (``pipeline_depth``): four slots
# of 64 bf16 tokens came to 232480 bytes in all, 32 past the 232448 a CTA may take.
QUANTIZE_SMEM_SLACK = 4096
# Shared memory of one SM, which the CTAs resident on it share, and what each CTA takes beyond
# its own allocations (1 KB the hardware reserves a CTA, and the allocations' 1 KB alignment).
SM_SMEM_BYTES = 228 * 1024
CTA_SMEM_OVERHEAD = 3 * 1024
TOKEN_MULTIPLE = 16  # M = 8 failed the tensor map's alignment on an H100 (module docstring)
TMA_ROW_TILE = 8  # more rows of the bf16 tokens the kernel quantizes itself than this come in whole such tiles
SCALE_SLOT_FLOATS = 32  # float32 in 128 bytes: a pipeline slot of scales is whole such units (``scale_slot_tokens``)
COL = plgpu.Layout.WGMMA.reduce(0)  # a vector with one value per accumulator column (token)
# CUDA caps a grid's y and z extents at 65535 (x at 2**31 - 1). Mosaic GPU launches a grid of four
# axes (a, b, c, d) as z = a x b, y = c, x = d (``launch_grid``).
GRID_YZ_MAX = 65535
# ``choose_splits``: where two CTAs an SM would take splits whose float32 partials exceed
# PARTIALS_MAX_SHARE of the weight's bytes, a launch stops at FILL_SHARE of a CTA an SM. Measured:
# partials of 0.125 of the weight still paid for the second CTA an SM (10944 x 2048 at 16 tokens),
# those of 0.25 and more did not (the small matrices in ``choose_splits``).
FILL_SHARE = 0.7
PARTIALS_MAX_SHARE = 0.2
# Token dtypes the kernels quantize themselves (``quantize_tile``, ``quantize_activations_mgpu``).
FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """kb_per_step: 128-channel blocks a pipeline step brings (its weight tile is 64 x 128 x this
    bytes; None: 2 where K allows, else 1); depth: pipeline steps in flight; splits: None picks
    ``choose_splits``."""
    kb_per_step: int | None = None
    depth: int = 4
    splits: int | None = None

    def blocks_per_step(self, k: int) -> int:
        """128-channel blocks a step for a K of ``k`` channels."""
        if self.kb_per_step is not None:
            return self.kb_per_step
        return 2 if k % (2 * BLOCK) == 0 else 1


def choose_splits(n_tiles: int, steps: int, num_sms: int, split_share: float = 0.0) -> int:
    """Splits of ``steps`` (K's pipeline steps, or the groups of a summed product: a divisor) for a
    launch whose other grid axes give ``n_tiles`` CTAs: a CTA streams its tiles with ``depth`` in
    flight, and a memory-bound product needs every SM streaming. The fewest that give two CTAs an
    SM, unless the float32 partials they write and XLA reads back (``split_share`` of the weight's
    bytes a split, ``partials_share``) come to more than PARTIALS_MAX_SHARE of the weight's bytes;
    then the fewest that give FILL_SHARE of a CTA an SM.

    Small matrices are where the partials weigh (H100, jax 0.11.2, the product and its sum, wall
    clock of chains over weight copies, side by side; two an SM -> this rule): 2048 x 7168 at 64
    tokens 14 splits 14.8 us -> 4 splits 11.5 (bf16 19.2), 7168 x 2048 4 -> 1 15.6 -> 13.0 (bf16
    17.3), 1536 x 7168 14 -> 4 11.9 -> 10.7, 576 x 7168 28 -> 14 9.9 -> 9.3; 3-5% at 16 tokens
    (docs/models.md, "FP8 weights")."""
    divisors = [d for d in range(1, steps + 1) if steps % d == 0]

    def fewest(ctas: float) -> int:
        return next((d for d in divisors if n_tiles * d >= ctas), divisors[-1])

    two_an_sm = fewest(2 * num_sms)
    if two_an_sm * split_share <= PARTIALS_MAX_SHARE:
        return two_an_sm
    return fewest(FILL_SHARE * num_sms)  # 1 where two_an_sm is: no split, no partials


def partials_share(tokens: int, channels: int) -> float:
    """A split's float32 partials [N, tokens], written by the kernel and read back by XLA's sum (8
    bytes a value), over the e4m3 weight's [N, channels] bytes (``choose_splits``' split_share)."""
    return 8 * tokens / channels


def token_tile(m: int) -> int:
    """Tokens a CTA (the wgmma N): M itself up to MAX_TOKENS, else tiles of LARGE_TILE."""
    return m if m <= MAX_TOKENS else LARGE_TILE


def scale_slot_tokens(tokens: int, kb_per_step: int) -> int:
    """Tokens' scales a pipeline slot holds for each of its ``kb_per_step`` blocks: ``tokens``
    rounded up so that the slot is whole 128-byte units (SCALE_SLOT_FLOATS float32). A TMA writes
    shared memory at 128-byte aligned addresses, and the slots lie end to end: 16 tokens' scales
    of one block (64 bytes) failed with CUDA_ERROR_MISALIGNED_ADDRESS on an H200, and so did 48 of
    one block (192 bytes: V2-Lite's down projection, K = 1408, on the sorted dispatch's 48-token
    chunks)."""
    unit = SCALE_SLOT_FLOATS // math.gcd(SCALE_SLOT_FLOATS, kb_per_step)
    return -(-tokens // unit) * unit


def slot_bytes(tokens: int, kb_per_step: int, scale_tokens: int, x_itemsize: int = 1, weight_tiles: int = 1) -> int:
    """SMEM bytes of one pipeline slot: the weight tiles (two for a gated product), the token tile
    and their scales."""
    return (TILE_N * weight_tiles + x_itemsize * tokens) * BLOCK * kb_per_step + 4 * kb_per_step * scale_tokens


def fixed_bytes(tokens: int, kb_per_step: int, x_itemsize: int = 1) -> int:
    """SMEM bytes a CTA holds beside its slots: where the kernel quantizes its tokens
    (``x_itemsize`` > 1) their e4m3 tile and scales with QUANTIZE_SMEM_SLACK, else none. The
    output tile is staged in the slots' bytes once the pipeline is done (``cta_bytes``)."""
    if x_itemsize == 1:
        return 0
    return tokens * BLOCK * kb_per_step + 4 * kb_per_step * tokens + QUANTIZE_SMEM_SLACK


def cta_bytes(depth: int, slot: int, fixed: int, tokens: int) -> int:
    """SMEM bytes of a CTA of ``depth`` slots: ``fixed``, then the slots, whose bytes the [64,
    tokens] float32 output tile takes over after the last step (a scope of its own)."""
    return fixed + max(depth * slot, 4 * TILE_N * tokens)


def ctas_per_sm(smem_bytes: int) -> int:
    """CTAs of ``smem_bytes`` of shared memory each that one SM holds at once."""
    return SM_SMEM_BYTES // (smem_bytes + CTA_SMEM_OVERHEAD)


def pipeline_depth(config: GemmConfig, tokens: int, kb_per_step: int, scale_tokens: int,
                   x_itemsize: int = 1, ctas: int | None = None, num_sms: int | None = None,
                   weight_tiles: int = 1) -> int:
    """Pipeline steps a CTA keeps in flight: at most ``config.depth``, and no more than fit
    SMEM_BYTES (128-token tiles of 256 channels: 4; the output tile is staged in the slots'
    bytes, ``cta_bytes``). ``x_itemsize`` > 1: the tokens arrive unquantized (``scale_tokens``
    0; ``fixed_bytes``).

    Given the launch's ``ctas`` and ``num_sms``, the depth also sets how many CTAs an SM holds
    (``ctas_per_sm``), and that matters more than the depth: a CTA streams too few steps to hide
    its start and its output's store, which a second CTA on the SM hides. So the deepest pipeline
    of at least two steps at which every CTA of the launch is resident at once (no second wave),
    else the deepest at which an SM holds two CTAs, else the deepest that fits. Kernel durations
    (H200, jax 0.11.2, profiler; depth 4 -> the chosen one): 18432 x 7168 at 16 tokens
    42.2 -> 33.8 us (3 instead of 2 CTAs an SM: 288 CTAs in one wave), V2-Lite's 64 gate and up
    matrices at 64 tokens 131.1 -> 111.4 (two CTAs an SM instead of one), their down projection
    summed over 64 experts at 64 tokens 55.2 -> 52.4 (512 CTAs resident); on an H100 18432 x 7168
    at 16 tokens 53.3 -> 49.5. Staging the output tile in the slots' bytes rather than beside them
    lets 18432 x 7168 at 64 tokens run three CTAs an SM at depth 2 (all 288 resident; two with the
    tile beside them): 65.3 -> 56.7 us a product on an H100 (wall clock of a chain over weight
    copies, side by side), 7168 x 18432 61.8 -> 56.2 (336 CTAs). At the same residency the depth
    moved nothing measurable: depths 2, 3 and 4 forced side by side ran within 1.5% of each other
    at 18432 x 7168 (16-256 tokens), 7168 x 18432, the small matrices and V2-Lite's gated and
    summed experts at 64 and 256 tokens (H100, jax 0.11.2), so the rule keeps the deepest, which
    a launch of fewer CTAs than SMs needs."""
    slot = slot_bytes(tokens, kb_per_step, scale_tokens, x_itemsize, weight_tiles)
    fixed = fixed_bytes(tokens, kb_per_step, x_itemsize)
    fit = max(1, min(config.depth, (SMEM_BYTES - fixed) // slot))
    if ctas is None or num_sms is None:
        return fit
    # CTAs an SM holds at each depth of at least two steps, deepest first.
    per_sm = {d: ctas_per_sm(cta_bytes(d, slot, fixed, tokens)) for d in range(fit, 1, -1)}
    resident = [d for d, held in per_sm.items() if ctas <= num_sms * held]
    paired = [d for d, held in per_sm.items() if held >= 2]
    return (resident or paired or [fit])[0]


def quantize_tile(x_s, xq_s, xs_s, *, interpret: bool) -> None:
    """A step's token tile quantized per token and 128 channels (``fp8_weights.quantize_activations``'
    math, ``GROUP_ROWS`` tokens at a time): x_s [tokens, 128 kb] (bf16, f16 or f32) -> xq_s e4m3
    [kb, tokens, 128] (the products' operand) and xs_s f32 [kb, tokens] (their scales). The
    warpgroup's barrier first: every thread is done with the last step's tile and scales."""
    plgpu.commit_smem()
    kb_per_step, tokens, _ = xq_s.shape
    layout = row_layout(BLOCK, x_s.dtype)
    for kb in range(kb_per_step):
        for g in range(tokens // GROUP_ROWS):
            rows = pl.ds(g * GROUP_ROWS, GROUP_ROWS)
            x = plgpu.load(x_s.at[rows, pl.ds(kb * BLOCK, BLOCK)], layout=layout).astype(jnp.float32)
            (x8,), scale = quantized_rows([x], layout, interpret)
            xq_s[kb, rows, :] = x8
            xs_s[kb, rows] = scale
    plgpu.commit_smem()  # the stores before the products (the async proxy) and the other threads read them


def _kernel(experts_gmem, *refs, num_stacks: int, stack_groups: int, steps: int, groups: int, sum_groups: bool,
            shared_x: bool, kb_per_step: int, depth: int, tokens: int, scale_tokens: int, quantize: bool,
            gated: bool, token_major: bool, interpret: bool):
    """One CTA of grid (g, n, s, m): weight rows [64 n, 64 n + 64) times token tile m, over ``steps``
    pipeline steps of K for each of ``groups`` groups. Batched (``sum_groups`` False): group g
    (of stack g // ``stack_groups``: its weight matrix experts[g % stack_groups], or g % it),
    split s of K. Summed (one stack): groups [s groups, (s + 1) groups), the whole K of each.

    refs: the ``num_stacks`` weight stacks' refs and their scales' refs; then either x (e4m3) and
    its scales [X, K / 128, M'] (M' >= M: ``scale_slot_tokens``), or with ``quantize`` x
    (unquantized); the output; with ``quantize`` the SMEM of the step's quantized tokens and their
    scales (``quantize_tile``). The output tile is staged in SMEM the pipeline has released.

    ``gated`` (two stacks, a MoE's gate and up): the CTA multiplies the token tile by both
    stacks' weight rows [64 n, 64 n + 64) of group g and writes silu(gate) * up (``swiglu``).

    ``token_major`` (a 16-bit output of one split): the tile leaves as [tokens, 64] through
    transposed stores into SMEM, the output [1, G, M, N] as its consumers read it; else [64, tokens]
    into [splits, G, N, M]."""
    w_gmems, ws_gmems, refs = refs[:num_stacks], refs[num_stacks:2 * num_stacks], refs[2 * num_stacks:]
    if quantize:
        x_gmem, out_gmem, xq_s, xs_s = refs
    else:
        x_gmem, s_gmem, out_gmem = refs
    gg, n, split, mt = (lax.axis_index(name) for name in ("g", "n", "s", "m"))
    g = gg if num_stacks == 1 or gated else lax.rem(gg, stack_groups)
    tk = BLOCK * kb_per_step
    if sum_groups:
        g0, k0 = split * groups, 0
    else:
        g0, k0 = g, split * steps * tk
    matrix0 = g0 if experts_gmem is None else experts_gmem[g]
    x_cols = x_gmem.at[pl.ds(0, 1) if shared_x else pl.ds(g0, groups), pl.ds(mt * tokens, tokens),
                       pl.ds(k0, steps * tk)]
    x_spec = plgpu.BlockSpec((None, tokens, tk), (lambda e, k: (0, 0, k)) if shared_x else (lambda e, k: (e, 0, k)),
                             transforms=() if quantize else BYTE_TILE_TRANSFORMS)

    def scaled_products(w_tiles, x8_tile, x_scale_of, w_scales, totals):
        """Each weight tile's total + each block's product scaled by ``x_scale_of(kb)``, f32
        [tokens] (``COL``), times the tile's block scale ``w_scales[i][kb]``: w_tiles, w_scales
        and totals one a weight tile (two when ``gated``)."""
        def products(*acc_refs):
            # Every block's product is issued before the first is read: block kb's scaling runs
            # while the tensor cores work on the blocks after it.
            issued = [(i, kb) for i in range(len(w_tiles)) for kb in range(kb_per_step)]
            for (i, kb), acc_ref in zip(issued, acc_refs):
                plgpu.wgmma(acc_ref, w_tiles[i].at[:, pl.ds(kb * BLOCK, BLOCK)], x8_tile(kb).transpose((1, 0)))
            results, x_scales = list(totals), {}
            for index, ((i, kb), acc_ref) in enumerate(zip(issued, acc_refs)):
                fresh = plgpu.wgmma_accumulator_load(acc_ref, wait_n=len(issued) - 1 - index)
                if kb not in x_scales:  # loaded once a block for all the weight tiles
                    x_scales[kb] = x_scale_of(kb)
                scale = x_scales[kb] * w_scales[i][kb]
                results[i] = results[i] + fresh * lax.broadcast_in_dim(scale, (TILE_N, tokens), [1])
            return tuple(results)

        return pl.run_scoped(products, *[plgpu.ACC((TILE_N, tokens), jnp.float32)
                                         for _ in range(len(w_tiles) * kb_per_step)])

    zeros = plgpu.layout_cast(jnp.zeros((TILE_N, tokens), jnp.float32), plgpu.Layout.WGMMA)
    w_spec = plgpu.BlockSpec((None, TILE_N, tk), lambda e, k: (e, 0, k), transforms=BYTE_TILE_TRANSFORMS)

    def run(*run_stacks):
        """The CTA's product with each of ``run_stacks`` ((weight ref, scales ref): one, or gate and
        up when ``gated``), written as its one output tile."""
        def weight_rows(w_gmem):
            return w_gmem.at[pl.ds(matrix0, groups), pl.ds(n * TILE_N, TILE_N), pl.ds(k0, steps * tk)]

        def weight_scales(ws_gmem, indices):
            """The step's weight blocks' scales, one number each from global memory (cached), read
            by matrix id before the step's products: their latency passes under them."""
            e, k = indices
            matrix, nb = matrix0 + e, lax.div(n, BLOCK // TILE_N)  # e > 0 only for summed groups
            kb0 = k0 // BLOCK + k * kb_per_step
            return [ws_gmem[matrix, nb, kb0 + kb] for kb in range(kb_per_step)]

        num_w = len(run_stacks)
        init = (zeros,) * num_w

        def stacks_scales(indices):
            return [weight_scales(ws_gmem, indices) for _, ws_gmem in run_stacks]

        if quantize:
            def body(indices, *refs_and_totals):  # the weight tiles, the token tile, the carry
                *w_tiles, x_s, totals = refs_and_totals
                w_scales = stacks_scales(indices)
                quantize_tile(x_s, xq_s, xs_s, interpret=interpret)
                return scaled_products(w_tiles, lambda kb: xq_s.at[kb], lambda kb: plgpu.load(xs_s.at[kb], layout=COL),
                                       w_scales, totals)

            pipeline = plgpu.emit_pipeline(body, grid=(groups, steps), max_concurrent_steps=min(depth, groups * steps),
                                           init_carry=init, in_specs=[w_spec] * num_w + [x_spec])
            results = pipeline(*(weight_rows(w) for w, _ in run_stacks), x_cols)
        else:
            # The tokens' scales [K / 128, M'] of this CTA's groups, streamed beside their tiles.
            s_cols = s_gmem.at[pl.ds(0, 1) if shared_x else pl.ds(g0, groups), pl.ds(k0 // BLOCK, steps * kb_per_step),
                               pl.ds(mt * scale_tokens, scale_tokens)]
            s_spec = plgpu.BlockSpec((None, kb_per_step, scale_tokens),
                                     (lambda e, k: (0, k, 0)) if shared_x else (lambda e, k: (e, k, 0)))

            def body(indices, *refs_and_totals):  # the weight tiles, the token and scale tiles, the carry
                *w_tiles, x_s, s_s, totals = refs_and_totals
                w_scales = stacks_scales(indices)

                def x_scale_of(kb):
                    scale_row = s_s.at[kb] if scale_tokens == tokens else s_s.at[kb, pl.ds(0, tokens)]
                    return plgpu.load(scale_row, layout=COL)

                return scaled_products(w_tiles, lambda kb: x_s.at[:, pl.ds(kb * BLOCK, BLOCK)], x_scale_of,
                                       w_scales, totals)

            pipeline = plgpu.emit_pipeline(body, grid=(groups, steps), max_concurrent_steps=min(depth, groups * steps),
                                           init_carry=init, in_specs=[w_spec] * num_w + [x_spec, s_spec])
            results = pipeline(*(weight_rows(w) for w, _ in run_stacks), x_cols, s_cols)
        tile = (swiglu(*results) if gated else results[0]).astype(out_gmem.dtype)

        group_out = out_gmem.at[split, 0 if sum_groups else gg]
        rows, tokens_at = pl.ds(n * TILE_N, TILE_N), pl.ds(mt * tokens, tokens)

        def store(out_s):  # in the bytes the pipeline's slots held (``cta_bytes``)
            if token_major:
                out_s.transpose((1, 0))[...] = tile
            else:
                out_s[...] = tile
            plgpu.commit_smem()
            target = group_out.at[tokens_at, rows] if token_major else group_out.at[rows, tokens_at]
            plgpu.copy_smem_to_gmem(out_s, target)
            plgpu.wait_smem_to_gmem(0)

        if token_major:
            staging = plgpu.SMEM((tokens, TILE_N), out_gmem.dtype,
                                 transforms=() if interpret else output_transforms(out_gmem.dtype))
        else:
            staging = plgpu.SMEM((TILE_N, tokens), out_gmem.dtype)
        pl.run_scoped(store, staging)

    stacks = tuple(zip(w_gmems, ws_gmems))
    launch = (lambda: run(*stacks)) if gated else (lambda: run_on_stack(run, stacks, gg, stack_groups))
    if experts_gmem is None:
        launch()
    else:
        pl.when(matrix0 >= 0)(launch)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up in float32, as ``jax.nn.silu`` computes silu (gate * sigmoid(gate))."""
    return gate / (1.0 + jnp.exp(-gate)) * up


def run_on_stack(run, w_gmems: tuple, gg, stack_groups: int) -> None:
    """``run(w_gmems[i])`` for the stack i of grid group ``gg`` (stacks' groups one stack after
    another, ``stack_groups`` each): the only one, or the one ``gg`` falls in. An entry of
    ``w_gmems`` is whatever ``run`` takes of a stack (its weight ref, or its refs)."""
    if len(w_gmems) == 1:
        run(w_gmems[0])
        return
    stack = lax.div(gg, stack_groups)
    for index, w_gmem in enumerate(w_gmems):
        pl.when(stack == index)(functools.partial(run, w_gmem))


def launch_grid(groups: int, n_tiles: int, splits: int, m_tiles: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(grid, grid names) of a grouped launch of ``groups`` groups (all stacks'), ``n_tiles`` weight
    tiles, ``splits`` and ``m_tiles`` token tiles; the kernels index it by name.

    (g, n, s, m), the order measured, puts groups x weight tiles in CUDA's z, which takes at most
    GRID_YZ_MAX: V3's down projection on the sorted dispatch's 8192-token blocks (768 groups x 112
    tiles) was refused at launch (CUDA_ERROR_INVALID_VALUE, H200). Past it the weight tiles go to x:
    (g, s, m, n), a group's tiles still launched one after another."""
    if groups * n_tiles <= GRID_YZ_MAX:
        return (groups, n_tiles, splits, m_tiles), ("g", "n", "s", "m")
    if groups * splits > GRID_YZ_MAX or m_tiles > GRID_YZ_MAX:
        raise ValueError(f"groups: {groups} groups x {splits} splits, {m_tiles} token tiles: past a CUDA grid's "
                         f"{GRID_YZ_MAX}")
    return (groups, splits, m_tiles, n_tiles), ("g", "s", "m", "n")


def kernel_takes(m: int, n: int, k: int, config: GemmConfig = GemmConfig()) -> bool:
    """Whether the FP8 GEMM runs an [M, K] x [N, K]^T product (a group's), M padded by
    ``pad_tokens``: N a multiple of 64 and K of the step's channels."""
    return m > 0 and n % TILE_N == 0 and k % (BLOCK * config.blocks_per_step(k)) == 0


def scale_columns(m: int, k: int, config: GemmConfig = GemmConfig()) -> int:
    """Columns of the tokens' scales [X, K / 128, columns] the kernel streams for M = ``m`` (as
    ``pad_tokens`` leaves it) and K = ``k``: M, or for a single token tile whole 128-byte slots
    (``scale_slot_tokens``). Scales of M columns are padded to it by an XLA op; a quantizer that
    writes this many (``quantize_activations_mgpu``'s ``scale_rows``) saves that op."""
    tokens = token_tile(m)
    return max(m, scale_slot_tokens(tokens, config.blocks_per_step(k)))


def tma_rows(m: int) -> int:
    """Rows an unquantized token array needs for a tiled TMA of it: ``m`` up to TMA_ROW_TILE, else
    whole such tiles. Compiled, Mosaic GPU refuses a TMA of an array whose rows are neither fewer
    than nor a multiple of 8 ("dimension 1 must have size smaller or a multiple of its tiling 8":
    11 and 100 tokens, H100); the callers pad such an array with zero rows (a small XLA op)."""
    return m if m <= TMA_ROW_TILE else -(-m // TMA_ROW_TILE) * TMA_ROW_TILE


def pad_tokens(m: int) -> int:
    """M padded to what the kernel takes: a multiple of TOKEN_MULTIPLE up to MAX_TOKENS, of
    LARGE_TILE (whole token tiles) above."""
    multiple = TOKEN_MULTIPLE if m <= MAX_TOKENS else LARGE_TILE
    return -(-m // multiple) * multiple


def check_stacks(w8s: tuple, w_scales_s: tuple, num_x: int, groups: int, x_name: str = "x8") -> None:
    """ValueError unless the weight stacks are of one shape with a scale stack each and the tokens
    come as one group shared by all or one a group."""
    if any(w.shape != w8s[0].shape for w in w8s) or len(w_scales_s) != len(w8s):
        raise ValueError(f"w8: stacks of one shape, with a scale stack each; got {[w.shape for w in w8s]} and "
                         f"{len(w_scales_s)} scale stacks")
    if num_x not in (1, groups):
        raise ValueError(f"{x_name}: expected 1 or {groups} groups of tokens, got {num_x}")


@functools.partial(jax.jit, static_argnames=("sum_groups", "transposed", "gated", "out_dtype", "config", "num_sms",
                                             "interpret"))
def fp8_grouped_gemm_mgpu(x: jax.Array, x_scales: jax.Array | None, w8, w_scales, matrices: jax.Array | None = None, *,
                          sum_groups: bool = False, transposed: bool = False, gated: bool = False,
                          out_dtype=jnp.float32, config: GemmConfig = GemmConfig(), num_sms: int = 132,
                          interpret: bool = False):
    """G block-scaled products of one launch (module docstring), group g multiplying its tokens
    x[g] (or the one x[0] all groups share) by weight matrix ``matrices[g]`` of w8 (None: g).

      x         [X, M, K], X = 1 (shared) or G: e4m3 with ``x_scales`` (M as ``pad_tokens`` leaves
                it), or bf16 / f16 / f32 with ``x_scales`` None (any M), quantized per token and
                128 channels in the kernel (``quantize_tile``: no launches before this one)
      x_scales  [X, K / 128, M or ``scale_columns``] float32 (``fp8_weights.quantize_activations``
                per group), or None
      w8        [E, N, K] e4m3;  w_scales [E, ceil(N / 128), K / 128] float32; or tuples of such
                stacks of one shape (a MoE's gate and up: both products of the same tokens in one
                launch)
      matrices  None (G = E) or int32 [G]: each group's matrix, in [0, E) (not checked in a trace),
                or negative: the group is skipped, its output rows left unwritten (as in
                ``grouped_gemm_mgpu``)
      -> y [G, M, N] float32 (M padded as ``pad_tokens`` pads it where the kernel quantizes x; a
         tuple of them, one a stack, for tuples), or with ``sum_groups``
         [M, N] = the sum over the groups (the K of one product that runs over every group's
         channels; one stack, ``matrices`` None). ``transposed``: [G, N, M] (and [N, M]), the
         layout the kernel writes float32 and split results in, where XLA would otherwise
         transpose the result on its own (a copy of it: 21 us of a V2-Lite MoE layer's 246 at
         64 tokens, H200) instead of fusing the transpose into what consumes it. A 16-bit
         result of one split the kernel writes either way round (transposed stores into its
         staging tile for [M, N]): at 128 tokens on the sorted dispatch, the gated product's
         and the down projection's XLA transposes took 5.5 and 13.1 us of a V2-Lite layer's
         317 (H100, profiler; the down rows were float32 then).
      gated     with two stacks (gate, up): one result, silu(x @ gate^T) * (x @ up^T) (``swiglu``),
                each CTA multiplying its token tile by both stacks' rows (the tile read once for
                both, and neither product written out); K is not split then
      out_dtype what the results are written as (float32, bfloat16 or float16): the kernel writes
                it where K is not split, else its float32 partials are summed, then cast

    ValueError for shapes the kernel does not take (``kernel_takes``, ``pad_tokens``).
    """
    stacked = isinstance(w8, tuple)
    w8s, w_scales_s = (tuple(w8), tuple(w_scales)) if stacked else ((w8,), (w_scales,))
    num_x, m_given, k = x.shape
    num_matrices, n, _ = w8s[0].shape
    groups_total = num_matrices if matrices is None else matrices.shape[0]
    kb_per_step = config.blocks_per_step(k)
    quantize = x_scales is None
    # Tokens the kernel quantizes may be any number: its tiles' rows past M arrive as zeros (the
    # TMA's out-of-bounds fill), and the output keeps whole tiles.
    m = pad_tokens(m_given) if quantize else m_given
    if not kernel_takes(m, n, k, config) or m != pad_tokens(m) or w8s[0].shape[2] != k:
        raise ValueError(f"x, w8: the FP8 GEMM takes M a multiple of {TOKEN_MULTIPLE} up to {MAX_TOKENS} (of "
                         f"{LARGE_TILE} above; any M it quantizes itself), N of {TILE_N} and K of "
                         f"{BLOCK * kb_per_step}, got M={m_given}, N={n}, K={k} (weights K={w8s[0].shape[2]})")
    if quantize and x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x: without x_scales the kernel quantizes bf16, f16 or f32 tokens, got {x.dtype}")
    if not quantize and x.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"x: with x_scales the tokens come quantized (float8_e4m3fn), got {x.dtype}")
    check_stacks(w8s, w_scales_s, num_x, groups_total, x_name="x")
    if sum_groups and (matrices is not None or stacked):
        raise ValueError("matrices: a summed product runs every matrix of one stack in order (matrices=None)")
    if gated and len(w8s) != 2:
        raise ValueError(f"w8: a gated product takes two stacks (gate, up), got {len(w8s)}")
    if jnp.dtype(out_dtype) not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype: expected float32, bfloat16 or float16, got {jnp.dtype(out_dtype)}")
    steps_total = k // (BLOCK * kb_per_step)
    tokens = token_tile(m)
    n_tiles, m_tiles = n // TILE_N, m // tokens
    num_stacks = len(w8s)
    if sum_groups:
        splits = config.splits or choose_splits(n_tiles * m_tiles, groups_total, num_sms,
                                                split_share=partials_share(m, groups_total * k))
        if groups_total % splits:
            raise ValueError(f"config: splits={splits} must divide the {groups_total} groups")
        grid, groups, steps = (1, n_tiles, splits, m_tiles), groups_total // splits, steps_total
    elif gated:  # silu needs the whole sum: one split
        if (config.splits or 1) != 1:
            raise ValueError(f"config: a gated product runs K whole (splits=1), got splits={config.splits}")
        splits, grid, groups, steps = 1, (groups_total, n_tiles, 1, m_tiles), 1, steps_total
    else:
        splits = config.splits or choose_splits(num_stacks * groups_total * n_tiles * m_tiles, steps_total, num_sms,
                                                split_share=partials_share(m, k))
        if steps_total % splits:
            raise ValueError(f"config: splits={splits} must divide the {steps_total} pipeline steps")
        grid, groups, steps = (num_stacks * groups_total, n_tiles, splits, m_tiles), 1, steps_total // splits
    # The kernel reads each group's weight scales by its matrix id.
    weight_scales = tuple(ws.astype(jnp.float32) for ws in w_scales_s)
    if quantize:
        x = jnp.pad(x, ((0, 0), (0, tma_rows(m_given) - m_given), (0, 0)))
        scale_tokens = 0
        operands = (*w8s, *weight_scales, x)
        scratch = [plgpu.SMEM((kb_per_step, tokens, BLOCK), jnp.float8_e4m3fn),
                   plgpu.SMEM((kb_per_step, tokens), jnp.float32)]
    else:
        scale_tokens = scale_slot_tokens(tokens, kb_per_step)
        width = max(m, scale_tokens)  # scale_columns, for this launch's blocks a step
        if x_scales.shape not in ((num_x, k // BLOCK, m), (num_x, k // BLOCK, width)):
            raise ValueError(f"x_scales: expected [{num_x}, {k // BLOCK}, {m}] (or {width} columns, the kernel's "
                             f"slots), got {list(x_scales.shape)}")
        if x_scales.shape[-1] < width:  # then M = tokens (at most 64): one token tile
            x_scales = jnp.pad(x_scales, ((0, 0), (0, 0), (0, width - m)))
        operands, scratch = (*w8s, *weight_scales, x, x_scales.astype(jnp.float32)), []
    depth = pipeline_depth(config, tokens, kb_per_step, scale_tokens, x_itemsize=x.dtype.itemsize if quantize else 1,
                           ctas=math.prod(grid), num_sms=num_sms, weight_tiles=2 if gated else 1)
    written = jnp.dtype(out_dtype) if splits == 1 else jnp.dtype(jnp.float32)
    # A 16-bit result of one split leaves the kernel as [M, N] (transposed stores into SMEM; 32-bit
    # ones do not lower), so that no XLA transpose copies it.
    token_major = written.itemsize == 2 and not transposed
    body = functools.partial(_kernel, num_stacks=num_stacks, stack_groups=groups_total, steps=steps, groups=groups,
                             sum_groups=sum_groups, shared_x=num_x == 1, kb_per_step=kb_per_step, depth=depth,
                             tokens=tokens, scale_tokens=scale_tokens, quantize=quantize, gated=gated,
                             token_major=token_major, interpret=interpret)
    out_groups = 1 if sum_groups else groups_total if gated else num_stacks * groups_total
    grid, grid_names = launch_grid(*grid)
    kernel = plgpu.kernel(
        body if matrices is not None else functools.partial(body, None),
        out_type=jax.ShapeDtypeStruct((splits, out_groups, *((m, n) if token_major else (n, m))), written),
        scratch_types=scratch,
        grid=grid, grid_names=grid_names,
        kernel_name="snapmla_fp8_gemm",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    ys = summed_partials(kernel, operands, matrices, stacked=stacked and not gated, num_stacks=num_stacks,
                         groups=groups_total, keep_layout=transposed or token_major, out_dtype=out_dtype)
    return ys[0] if sum_groups else ys


def summed_partials(kernel, operands: tuple, matrices: jax.Array | None, *, stacked: bool, num_stacks: int,
                    groups: int, keep_layout: bool = False, out_dtype=jnp.float32):
    """Run a grouped launch (``matrices`` its first operand when given) and add its splits' partial
    sums [splits, num_stacks * groups, N, M] into [num_stacks * groups, M, N] ``out_dtype``
    (``keep_layout``: the last two axes as the kernel wrote them), or for ``stacked`` a tuple of
    ``num_stacks`` of them [groups, ...]."""
    partials = kernel(*operands) if matrices is None else kernel(matrices.astype(jnp.int32), *operands)
    summed = (partials[0] if partials.shape[0] == 1 else jnp.sum(partials, axis=0)).astype(out_dtype)
    if not keep_layout:
        summed = jnp.swapaxes(summed, -1, -2)
    if not stacked:
        return summed
    return tuple(summed.reshape(num_stacks, groups, *summed.shape[1:]))


@functools.partial(jax.jit, static_argnames=("config", "num_sms", "interpret"))
def fp8_gemm_mgpu(x: jax.Array, x_scales: jax.Array | None, w8: jax.Array, w_scales: jax.Array, *,
                  config: GemmConfig = GemmConfig(), num_sms: int = 132, interpret: bool = False) -> jax.Array:
    """One product: x [M, K] e4m3 with x_scales [K / 128, M] (or bf16 / f16 / f32 with x_scales
    None: quantized in the kernel), w8 [N, K] e4m3, w_scales [ceil(N / 128), K / 128] -> y [M, N]
    float32 (``fp8_grouped_gemm_mgpu`` with one group)."""
    y = fp8_grouped_gemm_mgpu(x[None], None if x_scales is None else x_scales[None], w8[None], w_scales[None],
                              config=config, num_sms=num_sms, interpret=interpret)
    return y[0]


def fp8_gemm_reference(x8: jax.Array, x_scales: jax.Array, w8: jax.Array, w_scales: jax.Array) -> jax.Array:
    """The same sum in float32 with XLA: y [M, N]."""
    m, k = x8.shape
    n = w8.shape[0]
    kb = k // BLOCK
    xb = x8.astype(jnp.float32).reshape(m, kb, BLOCK)
    wb = w8.astype(jnp.float32).reshape(n, kb, BLOCK)
    partial = jnp.einsum("mbk,nbk->bmn", xb, wb, precision=lax.Precision.HIGHEST)
    row_scales = jnp.repeat(w_scales, BLOCK, axis=0)[:n]  # [N, KB]
    return jnp.einsum("bmn,bm,nb->mn", partial, x_scales, row_scales, precision=lax.Precision.HIGHEST)

"""The Mosaic GPU decode kernels' launcher-side inputs in one launch, and their jnp reference.

The Mosaic FP8 kernels (mla_decode_mgpu.py, mla_decode_mgpu_small.py) take

  q8      [B, rows, 512] e4m3 and q_scale [B, rows] f32: the query content rows
          quantized per row (``quantize_per_token``), and
  scales  [B, steps * 128] f32: each batch row's token scales in step order
          (``step_token_order``: a TMA cannot read every other float, so they are
          gathered per batch row before the kernel; 8 B a token against the cache's 644 B),
          or with ``scale_planes`` [B, steps, 3, 128]: each step's scales, then their
          base-2 logarithms, then their reciprocals (both of the scales floored at
          ``SCALE_FLOOR``; the 64-row kernel's softmax runs on
          score + log2 k_scale and sums P' / k_scale: ``mla_decode_mgpu.softmax_frame``;
          computed here once a token, 8 B more, instead of 16 ``lg2`` and 16 divisions a
          thread a step on the kernel's path).

Why a kernel. In jnp XLA runs these as four launches (the row maxima, the scales,
the quantized rows, the gather), ~1 us each on an H100 whatever their size: at
short contexts a fifth of a decode call (B=1 x 1k x 16 heads: 17.6 us a call, ~4.6
us of it these; docs/benchmarks/mgpu.md). Here one grid does both jobs: its first
programs quantize 16 query rows each, the others gather up to 1024 scales each.

The balanced split plan too (``decode_inputs_and_plan``): its programs
(``split_plan_kernel.plan_program``) go first in the same grid, one launch fewer a call
than the plan's own (``split_plan_kernel.balanced_plan_kernel``, 1.7-2.6 us on an H100;
the BF16 twin, which has no inputs launch, keeps that one). Not yet timed on a GPU:
the launch it saves against the programs it adds (thirtieth session, branch
``fused-inputs-plan``).

Backend: Pallas' Triton lowering (masked gathers; interpret mode on the CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_tr

from pallas_kernels.fp8 import FP8_DTYPE, quantize_per_token
from pallas_kernels.mla_decode import resolve_num_pages
from pallas_kernels.split_plan import SplitPlan
from pallas_kernels.split_plan_kernel import PlanLaunch, as_split_plan, plan_launch, plan_out_shapes, plan_program

PAGE = 64  # the Mosaic kernels' page size
STEP = 128  # their tokens a step: two pages, even tokens first, then the odd ones
Q_ROWS = 16  # query rows a quantizing program takes ([16, 512]: 32 values a thread at 4 warps)
SCALES = 1024  # token scales a gathering program takes
# Floor on the token scales behind the logarithm and reciprocal planes (``with_scale_planes``).
# The 64-row kernel's softmax sums P' / k_scale with P' = 2^(score + log2 k_scale - frame + log2
# 448). A slot never written holds scale 0: log2 -inf, 1 / 0 = inf, and 0 * inf = NaN in every
# output row that reads it (the kernels before kept such a token's softmax weight, with a zero
# value). Floored, its P' is 2^(score - 60 - frame + log2 448), a normal float32 (so its weight
# counts) while its softmax weight is within ~2^-70 of the step's heaviest token's (whose log2
# k_scale is rarely above 0), and rounds to 0 in e4m3 beside a zero latent, as before. A scale
# below the floor but not 0 (``quantize_per_token``'s own floor gives 2^-108 to an all-zero
# latent) then carries its value 2^-60 / scale too large: at most 2^-60 x 448 in absolute terms.
# The scales' own plane (the scores' dequantization) stays exact.
SCALE_FLOOR = 2.0 ** -60
NUM_WARPS = 4


def step_token_order(num_tokens: int) -> jax.Array:
    """Token offset held by each SMEM row of a step, for ``num_tokens`` = k * STEP positions.

    Within a step, rows 0..63 hold the even tokens and rows 64..127 the odd ones
    (row c < 64: token 2c; row c >= 64: token 2(c - 64) + 1).
    """
    return _token_at(jnp.arange(num_tokens))


def _token_at(position):
    """The token at step-order ``position`` (any int array): see ``step_token_order``."""
    c = position % STEP
    return position - c + jnp.where(c < STEP // 2, 2 * c, 2 * (c - STEP // 2) + 1)


def num_step_tokens(max_pages: int) -> int:
    """Step-ordered positions of a block table with ``max_pages`` pages: whole steps."""
    return pl.cdiv(max_pages * PAGE, STEP) * STEP


def step_scales(scale: jax.Array, block_table: jax.Array, layer_offset: jax.Array,
                num_pages: int | None = None) -> jax.Array:
    """Token scales [B, steps * 128] f32 of each batch row's pages, in step order (jnp).

    scale [N] f32 (flat cache rows), block_table [B, max_pages] int32,
    layer_offset [1] int32, num_pages: pages in one layer (None: N / 64). Positions
    past the table read its last page (the kernels mask them); page ids are clipped
    into [0, num_pages) and cache rows into [0, N).
    """
    max_pages = block_table.shape[1]
    num_pages = resolve_num_pages(num_pages, scale.shape[0], PAGE)
    positions = step_token_order(num_step_tokens(max_pages))
    pages = jnp.clip(jnp.take(block_table, jnp.minimum(positions // PAGE, max_pages - 1), axis=1), 0, num_pages - 1)
    return jnp.take(scale, layer_offset[0] + pages * PAGE + positions % PAGE, mode="clip")


def with_scale_planes(scales: jax.Array) -> jax.Array:
    """Step-ordered scales [B, steps * 128] -> [B, steps, 3, 128]: each step's scales, then
    the base-2 logarithms and the reciprocals of the scales floored at ``SCALE_FLOOR``."""
    by_step = scales.reshape(scales.shape[0], -1, 1, STEP)
    floored = jnp.maximum(by_step, SCALE_FLOOR)
    return jnp.concatenate([by_step, jnp.log2(floored), 1.0 / floored], axis=2)


def decode_inputs_reference(q_rows: jax.Array, scale: jax.Array, block_table: jax.Array,
                            layer_offset: jax.Array, num_pages: int | None = None, *,
                            scale_planes: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q_rows [B, rows, 512] (bf16/f32), scale [N] f32, block_table [B, max_pages] int32,
    layer_offset [1] int32, num_pages (``step_scales``) -> (q8 [B, rows, 512] e4m3,
    q_scale [B, rows] f32, scales [B, steps * 128] f32, or [B, steps, 3, 128] with their
    logarithms and reciprocals if ``scale_planes``: ``with_scale_planes``), in jnp."""
    q8, q_scale = quantize_per_token(q_rows.astype(jnp.float32))
    scales = step_scales(scale, block_table, layer_offset, num_pages)
    return q8, q_scale, with_scale_planes(scales) if scale_planes else scales


def inputs_program(q_ref, scale_ref, bt_ref, off_ref, q8_ref, qsc_ref, steps_ref, b, j, *, q_programs: int,
                   num_tokens: int, scales_block: int, num_pages: int, scale_planes: bool):
    """Program (b, j): j < ``q_programs`` quantizes query rows [16 j, 16 j + 16) of batch row
    b; j >= it gathers b's step-ordered scales [n i, n i + n), n = ``scales_block``,
    i = j - q_programs (with ``scale_planes`` also their logarithms and reciprocals, each step's
    after its scales).

    q_ref [B * rows, 512], scale_ref [N], bt_ref [B, max_pages], off_ref [1] (whole);
    q8_ref [B * rows, 512] e4m3, qsc_ref [B * rows], steps_ref [B * num_tokens] (or
    [B * num_tokens * 3] with ``scale_planes``) (whole).
    """
    num_rows = q_ref.shape[0] // bt_ref.shape[0]
    rank = q_ref.shape[1]

    @pl.when(j < q_programs)
    def _():
        rows = b * num_rows + j * Q_ROWS + jnp.arange(Q_ROWS, dtype=jnp.int32)
        columns = jnp.arange(rank, dtype=jnp.int32)
        q8, q_scale = quantize_per_token(plgpu_tr.load(q_ref.at[rows[:, None], columns[None, :]]).astype(jnp.float32))
        plgpu_tr.store(q8_ref.at[rows[:, None], columns[None, :]], q8)
        plgpu_tr.store(qsc_ref.at[rows], q_scale)

    @pl.when(j >= q_programs)
    def _():
        position = (j - q_programs) * scales_block + jnp.arange(scales_block, dtype=jnp.int32)
        token = _token_at(position)
        max_pages = bt_ref.shape[1]
        page = jnp.clip(plgpu_tr.load(bt_ref.at[b, jnp.minimum(token // PAGE, max_pages - 1)]), 0, num_pages - 1)
        row = jnp.clip(off_ref[0] + page * PAGE + token % PAGE, 0, scale_ref.shape[0] - 1)
        values = plgpu_tr.load(scale_ref.at[row])
        if not scale_planes:
            plgpu_tr.store(steps_ref.at[b * num_tokens + position], values)
            return
        # [B, steps, 3, STEP] flat: a step's scales, then their logarithms, then their reciprocals.
        flat = 3 * (b * num_tokens + position) - 2 * (position % STEP)
        plgpu_tr.store(steps_ref.at[flat], values)
        floored = jnp.maximum(values, SCALE_FLOOR)
        plgpu_tr.store(steps_ref.at[flat + STEP], jnp.log2(floored))
        plgpu_tr.store(steps_ref.at[flat + 2 * STEP], 1.0 / floored)


def scales_block(num_tokens: int) -> int:
    """Scales a gathering program takes: the largest power of two up to SCALES dividing
    ``num_tokens`` (a multiple of STEP), so that no program runs past the end."""
    block = SCALES
    while num_tokens % block:
        block //= 2
    return block


def _launch(q_rows, scale, block_table, layer_offset, seq_lens, *, num_pages, scale_planes: bool,
            plan: PlanLaunch | None, interpret: bool) -> tuple:
    """``decode_inputs``' Pallas call, with ``plan``'s programs (``split_plan_kernel``) first in
    its grid when one is asked for: (q8, q_scale, scales[, items, item_start, item_count])."""
    batch, num_rows, rank = q_rows.shape
    num_pages = resolve_num_pages(num_pages, scale.shape[0], PAGE)
    if num_rows % Q_ROWS:
        raise ValueError(f"q_rows: expected rows padded to a multiple of {Q_ROWS}, got {num_rows}")
    num_tokens = num_step_tokens(block_table.shape[1])
    q_programs = num_rows // Q_ROWS
    block = scales_block(num_tokens)
    per_row = q_programs + num_tokens // block
    plan_programs = 0 if plan is None else plan.programs
    inputs = functools.partial(inputs_program, q_programs=q_programs, num_tokens=num_tokens, scales_block=block,
                               num_pages=num_pages, scale_planes=scale_planes)

    def kernel(q_ref, scale_ref, bt_ref, off_ref, *refs):
        if plan is None:
            inputs(q_ref, scale_ref, bt_ref, off_ref, *refs, pl.program_id(0), pl.program_id(1))
            return
        seq_lens_ref, (q8_ref, qsc_ref, steps_ref, *plan_refs) = refs[0], refs[1:]
        program = pl.program_id(0)

        @pl.when(program < plan_programs)
        def _():
            plan_program(seq_lens_ref, *plan_refs, program, plan, step_tokens=STEP,
                         capacity=block_table.shape[1] * PAGE)

        @pl.when(program >= plan_programs)
        def _():
            index = program - plan_programs
            inputs(q_ref, scale_ref, bt_ref, off_ref, q8_ref, qsc_ref, steps_ref, lax.div(index, per_row),
                   lax.rem(index, per_row))

    whole = pl.BlockSpec(memory_space=pl.ANY)
    out_shape = [jax.ShapeDtypeStruct((batch * num_rows, rank), FP8_DTYPE),
                 jax.ShapeDtypeStruct((batch * num_rows,), jnp.float32),
                 jax.ShapeDtypeStruct((batch * num_tokens * (3 if scale_planes else 1),), jnp.float32)]
    args = [q_rows.reshape(batch * num_rows, rank), scale, block_table, layer_offset]
    if plan is not None:
        out_shape += plan_out_shapes(plan)
        args.append(seq_lens)
    # Without a plan the grid is (batch row, program of the row); with one, flat: the plan's
    # programs, then the rows' (a 2-d grid would repeat the plan's programs in every row).
    grid = (batch, per_row) if plan is None else (plan_programs + batch * per_row,)
    outputs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole] * len(args),
        out_specs=[whole] * len(out_shape),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu_tr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        name="snapmla_mgpu_decode_inputs",
    )(*args)
    q8, q_scale, scales = outputs[:3]
    scales_shape = (batch, num_tokens // STEP, 3, STEP) if scale_planes else (batch, num_tokens)
    return (q8.reshape(batch, num_rows, rank), q_scale.reshape(batch, num_rows), scales.reshape(scales_shape),
            *outputs[3:])


@functools.partial(jax.jit, static_argnames=("num_pages", "scale_planes", "interpret"))
def decode_inputs(q_rows: jax.Array, scale: jax.Array, block_table: jax.Array, layer_offset: jax.Array, *,
                  num_pages: int | None = None, scale_planes: bool = False,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``decode_inputs_reference`` in one Pallas launch: q_rows [B, rows, 512] (rows a multiple
    of 16), scale [N] f32, block_table [B, max_pages] int32, layer_offset [1] int32,
    num_pages: pages in one layer (None: N / 64) -> (q8 [B, rows, 512] e4m3, q_scale [B, rows]
    f32, scales [B, steps * 128] f32, or [B, steps, 3, 128] with their base-2 logarithms and
    reciprocals if ``scale_planes``)."""
    return _launch(q_rows, scale, block_table, layer_offset, None, num_pages=num_pages, scale_planes=scale_planes,
                   plan=None, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("num_items", "num_pages", "scale_planes", "interpret"))
def decode_inputs_and_plan(q_rows: jax.Array, scale: jax.Array, block_table: jax.Array, layer_offset: jax.Array,
                           seq_lens: jax.Array, *, num_items: int, num_pages: int | None = None,
                           scale_planes: bool = False,
                           interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array, SplitPlan]:
    """``decode_inputs`` and the balanced split plan of seq_lens [B] int32 in W = ``num_items``
    items of 128-token steps (``split_plan.balanced_plan`` with the table's capacity, the same
    values as ``split_plan_kernel.balanced_plan_kernel``) in the same launch: one launch a decode
    call fewer. Returns (q8, q_scale, scales, SplitPlan)."""
    q8, q_scale, scales, *plan = _launch(q_rows, scale, block_table, layer_offset, seq_lens, num_pages=num_pages,
                                         scale_planes=scale_planes, plan=plan_launch(seq_lens, num_items),
                                         interpret=interpret)
    return q8, q_scale, scales, as_split_plan(*plan)

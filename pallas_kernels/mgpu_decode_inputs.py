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
short contexts a fifth of a decode call (B=1 x 1k x 16 heads: ~4.6 of 17.6 us;
scripts/profile_decode_launches.py). Here one grid does both jobs: its first
programs quantize 16 query rows each, the others gather up to 1024 scales each.

The balanced split plan too (``decode_inputs_and_plan``): its programs
(``split_plan_kernel.plan_program``) go first in the same grid, one launch fewer a call
than the plan's own (``split_plan_kernel.balanced_plan_kernel``; the BF16 twin, which has
no inputs launch, keeps that one).

Backend: Pallas' Triton lowering (masked gathers; interpret mode on the CPU).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_tr

from snapmla_jax.pallas_kernels.fp8 import FP8_DTYPE, quantize_per_token
from snapmla_jax.pallas_kernels.mla_decode import resolve_num_pages
from snapmla_jax.pallas_kernels.split_plan import SplitPlan
from snapmla_jax.pallas_kernels.split_plan_kernel import (PlanLaunch, as_split_plan, plan_launch, plan_out_shapes,
                                                          plan_program)

PAGE = 64  # the Mosaic kernels' page size
STEP = 128  # their tokens a step: two pages, even tokens first, then the odd ones
Q_ROWS = 16  # query rows a quantizing program takes ([16, 512]: 32 values a thread at 4 warps)
SCALES = 1024  # token scales a gathering program takes
# Floor on the token scales behind the logarithm and reciprocal planes (``with_scale_planes``).
# The 64-row kernel's softmax sums P' / k_scale with P' = 2^(score + log2 k_scale - frame + log2
# 448). A slot never written holds scale 0: log2 -inf, 1 / 0 = inf, and 0 * inf = NaN in every
# output row that reads it. Floored, its P' is 2^(score - 60 - frame + log2 448), a normal
# float32 (so its softmax weight counts, as the reference's does) and rounds to 0 in e4m3 beside
# a zero latent. A scale below the floor but not 0 (``quantize_per_token``'s own floor gives
# 2^-108 to an all-zero latent) then carries its value 2^-60 / scale too large: at most
# 2^-60 x 448 in absolute terms. The scales' own plane (the scores' dequantization) stays exact.
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


class DecodeInputs(NamedTuple):
    """The Mosaic FP8 kernels' inputs from one launch (``decode_inputs``), query rows padded to
    P = ``padded_rows`` (the padding rows zero, as ``jnp.pad`` would leave them).

    q8 [B, P, 512] e4m3 and q_scale [B, P] f32: the query rows quantized per row;
    scales [B, steps * 128] f32, or [B, steps, 3, 128] with their base-2 logarithms and
    reciprocals (``scale_planes``): the token scales in step order;
    q_rope [B, P, 64] bf16: the RoPE rows padded, when they were passed (else None);
    plan: the balanced ``SplitPlan``, when ``num_items`` was given (else None).
    """
    q8: jax.Array
    q_scale: jax.Array
    scales: jax.Array
    q_rope: jax.Array | None = None
    plan: SplitPlan | None = None


def pad_rows(rows: jax.Array, padded_rows: int) -> jax.Array:
    """[B, rows, D] -> [B, padded_rows, D], zero rows appended (jnp)."""
    return jnp.pad(rows, [(0, 0), (0, padded_rows - rows.shape[1]), (0, 0)])


def decode_inputs_reference(q_rows: jax.Array, scale: jax.Array, block_table: jax.Array,
                            layer_offset: jax.Array, num_pages: int | None = None, *,
                            scale_planes: bool = False, q_rope_rows: jax.Array | None = None,
                            padded_rows: int | None = None) -> DecodeInputs:
    """``decode_inputs`` in jnp (no plan): q_rows [B, rows, 512] (bf16/f32), scale [N] f32,
    block_table [B, max_pages] int32, layer_offset [1] int32, num_pages (``step_scales``),
    q_rope_rows [B, rows, 64] or None, padded_rows (None: rows) -> ``DecodeInputs``."""
    padded_rows = q_rows.shape[1] if padded_rows is None else padded_rows
    q8, q_scale = quantize_per_token(pad_rows(q_rows, padded_rows).astype(jnp.float32))
    scales = step_scales(scale, block_table, layer_offset, num_pages)
    q_rope = None if q_rope_rows is None else pad_rows(q_rope_rows, padded_rows).astype(jnp.bfloat16)
    return DecodeInputs(q8, q_scale, with_scale_planes(scales) if scale_planes else scales, q_rope)


def _row_block(b, j, num_rows: int, padded_rows: int):
    """Rows [16 j, 16 j + 16) of batch row b padded to ``padded_rows``: (source [16, 1] rows of
    a [B * num_rows, D] array, target [16, 1] rows of a [B * padded_rows, D] one, real [16, 1]:
    not padding). Padding rows' sources are the row's last real one (their loads are masked):
    addresses stay inside the source."""
    row = j * Q_ROWS + jnp.arange(Q_ROWS, dtype=jnp.int32)
    source = b * num_rows + jnp.minimum(row, num_rows - 1)
    return source[:, None], (b * padded_rows + row)[:, None], (row < num_rows)[:, None]


def _copy_rows(src_ref, dst_ref, source, target, real) -> None:
    """dst_ref[target] = src_ref[source] in dst_ref's dtype, zero where not ``real``
    (``_row_block``'s rows)."""
    columns = jnp.arange(src_ref.shape[1], dtype=jnp.int32)[None, :]
    values = plgpu_tr.load(src_ref.at[source, columns], mask=real, other=0.0)
    plgpu_tr.store(dst_ref.at[target, columns], values.astype(dst_ref.dtype))


def _plan_then_rows(run_rows, programs_per_row: int, plan: PlanLaunch | None, run_plan) -> None:
    """The program body of a launch that may also compute the split plan: without a plan the grid
    is (batch, programs_per_row) and every program runs ``run_rows(b, j)``; with one it is 1-D,
    its first ``plan.programs`` programs run ``run_plan(program)`` and the rest ``run_rows``
    in (batch row, block) order."""
    if plan is None:
        run_rows(pl.program_id(0), pl.program_id(1))
        return
    program = pl.program_id(0)

    @pl.when(program < plan.programs)
    def _():
        run_plan(program)

    @pl.when(program >= plan.programs)
    def _():
        index = program - plan.programs
        run_rows(lax.div(index, programs_per_row), lax.rem(index, programs_per_row))


def _call_plan_then_rows(kernel, args: list, out_shape: list, batch: int, programs_per_row: int,
                         plan: PlanLaunch | None, *, name: str, interpret: bool) -> list:
    """The ``pallas_call`` of a body built on ``_plan_then_rows``, over whole-array refs, with the
    grid that function reads: (batch row, program of the row) without a plan; with one, flat,
    the plan's programs first (a 2-d grid would repeat them in every row)."""
    whole = pl.BlockSpec(memory_space=pl.ANY)
    grid = (batch, programs_per_row) if plan is None else (plan.programs + batch * programs_per_row,)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole] * len(args),
        out_specs=[whole] * len(out_shape),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu_tr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        name=name,
    )(*args)


def inputs_program(q_ref, scale_ref, bt_ref, off_ref, q8_ref, qsc_ref, steps_ref, b, j, *, qr_ref=None,
                   qr_out_ref=None, q_programs: int, num_rows: int, num_tokens: int, scales_block: int,
                   num_pages: int, scale_planes: bool):
    """Program (b, j): j < ``q_programs`` quantizes padded query rows [16 j, 16 j + 16) of batch
    row b (rows from ``num_rows`` on are padding: zero, as ``jnp.pad`` leaves them; with
    ``qr_ref`` it also copies those RoPE rows, zero-padded, to ``qr_out_ref``); j >= it gathers
    b's step-ordered scales [n i, n i + n), n = ``scales_block``, i = j - q_programs (with
    ``scale_planes`` also their logarithms and reciprocals, each step's after its scales).

    q_ref [B * num_rows, 512], scale_ref [N], bt_ref [B, max_pages], off_ref [1], qr_ref
    [B * num_rows, 64] (whole); q8_ref [B * P, 512] e4m3, qsc_ref [B * P], qr_out_ref [B * P, 64]
    bf16 with P = 16 ``q_programs`` the padded rows, steps_ref [B * num_tokens] (or
    [B * num_tokens * 3] with ``scale_planes``) (whole).
    """
    padded_rows = q_programs * Q_ROWS

    @pl.when(j < q_programs)
    def _():
        source, target, real = _row_block(b, j, num_rows, padded_rows)
        columns = jnp.arange(q_ref.shape[1], dtype=jnp.int32)[None, :]
        values = plgpu_tr.load(q_ref.at[source, columns], mask=real, other=0.0)
        q8, q_scale = quantize_per_token(values.astype(jnp.float32))
        plgpu_tr.store(q8_ref.at[target, columns], q8)
        plgpu_tr.store(qsc_ref.at[target[:, 0]], q_scale)
        if qr_ref is not None:
            _copy_rows(qr_ref, qr_out_ref, source, target, real)

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


def _check_rows(q_rows, q_rope_rows, padded_rows: int) -> None:
    batch, num_rows, rank = q_rows.shape
    if num_rows < 1:
        raise ValueError(f"q_rows: expected at least one query row, got shape {q_rows.shape}")
    if padded_rows < num_rows or padded_rows % Q_ROWS:
        raise ValueError(f"padded_rows: expected a multiple of {Q_ROWS} of at least q_rows' {num_rows} rows, "
                         f"got {padded_rows}")
    if q_rope_rows is not None and (q_rope_rows.ndim != 3 or q_rope_rows.shape[:2] != (batch, num_rows)):
        raise ValueError(f"q_rope_rows: expected shape ({batch}, {num_rows}, D) like q_rows, got {q_rope_rows.shape}")


def _launch(q_rows, scale, block_table, layer_offset, seq_lens, q_rope_rows, *, padded_rows: int | None,
            num_pages, scale_planes: bool, plan: PlanLaunch | None, interpret: bool) -> DecodeInputs:
    """``decode_inputs``' Pallas call, with ``plan``'s programs (``split_plan_kernel``) first in
    its grid when one is asked for."""
    batch, num_rows, rank = q_rows.shape
    padded_rows = pl.cdiv(num_rows, Q_ROWS) * Q_ROWS if padded_rows is None else padded_rows
    _check_rows(q_rows, q_rope_rows, padded_rows)
    num_pages = resolve_num_pages(num_pages, scale.shape[0], PAGE)
    num_tokens = num_step_tokens(block_table.shape[1])
    q_programs = padded_rows // Q_ROWS
    block = scales_block(num_tokens)
    per_row = q_programs + num_tokens // block
    rope = q_rope_rows is not None
    inputs = functools.partial(inputs_program, q_programs=q_programs, num_rows=num_rows, num_tokens=num_tokens,
                               scales_block=block, num_pages=num_pages, scale_planes=scale_planes)

    def kernel(q_ref, scale_ref, bt_ref, off_ref, *refs):
        refs = list(refs)
        seq_lens_ref = refs.pop(0) if plan is not None else None
        qr_ref = refs.pop(0) if rope else None
        q8_ref, qsc_ref, steps_ref = refs[:3]
        qr_out_ref = refs[3] if rope else None
        plan_refs = refs[3 + rope:]
        run_inputs = lambda b, j: inputs(q_ref, scale_ref, bt_ref, off_ref, q8_ref, qsc_ref, steps_ref, b, j,
                                         qr_ref=qr_ref, qr_out_ref=qr_out_ref)
        run_plan = lambda program: plan_program(seq_lens_ref, *plan_refs, program, plan, step_tokens=STEP,
                                                capacity=block_table.shape[1] * PAGE)
        _plan_then_rows(run_inputs, per_row, plan, run_plan)

    out_shape = [jax.ShapeDtypeStruct((batch * padded_rows, rank), FP8_DTYPE),
                 jax.ShapeDtypeStruct((batch * padded_rows,), jnp.float32),
                 jax.ShapeDtypeStruct((batch * num_tokens * (3 if scale_planes else 1),), jnp.float32)]
    args = [q_rows.reshape(batch * num_rows, rank), scale, block_table, layer_offset]
    if plan is not None:
        args.append(seq_lens)
    if rope:
        args.append(q_rope_rows.reshape(batch * num_rows, q_rope_rows.shape[2]))
        out_shape.append(jax.ShapeDtypeStruct((batch * padded_rows, q_rope_rows.shape[2]), jnp.bfloat16))
    if plan is not None:
        out_shape += plan_out_shapes(plan)
    outputs = _call_plan_then_rows(kernel, args, out_shape, batch, per_row, plan,
                                   name="snapmla_mgpu_decode_inputs", interpret=interpret)
    q8, q_scale, scales = outputs[:3]
    scales_shape = (batch, num_tokens // STEP, 3, STEP) if scale_planes else (batch, num_tokens)
    q_rope = outputs[3].reshape(batch, padded_rows, -1) if rope else None
    return DecodeInputs(q8.reshape(batch, padded_rows, rank), q_scale.reshape(batch, padded_rows),
                        scales.reshape(scales_shape), q_rope,
                        as_split_plan(*outputs[3 + rope:]) if plan is not None else None)


@functools.partial(jax.jit, static_argnames=("padded_rows", "num_pages", "scale_planes", "interpret"))
def decode_inputs(q_rows: jax.Array, scale: jax.Array, block_table: jax.Array, layer_offset: jax.Array, *,
                  q_rope_rows: jax.Array | None = None, padded_rows: int | None = None,
                  num_pages: int | None = None, scale_planes: bool = False,
                  interpret: bool = False) -> DecodeInputs:
    """``decode_inputs_reference`` in one Pallas launch: q_rows [B, rows, 512], scale [N] f32,
    block_table [B, max_pages] int32, layer_offset [1] int32, q_rope_rows [B, rows, 64] or
    None, padded_rows: the rows of the outputs (a multiple of 16, at least rows; None: rows
    rounded up to one), num_pages: pages in one layer (None: N / 64) -> ``DecodeInputs``
    (plan None).

    Padding here (the kernels take rows in blocks of 16 or 64) saves the call the XLA pads of
    q and q_rope, a launch each (2-3 us on an H100 at 64 x 32 rows)."""
    return _launch(q_rows, scale, block_table, layer_offset, None, q_rope_rows, padded_rows=padded_rows,
                   num_pages=num_pages, scale_planes=scale_planes, plan=None, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("num_items", "padded_rows", "num_pages", "scale_planes", "interpret"))
def decode_inputs_and_plan(q_rows: jax.Array, scale: jax.Array, block_table: jax.Array, layer_offset: jax.Array,
                           seq_lens: jax.Array, *, num_items: int, q_rope_rows: jax.Array | None = None,
                           padded_rows: int | None = None, num_pages: int | None = None,
                           scale_planes: bool = False, interpret: bool = False) -> DecodeInputs:
    """``decode_inputs`` and the balanced split plan of seq_lens [B] int32 in W = ``num_items``
    items of 128-token steps (``split_plan.balanced_plan`` with the table's capacity, the same
    values as ``split_plan_kernel.balanced_plan_kernel``) in the same launch: one launch a decode
    call fewer. Returns ``DecodeInputs`` with its plan."""
    return _launch(q_rows, scale, block_table, layer_offset, seq_lens, q_rope_rows, padded_rows=padded_rows,
                   num_pages=num_pages, scale_planes=scale_planes, plan=plan_launch(seq_lens, num_items),
                   interpret=interpret)


class TwinInputs(NamedTuple):
    """The BF16 twin's query rows padded to P rows in one launch (``bf16_rows_and_plan``)."""
    q: jax.Array  # [B, P, 512] bf16
    q_rope: jax.Array  # [B, P, 64] bf16
    plan: SplitPlan | None  # the balanced plan, when ``num_items`` was given


@functools.partial(jax.jit, static_argnames=("padded_rows", "num_items", "capacity", "interpret"))
def bf16_rows_and_plan(q_rows: jax.Array, q_rope_rows: jax.Array, seq_lens: jax.Array | None = None, *,
                       padded_rows: int, num_items: int | None = None, capacity: int | None = None,
                       interpret: bool = False) -> TwinInputs:
    """The BF16 twin's inputs in one launch: q_rows [B, rows, 512] and q_rope_rows [B, rows, 64]
    (bf16/f32) cast to bf16 and padded with zero rows to ``padded_rows`` (a multiple of 16, at
    least rows), and with ``num_items`` the balanced split plan of seq_lens [B] int32 over a
    block table of ``capacity`` tokens (the values of ``split_plan_kernel.balanced_plan_kernel``).
    Where XLA pads q and q_rope in a launch each (and the plan takes its own)."""
    batch, num_rows, _ = q_rows.shape
    _check_rows(q_rows, q_rope_rows, padded_rows)
    if (num_items is None) != (capacity is None) or (num_items is not None and seq_lens is None):
        raise ValueError("num_items: a plan needs num_items, capacity and seq_lens together, got "
                         f"num_items={num_items!r}, capacity={capacity!r}, seq_lens {'given' if seq_lens is not None else None}")
    programs = padded_rows // Q_ROWS
    plan = None if num_items is None else plan_launch(seq_lens, num_items)

    def kernel(*refs):
        refs = list(refs)
        seq_lens_ref = refs.pop(0) if plan is not None else None
        q_ref, qr_ref, q_out_ref, qr_out_ref, *plan_refs = refs

        def rows(b, j):
            source, target, real = _row_block(b, j, num_rows, padded_rows)
            _copy_rows(q_ref, q_out_ref, source, target, real)
            _copy_rows(qr_ref, qr_out_ref, source, target, real)

        _plan_then_rows(rows, programs, plan, lambda program: plan_program(
            seq_lens_ref, *plan_refs, program, plan, step_tokens=STEP, capacity=capacity))

    rope = q_rope_rows.shape[2]
    args = [q_rows.reshape(batch * num_rows, -1), q_rope_rows.reshape(batch * num_rows, rope)]
    out_shape = [jax.ShapeDtypeStruct((batch * padded_rows, q_rows.shape[2]), jnp.bfloat16),
                 jax.ShapeDtypeStruct((batch * padded_rows, rope), jnp.bfloat16)]
    if plan is not None:
        args.insert(0, seq_lens)
        out_shape += plan_out_shapes(plan)
    outputs = _call_plan_then_rows(kernel, args, out_shape, batch, programs, plan,
                                   name="snapmla_mgpu_bf16_rows", interpret=interpret)
    return TwinInputs(outputs[0].reshape(batch, padded_rows, -1), outputs[1].reshape(batch, padded_rows, rope),
                      None if plan is None else as_split_plan(*outputs[2:]))

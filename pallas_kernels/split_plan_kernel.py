"""``split_plan.balanced_plan`` in one Pallas launch.

In jnp XLA runs the balanced plan as three to five small launches (the steps' sum, the items'
cumulative sum, the [W, B] mask's sums, the stack), ~1.1-2 us each on an H100: 6.3 us of GPU
time in a B=32 x 16k x 128 decode call of ~0.21 ms (scripts/profile_decode_launches.py). This
kernel: 1.7-2.6 us at B = 8-256. Here each program recomputes the per-row counts from seq_lens
(B <= a few hundred values: cheaper than a second launch to share them) and fills a block of items from the same [items, B] mask as the reference, the
block small enough that the mask stays near ``MASK_VALUES`` values (``items_per_program``).

Backend: Pallas' Triton lowering (masked loads and stores, ``cumsum``); interpret mode on
the CPU. The reference is ``split_plan.balanced_plan``, which the tests compare bit for bit.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_tr

from snapmla_jax.pallas_kernels.split_plan import SplitPlan

MIN_ROWS = 16  # Triton's smallest block; the row axis is padded to a power of two at least this
# Values of a program's [items, rows] mask. Its three sums cost ~0.5 ns a value past a base of
# ~2 us a launch (H100, one program of [128, 32] 2.1 us, of [128, 64] 4.2, of [128, 128] 10.2):
# programs of fewer items run side by side instead.
MASK_VALUES = 2048
NUM_WARPS = 4


def _cdiv(a, b):
    return (a + b - 1) // b


def items_per_program(rows: int) -> int:
    """Items a program fills for ``rows`` (padded) batch rows: a power of two in [16, 128]."""
    return max(16, min(128, MASK_VALUES // rows))


class PlanLaunch(NamedTuple):
    """How the plan's programs split W items over B batch rows (``plan_launch``)."""
    batch: int
    rows: int  # B padded to a power of two, at least ``MIN_ROWS``
    num_items: int
    block: int  # items a program fills (``items_per_program``)
    programs: int


def plan_launch(seq_lens: jax.Array, num_items: int) -> PlanLaunch:
    """The programs of a plan of ``num_items`` items over seq_lens [B]; ValueError unless
    seq_lens is a 1-d int32 array and W > B."""
    if seq_lens.ndim != 1 or seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens: expected a 1-d int32 array, got {seq_lens.dtype}{list(seq_lens.shape)}")
    batch = seq_lens.shape[0]
    if num_items <= batch:
        raise ValueError(f"num_items: expected more items than batch rows ({batch}), got {num_items}")
    rows = pl.next_power_of_2(max(batch, MIN_ROWS))
    block = items_per_program(rows)
    return PlanLaunch(batch, rows, num_items, block, pl.cdiv(num_items, block))


def plan_program(seq_lens_ref, items_ref, start_ref, count_ref, program, launch: PlanLaunch, *, step_tokens: int,
                 capacity: int) -> None:
    """Program ``program`` of ``launch`` fills items [block i, block i + block) of items_ref
    [3 * W] (row, split, count planes one after the other); program 0 also writes start_ref and
    count_ref [B]. A Pallas Triton program body: ``balanced_plan_kernel``'s, and a part of
    ``mgpu_decode_inputs.decode_inputs``' launch.

    seq_lens_ref [B] int32 (whole). Rows past B (``launch.rows`` pads B to a power of two) get
    no items (count 0, so no item falls in their empty [start, end)).
    """
    batch, rows, num_items, block = launch.batch, launch.rows, launch.num_items, launch.block
    row = jnp.arange(rows, dtype=jnp.int32)
    real_row = row < batch
    seq_len = plgpu_tr.load(seq_lens_ref.at[jnp.minimum(row, batch - 1)])
    steps = jnp.where(real_row, _cdiv(jnp.clip(seq_len, 0, capacity), step_tokens), 0)
    per_item = jnp.maximum(1, _cdiv(jnp.sum(steps), num_items - batch))
    count = jnp.where(real_row, jnp.maximum(1, _cdiv(steps, per_item)), 0)
    end = jnp.cumsum(count)
    start = end - count

    item = program * block + jnp.arange(block, dtype=jnp.int32)
    mine = (start[None, :] <= item[:, None]) & (item[:, None] < end[None, :])
    pick = lambda values: jnp.sum(jnp.where(mine, values, 0), axis=1)
    real_item = item < num_items
    plgpu_tr.store(items_ref.at[item], pick(row[None, :]), mask=real_item)
    plgpu_tr.store(items_ref.at[num_items + item], pick(item[:, None] - start[None, :]), mask=real_item)
    plgpu_tr.store(items_ref.at[2 * num_items + item], pick(count[None, :]), mask=real_item)

    @pl.when(program == 0)
    def _():
        plgpu_tr.store(start_ref.at[row], start, mask=real_row)
        plgpu_tr.store(count_ref.at[row], count, mask=real_row)


def plan_out_shapes(launch: PlanLaunch) -> list[jax.ShapeDtypeStruct]:
    """The plan's three outputs as a Pallas call writes them: items [3 W], item_start [B],
    item_count [B], int32."""
    return [jax.ShapeDtypeStruct((3 * launch.num_items,), jnp.int32),
            jax.ShapeDtypeStruct((launch.batch,), jnp.int32),
            jax.ShapeDtypeStruct((launch.batch,), jnp.int32)]


def as_split_plan(items: jax.Array, start: jax.Array, count: jax.Array) -> SplitPlan:
    """``plan_out_shapes``' arrays as a ``SplitPlan``."""
    return SplitPlan(items.reshape(3, -1), start, count)


@functools.partial(jax.jit, static_argnames=("num_items", "step_tokens", "capacity", "interpret"))
def balanced_plan_kernel(seq_lens: jax.Array, *, num_items: int, step_tokens: int, capacity: int,
                         interpret: bool = False) -> SplitPlan:
    """``split_plan.balanced_plan`` (the same arguments, the same values) in one launch:
    seq_lens [B] int32 -> SplitPlan(items int32 [3, W], item_start [B], item_count [B]).

    Raises ValueError unless seq_lens is a 1-d int32 array and W (``num_items``) > B.
    """
    launch = plan_launch(seq_lens, num_items)

    def kernel(seq_lens_ref, items_ref, start_ref, count_ref):
        plan_program(seq_lens_ref, items_ref, start_ref, count_ref, pl.program_id(0), launch,
                     step_tokens=step_tokens, capacity=capacity)

    whole = pl.BlockSpec(memory_space=pl.ANY)
    outputs = pl.pallas_call(
        kernel,
        grid=(launch.programs,),
        in_specs=[whole],
        out_specs=[whole] * 3,
        out_shape=plan_out_shapes(launch),
        interpret=interpret,
        compiler_params=plgpu_tr.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        name="snapmla_split_plan",
    )(seq_lens)
    return as_split_plan(*outputs)

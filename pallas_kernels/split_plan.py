"""Which CTA decodes which tokens: the split-KV plan of the Mosaic decode kernels.

A Mosaic decode call runs one CTA per (work item, block of query rows). A work item is
one contiguous run of whole steps (``step_tokens`` tokens) of one batch row; a batch row's
items together cover its seq_len, in order. Each item writes normalised partials and their
log-sum-exp, merged per row by ``combine_splits_mgpu.combine_items_mgpu``; a row of a single item
writes its output directly.

Three plans:

- ``uniform_plan``: every row cut into the same number of items, S (``num_splits``): what
  the grid (batch row, split, row block) always did. Fine while the rows are about as long
  as each other.
- ``balanced_plan``: the number of items a row gets follows its length, from seq_lens at run
  time, within a static budget of ``num_items`` items (FlashMLA's tile-scheduler metadata does
  this job). With the same S for all, one 64k row among 2k ones keeps S CTAs busy for
  64k / S tokens while the GPU idles; balanced, it gets ~its share of the SMs.

The balanced rule. Each item takes at most L = ceil(total steps / (W - B)) steps, and row b
gets n_b = max(1, ceil(steps_b / L)) items of ceil(steps_b / n_b) steps each (the last one
shorter). Then sum n_b <= sum (steps_b / L + 1) <= W: the budget always suffices, every row
(seq_len 0 included) has an item, and no item is empty but those of an empty row. With W =
B (S + 1) rows of equal length get exactly the uniform plan's S items each (L = ceil(steps /
S)), so the plan costs nothing when the batch is even; items past sum n_b are unused (count 0)
and their CTAs return at once.
- ``wave_plan``: the batch's steps laid end to end and cut into ``num_segments`` equal segments,
  one an SM (FlashMLA's tile scheduler divides the batch's token blocks this way). A row's items
  are its pieces in each segment it crosses, so they differ in length: each carries its first
  step and step count. Its CTAs then run in a launch order of their own: the piece that opens
  each segment first (one wave, all starting together), then the rest, longest first. The GPU
  hands a waiting CTA to the SM that frees first, which ran the shortest opening piece; its
  segment's remainder is the longest one left, so each SM ends near one segment's time, and a
  batch one row past a wave costs a row's share, not a second wave (``decode.wave_cost``).

A plan's items are in row order (a row's items contiguous: the merge reads them as a run); a
wave plan adds the launch order and the explicit steps as three more fields of ``items``
(``EXPLICIT_FIELDS``), read in the kernels through ``cta_item`` and ``cta_steps``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


# Fields of a wave plan's items: those of every plan (batch row, index among the row's items, the
# row's item count), then the launch order (CTA w runs item order[w]), each item's first step and steps.
EXPLICIT_FIELDS = 6


class SplitPlan(NamedTuple):
    """Work items of one decode call (W items over B batch rows).

    items       int32 [3, W]: per item its batch row, its index among the row's items and the
                row's item count; an unused item holds (0, 0, 0). A ``wave_plan``'s is
                [6, W]: also the launch order (field 3, by CTA), and per item its first step
                and its number of steps (fields 4 and 5).
    item_start  int32 [B]: the row's first item (its items are contiguous).
    item_count  int32 [B]: the row's items, >= 1.
    uniform_splits  static: the items every row has (``uniform_plan``), None where they
                follow the rows (``balanced_plan``).
    """
    items: jax.Array
    item_start: jax.Array
    item_count: jax.Array
    uniform_splits: int | None = None

    @property
    def explicit(self) -> bool:
        """Whether the items carry their steps and a launch order (``wave_plan``)."""
        return self.items.shape[0] == EXPLICIT_FIELDS

    @property
    def partials(self) -> bool:
        """Whether a row may have several items (whose partials then need slots and a merge)."""
        return self.uniform_splits != 1


def uniform_plan(batch: int, num_splits: int) -> SplitPlan:
    """Every batch row in ``num_splits`` items, item b * S + s its split s (W = B x S). Built in
    numpy: constants of the compiled call, not computed on the device at every call."""
    if batch < 1 or num_splits < 1:
        raise ValueError(f"batch, num_splits: expected positive ints, got {batch!r}, {num_splits!r}")
    item = np.arange(batch * num_splits, dtype=np.int32)
    items = np.stack([item // num_splits, item % num_splits, np.full_like(item, num_splits)])
    start = np.arange(batch, dtype=np.int32) * num_splits
    return SplitPlan(jnp.asarray(items), jnp.asarray(start), jnp.full((batch,), num_splits, jnp.int32), num_splits)


def balanced_items(batch: int, num_splits: int) -> int:
    """The item budget W of ``balanced_plan`` that gives rows of equal length ``num_splits``
    items each: B (S + 1)."""
    return batch * (num_splits + 1)


def balanced_plan(seq_lens: jax.Array, *, num_items: int, step_tokens: int, capacity: int) -> SplitPlan:
    """Items in proportion to each row's steps (module docstring), from seq_lens [B] int32
    (clipped into [0, ``capacity``] as the kernels clip them), ``num_items`` (W > B) items in
    all, steps of ``step_tokens`` tokens. Traceable: W is static, the rest is computed on the
    device."""
    batch = seq_lens.shape[0]
    if num_items <= batch:
        raise ValueError(f"num_items: expected more items than batch rows ({batch}), got {num_items}")
    steps = (jnp.clip(seq_lens, 0, capacity) + step_tokens - 1) // step_tokens
    per_item = jnp.maximum(1, -(-jnp.sum(steps) // (num_items - batch)))
    count = jnp.maximum(1, -(-steps // per_item)).astype(jnp.int32)
    end = jnp.cumsum(count)
    start = (end - count).astype(jnp.int32)
    # Item w belongs to the row whose [start, end) holds it: one [W, B] mask and three sums over
    # it. (``jnp.searchsorted``'s default method is an XLA while loop, ~130 us a call on an H100.)
    # In XLA this plan is five small launches, ~1.1-2 us each on an H100; the Mosaic kernels
    # compute it in their inputs launch, or alone in one (``mgpu_decode_inputs.balanced_plan_kernel``,
    # 1.6-2.5 us on an H200), this being its reference.
    item = jnp.arange(num_items, dtype=jnp.int32)[:, None]
    mine = (start[None, :] <= item) & (item < end[None, :])
    pick = lambda values: jnp.sum(jnp.where(mine, values, 0), axis=1, dtype=jnp.int32)
    rows = jnp.arange(batch, dtype=jnp.int32)[None, :]
    items = jnp.stack([pick(rows), pick(item - start[None, :]), pick(count[None, :])])
    return SplitPlan(items, start, count)


def item_steps(seq_len, split, count, *, s_q: int, step_tokens: int):
    """The steps of ``step_tokens`` tokens item ``split`` of a row's ``count`` items takes:
    (first_step, num_steps, unmasked_steps), int32 scalars (traced in a kernel).

    Item s takes steps [first_step, first_step + num_steps) of the row: ceil(steps / count)
    each, the last fewer. The first ``unmasked_steps`` of them every query row sees whole (the
    shortest real row sees seq_len - s_q + 1 tokens), so they run without masks. count 0 (an
    unused item) takes none. Non-negative operands throughout, so ``lax.div`` is the floor.
    """
    total_steps = jax.lax.div(seq_len + (step_tokens - 1), step_tokens)
    steps_per_item = jax.lax.div(total_steps + (count - 1), jnp.maximum(count, 1))
    first_step = split * steps_per_item
    num_steps = jnp.where(count > 0, jnp.maximum(jnp.minimum(total_steps - first_step, steps_per_item), 0), 0)
    return first_step, num_steps, unmasked(seq_len, first_step, num_steps, s_q=s_q, step_tokens=step_tokens)


def unmasked(seq_len, first_step, num_steps, *, s_q: int, step_tokens: int):
    """How many of an item's steps [first_step, first_step + num_steps) every query row sees whole
    (the shortest real row sees seq_len - s_q + 1 tokens): they run without masks."""
    return jnp.clip(jax.lax.div(jnp.maximum(seq_len - s_q + 1, 0), step_tokens) - first_step, 0, num_steps)


def wave_plan(seq_lens: jax.Array, *, num_segments: int, step_tokens: int, capacity: int) -> SplitPlan:
    """The batch's steps cut into ``num_segments`` equal segments (module docstring), from
    seq_lens [B] int32 (clipped into [0, ``capacity``] as the kernels clip them), steps of
    ``step_tokens`` tokens. Traceable: W = B + num_segments items (a row has one item per
    segment it crosses, and each cut inside a row adds one: at most B + num_segments - 1 in
    all); a row of seq_len 0 has one item of no steps (out 0, lse -inf)."""
    batch = seq_lens.shape[0]
    if num_segments < 1:
        raise ValueError(f"num_segments: expected a positive int, got {num_segments!r}")
    num_items = batch + num_segments
    steps = (jnp.clip(seq_lens, 0, capacity) + step_tokens - 1) // step_tokens
    row_end = jnp.cumsum(steps).astype(jnp.int32)
    row_start = row_end - steps
    seg = jnp.maximum(1, -(-row_end[-1] // num_segments))
    first_seg = row_start // seg
    count = jnp.where(steps > 0, -(-row_end // seg) - first_seg, 1).astype(jnp.int32)
    end = jnp.cumsum(count)
    start = (end - count).astype(jnp.int32)
    item = jnp.arange(num_items, dtype=jnp.int32)[:, None]
    mine = (start[None, :] <= item) & (item < end[None, :])
    pick = lambda values: jnp.sum(jnp.where(mine, values, 0), axis=1, dtype=jnp.int32)
    item = item[:, 0]
    used = item < end[-1]
    split = jnp.where(used, item - pick(start[None, :]), 0)
    piece_seg = pick(first_seg[None, :]) + split
    start_of_row = pick(row_start[None, :])
    lo = jnp.maximum(start_of_row, piece_seg * seg)
    hi = jnp.minimum(pick(row_end[None, :]), (piece_seg + 1) * seg)
    num_steps = jnp.where(used, jnp.maximum(hi - lo, 0), 0)
    first_step = jnp.where(used, lo - start_of_row, 0)
    # Launch order: each segment's opening piece, then the rest longest first, then the rows of
    # no steps, then the unused items (a stable sort keeps item order among equals).
    opens = (lo == piece_seg * seg) & (num_steps > 0)
    key = jnp.where(~used, seg + 3, jnp.where(num_steps == 0, seg + 2, jnp.where(opens, 0, 1 + seg - num_steps)))
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    items = jnp.stack([pick(jnp.arange(batch, dtype=jnp.int32)[None, :]), split, pick(count[None, :]), order,
                       first_step, num_steps])
    return SplitPlan(items, start, count)


def cta_item(items_ref, w):
    """The item CTA ``w`` runs: w itself, or a wave plan's launch order (``SplitPlan.items``)."""
    return items_ref[3, w] if items_ref.shape[0] == EXPLICIT_FIELDS else w


def cta_steps(items_ref, item, seq_len, *, s_q: int, step_tokens: int):
    """``item_steps`` of ``item`` of the plan in items_ref [3 or 6, W]: computed from its split
    and count, or a wave plan's own first step and steps (fields 4 and 5)."""
    if items_ref.shape[0] != EXPLICIT_FIELDS:
        return item_steps(seq_len, items_ref[1, item], items_ref[2, item], s_q=s_q, step_tokens=step_tokens)
    first_step, num_steps = items_ref[4, item], items_ref[5, item]
    return first_step, num_steps, unmasked(seq_len, first_step, num_steps, s_q=s_q, step_tokens=step_tokens)

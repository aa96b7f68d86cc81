"""The split-KV plans of the Mosaic decode kernels (pallas_kernels/split_plan.py): which
steps of which row each work item takes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from snapmla_jax.pallas_kernels.split_plan import (EXPLICIT_FIELDS, balanced_items, balanced_plan, cta_item, cta_steps,
                                                   item_steps, uniform_plan, wave_plan)
from snapmla_jax.pallas_kernels.mgpu_decode_inputs import balanced_plan_kernel
from snapmla_jax.backend import lower_for_cuda

STEP = 128


def _walk(plan, seq_lens, *, s_q=1, step_tokens=STEP):
    """Per item (row, count, first_step, num_steps, unmasked_steps), as the kernels read the plan
    (``cta_steps``: item_steps, or a wave plan's own steps)."""
    items = np.asarray(plan.items)
    out = []
    for w in range(items.shape[1]):
        b, count = int(items[0, w]), int(items[2, w])
        steps = cta_steps(items, w, jnp.int32(seq_lens[b]), s_q=s_q, step_tokens=step_tokens)
        out.append((b, count, *(int(v) for v in steps)))
    return out


def _check_covers(plan, seq_lens, capacity, *, step_tokens=STEP):
    """Every row's items are contiguous from item_start, take its steps in order exactly once,
    and every row has at least one item; items past the used ones are (0, 0, 0) and walk nothing."""
    lens = np.clip(np.asarray(seq_lens), 0, capacity)
    start, count = np.asarray(plan.item_start), np.asarray(plan.item_count)
    walked = _walk(plan, lens, step_tokens=step_tokens)
    assert (count >= 1).all()
    assert (start == np.concatenate([[0], np.cumsum(count)[:-1]])).all()
    used = int(count.sum())
    assert used <= plan.items.shape[1]
    for b, n in enumerate(lens):
        steps = -(-int(n) // step_tokens)
        mine = walked[start[b]:start[b] + count[b]]
        assert all(w[0] == b and w[1] == count[b] for w in mine)
        covered = [s for _, _, first, num, _ in mine for s in range(first, first + num)]
        assert covered == list(range(steps)), (b, n, mine)
    assert all(w[1] == 0 and w[3] == 0 for w in walked[used:])
    fields = [0, 1, 2, 4, 5] if plan.explicit else [0, 1, 2]  # a wave plan's launch order covers them all
    assert (np.asarray(plan.items)[fields, used:] == 0).all()
    return walked[:used]


def test_uniform_plan_gives_every_row_num_splits_items_in_row_order():
    plan = uniform_plan(3, 4)
    items = np.asarray(plan.items)
    assert items.shape == (3, 12)
    assert (items[0] == np.repeat(np.arange(3), 4)).all()
    assert (items[1] == np.tile(np.arange(4), 3)).all()
    assert (items[2] == 4).all()
    assert list(np.asarray(plan.item_start)) == [0, 4, 8] and list(np.asarray(plan.item_count)) == [4, 4, 4]


def _random_batch(seed: int, max_batch: int):
    """(rng, batch, capacity, seq_lens): a random batch of up to ``max_batch`` rows, a fifth of them
    empty, the first (of more than two) at the table's capacity."""
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, max_batch))
    capacity = int(rng.choice([128, 1000, 16384, 65536]))
    lens = rng.integers(0, capacity + 1, batch)
    lens[rng.random(batch) < 0.2] = 0  # empty rows
    if batch > 2:
        lens[0] = capacity  # a row at the capacity
    return rng, batch, capacity, lens


@pytest.mark.parametrize("seed", range(6))
def test_balanced_plan_covers_every_row_within_the_budget(seed):
    rng, batch, capacity, lens = _random_batch(seed, 40)
    num_items = balanced_items(batch, int(rng.integers(1, 8)))
    plan = balanced_plan(jnp.asarray(lens, jnp.int32), num_items=num_items, step_tokens=STEP, capacity=capacity)
    walked = _check_covers(plan, lens, capacity)
    total = int(sum(-(-int(n) // STEP) for n in lens))
    longest = max(-(-total // (num_items - batch)), 1)
    assert max(w[3] for w in walked) <= longest  # no item past its share
    assert all(w[3] > 0 for w in walked if lens[w[0]] > 0)  # only empty rows have empty items


def test_balanced_plan_of_equal_rows_is_the_uniform_plan():
    """With the budget B (S + 1), rows of one length get S items each, as the uniform plan."""
    for batch, splits, length in ((32, 2, 16384), (1, 66, 16384), (128, 1, 16384), (5, 3, 4000)):
        lens = jnp.full((batch,), length, jnp.int32)
        plan = balanced_plan(lens, num_items=balanced_items(batch, splits), step_tokens=STEP, capacity=length)
        steps = -(-length // STEP)
        expected = -(-steps // -(-steps // splits))  # S, or fewer when items of ceil(steps / S) need fewer
        assert (np.asarray(plan.item_count) == expected).all(), (batch, splits)
        uniform = uniform_plan(batch, expected)
        assert (np.asarray(plan.items)[:, :batch * expected] == np.asarray(uniform.items)).all()


def test_balanced_plan_gives_a_long_row_the_items_of_the_short_ones():
    """One 64k row among 31 of 2k: uniform 2 splits leave it to 2 items of 256 steps while the
    short rows finish in 8; balanced, no item takes more than the average share."""
    lens = np.full(32, 2048)
    lens[7] = 65536
    plan = balanced_plan(jnp.asarray(lens, jnp.int32), num_items=balanced_items(32, 2), step_tokens=STEP,
                         capacity=65536)
    walked = _check_covers(plan, lens, 65536)
    count = np.asarray(plan.item_count)
    assert count[7] == 32 and (np.delete(count, 7) == 1).all()
    assert max(w[3] for w in walked) == 16  # (512 + 31 x 16) / 64 steps, rounded up


def test_balanced_plan_clips_seq_lens_into_the_capacity_and_runs_under_jit():
    lens = jnp.asarray([-5, 300, 10**6], jnp.int32)
    plan = jax.jit(lambda s: balanced_plan(s, num_items=9, step_tokens=64, capacity=640))(lens)
    _check_covers(plan, [0, 300, 640], 640, step_tokens=64)


def test_balanced_plan_needs_more_items_than_rows():
    with pytest.raises(ValueError, match="num_items"):
        balanced_plan(jnp.ones((4,), jnp.int32), num_items=4, step_tokens=STEP, capacity=STEP)


@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_unmasked_steps_are_the_steps_every_query_sees_whole(s_q):
    """Item steps below ``unmasked_steps`` are seen whole by the shortest query (seq_len - s_q + 1
    tokens); the next one is not (or the item ends)."""
    for seq_len in (0, 1, 127, 128, 129, 130, 1000, 1024):
        for count in (1, 2, 3):
            for split in range(count):
                first, num, unmasked = (int(v) for v in item_steps(
                    jnp.int32(seq_len), jnp.int32(split), jnp.int32(count), s_q=s_q, step_tokens=STEP))
                shortest = seq_len - s_q + 1
                whole = [(first + j + 1) * STEP <= shortest for j in range(num)]
                assert whole == [j < unmasked for j in range(num)], (seq_len, count, split)


# --- wave_plan: the batch's steps in equal segments, one an SM -------------------------------

ITEM_COST = 2  # a work item's fixed cost in steps (decode.ITEM_STEPS)


def _makespan(plan, slots: int) -> float:
    """The time, in steps, of the plan's items run in its launch order on ``slots`` SMs, each
    item given to the SM that frees first (the GPU's block scheduler), an item taking its
    steps plus ``ITEM_COST``."""
    items = np.asarray(plan.items)
    free = [0.0] * slots
    for w in range(items.shape[1]):
        item = int(cta_item(items, w))
        if items[2, item] == 0:
            continue
        sm = int(np.argmin(free))
        free[sm] += items[5, item] + ITEM_COST
    return max(free)


@pytest.mark.parametrize("seed", range(6))
def test_wave_plan_covers_every_row_within_its_budget(seed):
    rng, batch, capacity, lens = _random_batch(seed, 70)
    segments = int(rng.choice([1, 7, 33, 66, 132]))
    plan = wave_plan(jnp.asarray(lens, jnp.int32), num_segments=segments, step_tokens=STEP, capacity=capacity)
    assert plan.explicit and plan.items.shape == (EXPLICIT_FIELDS, batch + segments) and plan.partials
    walked = _check_covers(plan, lens, capacity)
    total = int(sum(-(-int(n) // STEP) for n in lens))
    seg = max(1, -(-total // segments))
    assert max(w[3] for w in walked) <= seg  # no item past a segment
    assert all(w[3] > 0 for w in walked if lens[w[0]] > 0)
    order = np.asarray(plan.items)[3]
    assert sorted(order) == list(range(batch + segments))  # every item launched once


def test_wave_plan_launches_each_segments_opening_piece_first_then_the_rest_longest_first():
    lens = jnp.full((67,), 16384, jnp.int32)
    plan = wave_plan(lens, num_segments=66, step_tokens=STEP, capacity=16384)
    items = np.asarray(plan.items)
    launched = items[5, items[3]]
    used = int(np.asarray(plan.item_count).sum())
    first, rest = launched[:66], launched[66:used]
    seg = -(-67 * 128 // 66)
    starts = np.cumsum(np.concatenate([[0], items[5, :used - 1]]))  # in row order, steps laid end to end
    opening = set(np.flatnonzero((starts % seg == 0) & (items[5, :used] > 0)))
    assert set(items[3, :66]) == opening
    assert list(rest) == sorted(rest, reverse=True)
    assert first.min() > 0


@pytest.mark.parametrize("batch", [40, 67, 72, 100, 140, 200])
def test_wave_plan_costs_a_batch_its_share_of_the_sms(batch):
    """Rows of 128 steps on 66 item slots (H = 128 x 16k on 132 SMs: two row blocks an item):
    scheduled as the GPU does, the plan ends within two items' fixed costs (and one more for a
    segment crossing three rows) of the batch's share, where the uniform plans' whole waves cost
    up to 1.3x it (``decode.choose_num_splits``)."""
    plan = wave_plan(jnp.full((batch,), 16384, jnp.int32), num_segments=66, step_tokens=STEP, capacity=16384)
    share = batch * 128 / 66
    pieces = -(-int(np.ceil(share)) // 128) + 1
    assert _makespan(plan, 66) <= np.ceil(share) + ITEM_COST * pieces, (_makespan(plan, 66), share)


def test_wave_plan_of_rows_a_segment_each_cuts_nothing():
    """66 rows on 66 segments: one item a row, no partials to merge (each writes its row)."""
    plan = wave_plan(jnp.full((66,), 16384, jnp.int32), num_segments=66, step_tokens=STEP, capacity=16384)
    assert (np.asarray(plan.item_count) == 1).all()


def test_wave_plan_clips_seq_lens_and_runs_under_jit():
    lens = jnp.asarray([-5, 300, 10**6, 0], jnp.int32)
    plan = jax.jit(lambda s: wave_plan(s, num_segments=3, step_tokens=64, capacity=640))(lens)
    _check_covers(plan, [0, 300, 640, 0], 640, step_tokens=64)
    with pytest.raises(ValueError, match="num_segments"):
        wave_plan(lens, num_segments=0, step_tokens=64, capacity=640)


@pytest.mark.parametrize("s_q", [1, 2, 4])
def test_wave_plan_unmasked_steps_are_the_steps_every_query_sees_whole(s_q):
    lens = [0, 1, 127, 128, 129, 130, 1000, 1024]
    plan = wave_plan(jnp.asarray(lens, jnp.int32), num_segments=5, step_tokens=STEP, capacity=1024)
    for b, _, first, num, unmasked in _walk(plan, lens, s_q=s_q):
        shortest = lens[b] - s_q + 1
        whole = [(first + j + 1) * STEP <= shortest for j in range(num)]
        assert whole == [j < unmasked for j in range(num)], (b, first, num)


# --- balanced_plan_kernel: the same plan in one Pallas launch ----------------------------------

def _kernel_cases():
    """(seq_lens, num_items, capacity): odd and power-of-two batches, W below, at and past the
    kernel's 128-item blocks, empty rows, negative and over-capacity seq_lens, one long row."""
    rng = np.random.default_rng(7)
    cases = []
    for batch, splits, capacity in ((2, 1, 128), (3, 2, 1000), (16, 7, 16384), (33, 3, 65536), (64, 1, 4096),
                                    (130, 2, 2048), (256, 1, 65536)):
        lens = rng.integers(-3, capacity + 200, batch).astype(np.int32)
        lens[rng.random(batch) < 0.2] = 0
        cases.append((lens, balanced_items(batch, splits), capacity))
    one_long = np.full(32, 2048, np.int32)
    one_long[7] = 65536
    cases.append((one_long, balanced_items(32, 2), 65536))
    return cases


def _assert_same_plan(got, want):
    for name, g, w in zip(("items", "item_start", "item_count"), got[:3], want[:3]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


@pytest.mark.parametrize("case", range(len(_kernel_cases())))
def test_plan_kernel_equals_the_reference_plan(case):
    lens, num_items, capacity = _kernel_cases()[case]
    want = balanced_plan(jnp.asarray(lens), num_items=num_items, step_tokens=STEP, capacity=capacity)
    got = balanced_plan_kernel(jnp.asarray(lens), num_items=num_items, step_tokens=STEP, capacity=capacity,
                               interpret=True)
    _assert_same_plan(got, want)
    assert got.uniform_splits is None and got.partials
    _check_covers(got, lens, capacity)


def test_plan_kernel_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_items"):
        balanced_plan_kernel(jnp.ones((4,), jnp.int32), num_items=4, step_tokens=STEP, capacity=STEP, interpret=True)
    with pytest.raises(ValueError, match="seq_lens"):
        balanced_plan_kernel(jnp.ones((4,), jnp.float32), num_items=8, step_tokens=STEP, capacity=STEP,
                             interpret=True)
    with pytest.raises(ValueError, match="seq_lens"):
        balanced_plan_kernel(jnp.ones((2, 2), jnp.int32), num_items=8, step_tokens=STEP, capacity=STEP,
                             interpret=True)


def test_plan_kernel_lowers_for_cuda():
    for batch, num_items in ((3, 9), (256, 512)):
        lowered = lower_for_cuda(lambda s: balanced_plan_kernel(s, num_items=num_items, step_tokens=STEP,
                                                                capacity=65536),
                                 jax.ShapeDtypeStruct((batch,), jnp.int32))
        assert "snapmla_split_plan" in lowered.as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(_kernel_cases())))
def test_compiled_plan_kernel_equals_the_reference_plan(case):
    lens, num_items, capacity = _kernel_cases()[case]
    want = balanced_plan(jnp.asarray(lens), num_items=num_items, step_tokens=STEP, capacity=capacity)
    _assert_same_plan(balanced_plan_kernel(jnp.asarray(lens), num_items=num_items, step_tokens=STEP,
                                           capacity=capacity), want)

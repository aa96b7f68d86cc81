"""The routed experts of a few tokens, each expert's weights read by id where they lie, and the jnp reference.

For a decode step of T tokens (T x k expert assignments, k experts a token), the
MoE's routed experts are k matrix-vector products a token per weight. The jnp
"gathered" dispatch (``models.moe``) indexes the stacked expert weights with the
chosen ids, which XLA runs as a copy of T*k experts' matrices and then products
over the copy: each chosen byte read twice and written once, and inside a whole
feed-forward stack XLA compiles it into slow reduce fusions. Here two Pallas launches
read every chosen expert's matrices in place, once an assignment. The 27-layer
feed-forward stack of V2-Lite shapes on an H100: 2.36 ms at T = 1 (jnp gather 6.70,
weight-read floor 1.27), 7.31 at T = 8 (42.7; dense 10.8) (scripts/bench_ffn_stack.py). The launches:

1. ``hidden[a, i] = silu(x[t] . w_gate[e, :, i]) * (x[t] . w_up[e, :, i])`` for
   assignment a = t * k + s of token t to expert e = ids[t, s]; grid (assignment,
   block of ``inner``, contraction split), each program looping over ``hidden_size``
   or, for a grid too small to fill the GPU (``contraction_splits``), over a part of it,
   writing float32 partial sums that XLA adds before the activation.
2. ``per_assignment[a, d] = hidden[a] . w_down[e, :, d]``; grid (assignment, block of
   ``hidden_size``), each program looping over ``inner``.

and the gate weights combine the k assignments of a token in XLA (``sum_s weights[t,
s] * per_assignment[t * k + s]``, a [T, k, hidden] fusion). The products are
multiply-and-sum over register tiles, not MMAs: one token per weight is a
matrix-vector product, bound by the weight read, and a tensor-core tile would be
padded from 1 to 16 rows. Accumulation in float32; ``hidden`` is rounded between the
launches to the dtype of the jnp path's products (bf16 for a bf16 model).

Backend: Pallas' Triton lowering (loads at traced offsets of whole arrays, as the
Triton decode kernels), interpret mode on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_tr

# Output columns a program computes (a power of two dividing the dimension, at most this)
# and the contraction run it loads a step: [RUN, COLUMNS] weight tiles, 32 values a thread
# of 4 warps per tile.
COLUMNS = 64
RUN = 64
NUM_WARPS = 4
# Loads in flight per program (Triton's software pipelining of the contraction loop): one
# program a column block reads a whole [hidden, 64] slab, so latency, not bandwidth, would
# bound it with one load at a time.
NUM_STAGES = 4
# The setting (COLUMNS, RUN, NUM_WARPS, NUM_STAGES) for calls of at most FEW_ASSIGNMENTS
# assignments (T x k: a decode step of one or two tokens). There the grid has 132-256
# programs, and a program's latency-bound walk along the contraction sets the time: longer
# runs and 8 warps keep more bytes in flight. One call at V2-Lite shapes on an H100: T = 1 0.076
# vs 0.112 ms; from 24 assignments up the setting above is as fast or faster (T = 8: 0.263 vs
# 0.279) (scripts/tune_grouped_experts.py).
FEW_ASSIGNMENTS = 16
FEW_SETTING = (64, 128, 8, 3)
# Launch 1 splits its contraction (``contraction_splits``) while its grid has fewer programs than
# SPLIT_PROGRAMS: each split writes float32 partial gate and up sums, and XLA adds them and
# applies the activation. At one token (6 assignments x 22 column blocks at V2-Lite shapes: one
# program an SM) each program walks a 2048-long contraction; split, four programs share it.
# V2-Lite T = 1 on an H100: 0.062 ms vs 0.075 unsplit; 2048 no faster than 1024
# (scripts/tune_grouped_experts.py --split-programs 0 512 1024 2048).
SPLIT_PROGRAMS = 1024
MAX_SPLITS = 8


def grouped_experts_reference(flat: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array,
                              w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """The routed experts in jnp, gathering the chosen experts' weights per assignment.

    flat [T, hidden] (bf16/f32), weights [T, k] f32 gate weights, ids [T, k] int32 expert
    ids, w_gate / w_up [E, hidden, inner], w_down [E, inner, hidden] -> [T, hidden] in
    flat's dtype.
    """
    k = ids.shape[1]
    expert_of = ids.reshape(-1)                                            # [A]
    rows = jnp.repeat(flat, k, axis=0)                                     # [A, hidden]
    hidden = (jax.nn.silu(jnp.einsum("ah,ahi->ai", rows, w_gate[expert_of]))
              * jnp.einsum("ah,ahi->ai", rows, w_up[expert_of]))
    out = jnp.einsum("ai,aid->ad", hidden, w_down[expert_of])              # [A, hidden]
    return combine_assignments(out, weights).astype(flat.dtype)


def combine_assignments(per_assignment: jax.Array, weights: jax.Array) -> jax.Array:
    """[T*k, hidden] assignment outputs (a = t * k + s) and gate weights [T, k] -> float32
    [T, hidden], each token's assignments weighted and summed."""
    num_tokens, k = weights.shape
    per_token = per_assignment.reshape(num_tokens, k, -1).astype(jnp.float32)
    return jnp.einsum("tkd,tk->td", per_token, weights)


def block(dim: int, cap: int) -> int:
    """The largest power of two dividing ``dim``, at most ``cap``."""
    return min(dim & -dim, cap)


def _gate_up_kernel(ids_ref, x_ref, w_gate_ref, w_up_ref, *out_refs, k: int, run: int, columns: int, splits: int):
    """Program (a, j, s): hidden[a, j*columns : (j+1)*columns] (module docstring, launch 1), or
    with ``splits`` > 1 its gate and up sums over split s of the contraction.

    ids_ref [A] int32, x_ref [T, hidden], w_gate_ref / w_up_ref [E, hidden, inner] (whole);
    out_refs: hidden_ref [A, inner], or gate_ref and up_ref f32 [splits, A, inner] (whole).
    """
    a, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    expert = plgpu_tr.load(ids_ref.at[a])
    token = a // k
    cols = pl.ds(j * columns, columns)
    runs = x_ref.shape[1] // run // splits

    def step(i, carry):
        gate, up = carry
        rows = pl.ds((split * runs + i) * run, run)
        x = plgpu_tr.load(x_ref.at[token, rows]).astype(jnp.float32)[:, None]
        gate = gate + jnp.sum(x * plgpu_tr.load(w_gate_ref.at[expert, rows, cols]).astype(jnp.float32), axis=0)
        up = up + jnp.sum(x * plgpu_tr.load(w_up_ref.at[expert, rows, cols]).astype(jnp.float32), axis=0)
        return gate, up

    zeros = jnp.zeros((columns,), jnp.float32)
    gate, up = jax.lax.fori_loop(0, runs, step, (zeros, zeros))
    if splits == 1:
        hidden_ref, = out_refs
        plgpu_tr.store(hidden_ref.at[a, cols], (jax.nn.silu(gate) * up).astype(hidden_ref.dtype))
    else:
        gate_ref, up_ref = out_refs
        plgpu_tr.store(gate_ref.at[split, a, cols], gate)
        plgpu_tr.store(up_ref.at[split, a, cols], up)


def contraction_splits(programs: int, runs: int) -> int:
    """Splits of launch 1's contraction: the largest power of two dividing its ``runs`` (run-long
    loads a program) that keeps ``programs`` x splits within ``SPLIT_PROGRAMS``, at most
    ``MAX_SPLITS``; 1 when the grid is that large already."""
    splits = 1
    while (2 * splits <= MAX_SPLITS and programs * 2 * splits <= SPLIT_PROGRAMS and runs % (2 * splits) == 0):
        splits *= 2
    return splits


def _down_kernel(ids_ref, hidden_ref, w_down_ref, out_ref, *, run: int, columns: int):
    """Program (a, j): per_assignment[a, j*columns : (j+1)*columns] (launch 2), float32.

    ids_ref [A] int32, hidden_ref [A, inner], w_down_ref [E, inner, hidden] (whole);
    out_ref [A, hidden] f32 (whole).
    """
    a, j = pl.program_id(0), pl.program_id(1)
    expert = plgpu_tr.load(ids_ref.at[a])
    cols = pl.ds(j * columns, columns)

    def step(i, acc):
        rows = pl.ds(i * run, run)
        h = plgpu_tr.load(hidden_ref.at[a, rows]).astype(jnp.float32)[:, None]
        return acc + jnp.sum(h * plgpu_tr.load(w_down_ref.at[expert, rows, cols]).astype(jnp.float32), axis=0)

    acc = jax.lax.fori_loop(0, hidden_ref.shape[1] // run, step, jnp.zeros((columns,), jnp.float32))
    plgpu_tr.store(out_ref.at[a, cols], acc)


def launch_setting(assignments: int) -> tuple[int, int, int, int]:
    """(columns, run, num_warps, num_stages) for a call of ``assignments`` (T x k) assignments:
    ``FEW_SETTING`` up to ``FEW_ASSIGNMENTS``, the module's COLUMNS, RUN, NUM_WARPS, NUM_STAGES above."""
    if assignments <= FEW_ASSIGNMENTS:
        return FEW_SETTING
    return COLUMNS, RUN, NUM_WARPS, NUM_STAGES


def _check(flat, weights, ids, w_gate, w_up, w_down) -> None:
    num_tokens, hidden = flat.shape
    num_experts, _, inner = w_gate.shape
    if weights.ndim != 2 or weights.shape[0] != num_tokens or ids.shape != weights.shape:
        raise ValueError(f"weights / ids: expected two [{num_tokens}, k] arrays, got {list(weights.shape)} and "
                         f"{list(ids.shape)}")
    if ids.dtype != jnp.int32:
        raise ValueError(f"ids: expected int32, got {ids.dtype}")
    if w_up.shape != w_gate.shape or w_down.shape != (num_experts, inner, hidden) or w_gate.shape[1] != hidden:
        raise ValueError(f"w_gate / w_up / w_down: expected [E, {hidden}, I], [E, {hidden}, I], [E, I, {hidden}], "
                         f"got {list(w_gate.shape)}, {list(w_up.shape)}, {list(w_down.shape)}")


@functools.partial(jax.jit, static_argnames=("interpret",))
def grouped_experts(flat: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                    w_down: jax.Array, *, interpret: bool = False) -> jax.Array:
    """``grouped_experts_reference``'s arguments and result, in two Pallas launches that read
    each chosen expert's matrices where they lie (module docstring).

    Ids outside [0, E) are clipped into it (a traced id cannot be checked; the router only
    makes ids in range), so no read leaves the weights.
    """
    _check(flat, weights, ids, w_gate, w_up, w_down)
    num_tokens, hidden = flat.shape
    num_experts, _, inner = w_gate.shape
    k = ids.shape[1]
    assignments = num_tokens * k
    expert_of = jnp.clip(ids.reshape(-1), 0, num_experts - 1)
    columns, run, num_warps, num_stages = launch_setting(assignments)
    params = plgpu_tr.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    inner_cols, hidden_run = block(inner, columns), block(hidden, run)
    # hidden in the dtype of the jnp path's products (bf16 for a bf16 model)
    hidden_dtype = jnp.result_type(flat.dtype, w_gate.dtype)
    splits = contraction_splits(assignments * (inner // inner_cols), hidden // hidden_run)
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((assignments, inner), hidden_dtype)
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, assignments, inner), jnp.float32)] * 2
    gate_up = pl.pallas_call(
        functools.partial(_gate_up_kernel, k=k, run=hidden_run, columns=inner_cols, splits=splits),
        grid=(assignments, inner // inner_cols, splits),
        in_specs=[whole] * 4,
        out_specs=whole if splits == 1 else [whole] * 2,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=params,
        name="snapmla_experts_gate_up",
    )(expert_of, flat, w_gate, w_up)
    if splits == 1:
        hidden_acts = gate_up
    else:
        gate, up = (part.sum(axis=0) for part in gate_up)
        hidden_acts = (jax.nn.silu(gate) * up).astype(hidden_dtype)
    hidden_cols, inner_run = block(hidden, columns), block(inner, run)
    per_assignment = pl.pallas_call(
        functools.partial(_down_kernel, run=inner_run, columns=hidden_cols),
        grid=(assignments, hidden // hidden_cols),
        in_specs=[whole] * 3,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((assignments, hidden), jnp.float32),
        interpret=interpret,
        compiler_params=params,
        name="snapmla_experts_down",
    )(expert_of, hidden_acts, w_down)
    return combine_assignments(per_assignment, weights).astype(flat.dtype)

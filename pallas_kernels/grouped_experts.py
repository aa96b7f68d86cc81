"""The routed experts of a few tokens, each expert's matrices read by id where they lie, and the jnp reference.

For a decode step of T tokens (T x k expert assignments, k experts a token), the MoE's routed
experts are k vector-matrix products a token per weight. The jnp "gathered" dispatch
(``models.moe``) indexes the stacked expert weights with the chosen ids, which XLA runs as a copy
of T*k experts' matrices and then products over the copy: each chosen byte read twice and written
once. Here two launches of the BF16 grouped GEMM (``grouped_gemm_mgpu``, Mosaic GPU) read every
chosen matrix in place, once an assignment:

1. gate and up in one launch, one group an assignment, each group multiplying all T tokens (padded
   to 16, the GEMM's fewest) by its expert's two matrices; the assignment's own token's row is
   kept, and ``hidden = silu(gate) * up`` is computed in XLA, rounded to the dtype of the jnp
   path's products (bf16);
2. down, one group an assignment, each multiplying its own hidden row.

The gate weights combine the k assignments of a token in XLA (``combine_assignments``). Accumulation
in float32.

For more tokens (``sorted_experts``, the MoE's sorted dispatch) one group an assignment would read
each matrix about T*k/E times. There the assignments are sorted by expert and cut into chunks of
at most ``chunk_rows`` tokens of one expert, one group a chunk: each chosen matrix is read once a
chunk, and each token row is multiplied only by the experts it was routed to (the dense dispatch
multiplies every token by every expert). The chunk count depends on the routing, so the launches
are sized for the most chunks T*k assignments can make (``num_chunks``) and the GEMMs skip the
chunks a call leaves empty (a negative matrix id) without reading their weights.

The GEMM takes bf16 stacks whose contraction is a multiple of 128 and whose output a multiple of 64
(``takes``, ``sorted_takes``: every DeepSeek expert shape); the model runs the jnp reference
elsewhere.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import LARGE_TILE, MAX_TOKENS, pad_tokens
from snapmla_jax.pallas_kernels.grouped_gemm_mgpu import grouped_gemm_mgpu, kernel_takes


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
    # A product and a sum, not an einsum: XLA fuses them with the gather that makes
    # per_assignment, where a dot reads it back from memory in float32.
    return jnp.sum(per_token * weights[:, :, None], axis=1)


def takes(num_tokens: int, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> bool:
    """Whether ``grouped_experts`` runs ``num_tokens`` tokens over these stacks ([E, hidden,
    inner], [E, hidden, inner], [E, inner, hidden]): bf16 weights, hidden and inner multiples of
    128 (each is one launch's contraction and the other's output), at most
    ``fp8_gemm_mgpu.MAX_TOKENS`` tokens."""
    hidden, inner = w_gate.shape[1:]
    return (w_gate.dtype == w_up.dtype == w_down.dtype == jnp.bfloat16 and 0 < num_tokens <= MAX_TOKENS
            and kernel_takes(pad_tokens(num_tokens), inner, hidden) and kernel_takes(pad_tokens(1), hidden, inner))


def sorted_takes(chunk: int, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> bool:
    """Whether ``sorted_experts`` runs chunks of ``chunk`` tokens over these stacks: bf16 weights,
    hidden and inner multiples of 128, ``chunk`` as ``pad_tokens`` leaves it (``chunk_rows``)."""
    hidden, inner = w_gate.shape[1:]
    return (w_gate.dtype == w_up.dtype == w_down.dtype == jnp.bfloat16 and 0 < chunk == pad_tokens(chunk)
            and kernel_takes(chunk, inner, hidden) and kernel_takes(chunk, hidden, inner))


# How much larger a chunk is than the assignments an expert gets on average (T * k / E with
# balanced routing): a chunk of exactly the mean would leave about half the experts a second,
# nearly empty chunk that reads the expert's matrices again.
CHUNK_HEADROOM = 1.5


def chunk_rows(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Tokens a chunk of the sorted dispatch for T = ``num_tokens`` tokens routed to ``top_k`` of
    ``num_experts`` experts (all of them, on every device): CHUNK_HEADROOM x the mean assignments
    an expert, padded as the GEMMs take tokens (``pad_tokens``: 16, 32, 48, 64 or 128), at most
    one 128-token tile."""
    mean = num_tokens * top_k / num_experts
    return pad_tokens(min(LARGE_TILE, max(1, math.ceil(CHUNK_HEADROOM * mean))))


def num_chunks(num_tokens: int, top_k: int, num_experts: int, chunk: int) -> int:
    """The most chunks of ``chunk`` rows that T = ``num_tokens`` tokens of ``top_k`` assignments
    can make over ``num_experts`` experts: each expert's ceil(count / chunk) summed is at most
    T*k // chunk plus one per expert that has any, and an expert gets at most T assignments (a
    token's k experts are distinct)."""
    assignments = num_tokens * top_k
    return min(assignments // chunk + min(num_experts, assignments), num_experts * -(-num_tokens // chunk))


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


@functools.partial(jax.jit, static_argnames=("num_sms", "interpret"))
def grouped_experts(flat: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                    w_down: jax.Array, *, num_sms: int = 132, interpret: bool = False) -> jax.Array:
    """``grouped_experts_reference``'s arguments and result, in two grouped-GEMM launches that read
    each chosen expert's matrices where they lie (module docstring); ValueError where the GEMM does
    not take the stacks (``takes``).

    Ids outside [0, E) are clipped into it (a traced id cannot be checked; the router only makes
    ids in range), so no read leaves the weights.
    """
    _check(flat, weights, ids, w_gate, w_up, w_down)
    if not takes(flat.shape[0], w_gate, w_up, w_down):
        raise ValueError(f"w_gate / w_up / w_down: the grouped GEMM takes bf16 stacks with hidden and inner "
                         f"multiples of 128 and at most {MAX_TOKENS} tokens, got {w_gate.dtype} "
                         f"{list(w_gate.shape)} and {flat.shape[0]} tokens")
    # The GEMM takes whole 16-token tiles: x's and hidden's rows are padded with zeros.
    padded = lambda x: jnp.pad(x, ((0, 0), (0, pad_tokens(x.shape[1]) - x.shape[1]), (0, 0)))
    out = gathered_products(
        flat, weights, ids,
        lambda x, chosen: grouped_gemm_mgpu(padded(x), (w_gate, w_up), chosen, num_sms=num_sms, interpret=interpret),
        lambda hidden, chosen: grouped_gemm_mgpu(padded(hidden), w_down, chosen, num_sms=num_sms, interpret=interpret),
        num_experts=w_gate.shape[0], hidden_dtype=jnp.result_type(flat.dtype, w_gate.dtype))
    return out.astype(flat.dtype)


def swiglu_rows(products, rows) -> jax.Array:
    """silu(gate) * up at index ``rows`` of a ``gate_up`` result: (gate, up), or silu(gate) * up
    itself (a gated product)."""
    if isinstance(products, tuple):
        gate, up = products
        return jax.nn.silu(gate[rows]) * up[rows]
    return products[rows]


def gathered_products(flat: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: Callable, down: Callable, *,
                      num_experts: int, hidden_dtype=None) -> jax.Array:
    """The gathered dispatch over two grouped products, one group an assignment (a = t * k + s):
    ``gate_up(x [1, T, hidden], chosen [T*k])`` -> (gate, up), each [T*k, >= T, inner] float32
    (matrix chosen[a] of each stack times every token), or silu(gate) * up (``swiglu_rows``),
    then ``down(hidden [T*k, 1, inner], chosen)`` -> [T*k, >= 1, hidden] float32 or 16-bit (each
    assignment's own row, weighted and summed in float32). flat [T, hidden],
    weights [T, k] f32, ids [T, k] int32, clipped into [0, ``num_experts``) (a traced id cannot be
    checked), so no product reads past its stack. ``hidden_dtype``: what silu(gate) * up is
    rounded to between the products (None: float32). -> float32 [T, hidden]
    (``combine_assignments``)."""
    chosen = jnp.clip(ids.reshape(-1), 0, num_experts - 1)
    assignments = jnp.arange(chosen.shape[0])
    rows = (assignments, assignments // ids.shape[1])  # each assignment's own token
    hidden = swiglu_rows(gate_up(flat[None], chosen), rows)                          # [T*k, inner]
    if hidden_dtype is not None:
        hidden = hidden.astype(hidden_dtype)
    return combine_assignments(down(hidden[:, None, :], chosen)[:, 0], weights)


def gather_rows(rows: jax.Array, index: jax.Array) -> jax.Array:
    """rows [N, ...] -> [*index.shape, ...]: row ``index[i]`` of ``rows``, zeros where it is N or
    beyond (N marks an empty row). Rows of 8- or 16-bit values whose bytes make whole 32-bit words
    move as uint32 words: XLA's gather runs a thread an element, so a row of 2,048 e4m3 values
    takes a quarter of the elements as 512 words. The same bits either way."""
    width = math.prod(rows.shape[1:])
    pack = 4 // rows.dtype.itemsize if rows.dtype.itemsize < 4 else 1
    if pack == 1 or width % pack:
        return rows.at[index].get(mode="fill", fill_value=0)
    words = jax.lax.bitcast_convert_type(rows.reshape(rows.shape[0], width // pack, pack), jnp.uint32)
    taken = words.at[index].get(mode="fill", fill_value=0)                        # [*index.shape, W]
    return jax.lax.bitcast_convert_type(taken, rows.dtype).reshape(*index.shape, *rows.shape[1:])


# Comparisons up to which the sorted dispatch counts pairwise (one fusion of that many elements)
# rather than by a running sum or a scatter: ``expert_ranks`` compares every pair of assignments
# (up to 2,048 assignments), the slots' tokens every slot with every assignment.
PAIRWISE_MAX_PAIRS = 2048 * 2048


def expert_ranks(expert: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """expert int32 [T, k] (num_experts: the assignment takes no row) -> (ranks int32 [T, k],
    counts int32 [num_experts]): each assignment's rank among its expert's assignments in the
    order a = t * k + s, which a stable sort by expert would give, and each expert's assignments.
    Counted, not sorted (at V2-Lite's 768 assignments, 128 tokens, XLA's sort was a 7.6 us launch;
    H100, docs/models.md). Up to PAIRWISE_MAX_PAIRS pairs each assignment counts the earlier
    assignments of its expert directly (one reduction); above, from a running sum over the tokens
    of each expert's count a token ([T, E + 1]; its last row the counts), plus those of the token's
    earlier slots: XLA's running sum is a reduce_window whose every output sums its whole window."""
    k = expert.shape[1]
    if expert.size ** 2 <= PAIRWISE_MAX_PAIRS:
        flat = expert.reshape(-1)
        order = jnp.arange(flat.shape[0])
        earlier = (flat[None, :] == flat[:, None]) & (order[None, :] < order[:, None])   # [A, A]
        counts = jnp.sum(flat[:, None] == jnp.arange(num_experts), axis=0, dtype=jnp.int32)
        return jnp.sum(earlier, axis=1, dtype=jnp.int32).reshape(expert.shape), counts
    one_hot = (expert[:, :, None] == jnp.arange(num_experts + 1)).astype(jnp.int32)   # [T, k, E + 1]
    per_token = jnp.sum(one_hot, axis=1)                                                 # [T, E + 1]
    running = jnp.cumsum(per_token, axis=0)
    # A token's experts are distinct as the router makes them; equal ones (clipped ids) are ranked by slot.
    earlier_slots = jnp.sum((expert[:, None, :] == expert[:, :, None]) & (jnp.arange(k) < jnp.arange(k)[:, None]),
                            axis=-1)
    ranks = jnp.take_along_axis(running - per_token, expert, axis=1) + earlier_slots
    return ranks, running[-1, :num_experts]


def sorted_products(flat, weights: jax.Array, ids: jax.Array, gate_up: Callable, down: Callable, *,
                    num_experts: int, chunk: int, hidden_dtype=None) -> jax.Array:
    """The sorted dispatch over two grouped products, one group a chunk of at most ``chunk``
    assignments of one expert (module docstring): ``gate_up(x [G, chunk, hidden], matrices [G])``
    -> (gate, up), each [G, >= chunk, inner] float32, or silu(gate) * up, then
    ``down(hidden [G, chunk, inner], matrices)`` -> [G, >= chunk, hidden] float32 or 16-bit;
    ``matrices[g]`` is chunk g's expert, or -1 for a chunk this call leaves empty (G =
    ``num_chunks``, the most there can be), whose rows are never read. flat [T, hidden], or T
    tokens already quantized: an object whose ``rows_at(index [G, chunk])`` gathers its rows into
    the chunks, index T an empty row of zeros (``fp8_weights.QuantizedTokens``); weights [T, k]
    f32, ids [T, k] int32, clipped into [0,
    ``num_experts``). An assignment of weight 0 takes no row: its product would be multiplied by
    0 (under expert parallelism, the assignments to another device's experts,
    ``MoE._local_assignments``). ``hidden_dtype``: what silu(gate) * up is rounded to between
    the products (None: float32). -> float32 [T, hidden] (``combine_assignments``)."""
    num_tokens, k = ids.shape
    groups = num_chunks(num_tokens, k, num_experts, chunk)
    num_slots = groups * chunk
    # Expert of each assignment (a = t * k + s); num_experts where it takes no row.
    expert = jnp.where(weights != 0, jnp.clip(ids, 0, num_experts - 1), num_experts)
    ranks, counts = expert_ranks(expert, num_experts)
    chunks = -(-counts // chunk)
    # The chunks of the experts before each (a masked sum: a cumsum is a reduce_window in XLA).
    experts = jnp.arange(num_experts)
    first_chunk = jnp.sum(jnp.where(experts[None, :] < experts[:, None], chunks[None, :], 0), axis=1)
    e = jnp.minimum(expert, num_experts - 1).reshape(-1)
    rank = ranks.reshape(-1)
    # Each assignment's row of the GEMMs (chunk * chunk rows + row in the chunk); num_slots: none.
    slot = jnp.where(expert.reshape(-1) < num_experts, (first_chunk[e] + rank // chunk) * chunk + rank % chunk,
                     num_slots)
    # Rows move by gathers only (XLA's scatters of [T*k, hidden] rows took 2-5 ms a decode step at
    # V2-Lite's capacity on 4 H200s, more than the GEMMs); the index arrays are scattered, or
    # counted pairwise like the ranks, which makes reductions, not a scatter and its buffer's fill.
    assignments = num_tokens * k
    token_of_assignment = jnp.arange(assignments, dtype=jnp.int32) // k
    if num_slots * assignments <= PAIRWISE_MAX_PAIRS:
        taken_by = slot[None, :] == jnp.arange(num_slots)[:, None]                    # [slots, A]
        token_of_slot = jnp.where(jnp.any(taken_by, axis=1),
                                  jnp.sum(jnp.where(taken_by, token_of_assignment, 0), axis=1), num_tokens)
    else:
        token_of_slot = jnp.full(num_slots, num_tokens, jnp.int32).at[slot].set(token_of_assignment, mode="drop")
    index = token_of_slot.reshape(groups, chunk)                                     # num_tokens: an empty row
    x = flat.rows_at(index) if hasattr(flat, "rows_at") else gather_rows(flat, index)
    # Chunk g's expert: the one whose chunks span g (every such chunk holds an assignment), else -1.
    group = jnp.arange(groups)[:, None]
    owner = (first_chunk[None, :] <= group) & (group < (first_chunk + chunks)[None, :])   # [G, E]
    matrices = jnp.where(jnp.any(owner, axis=1), jnp.sum(jnp.where(owner, experts, 0), axis=1), -1).astype(jnp.int32)
    hidden = swiglu_rows(gate_up(x, matrices), (slice(None), slice(0, chunk)))
    if hidden_dtype is not None:
        hidden = hidden.astype(hidden_dtype)
    out = down(hidden, matrices)[:, :chunk].reshape(num_slots, -1)     # [G * chunk, hidden]
    per_assignment = out.at[slot].get(mode="fill", fill_value=0)
    return combine_assignments(per_assignment, weights)


@functools.partial(jax.jit, static_argnames=("chunk", "num_sms", "interpret"))
def sorted_experts(flat: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array, *, chunk: int, num_sms: int = 132, interpret: bool = False) -> jax.Array:
    """``grouped_experts_reference``'s arguments and result (``num_experts`` the stacks' E), the
    assignments sorted by expert into chunks of ``chunk`` tokens (``chunk_rows``) and run as two
    grouped-GEMM launches, one group a chunk (module docstring); assignments of weight 0 are
    skipped. ValueError where the GEMM does not take the stacks (``sorted_takes``)."""
    _check(flat, weights, ids, w_gate, w_up, w_down)
    if not sorted_takes(chunk, w_gate, w_up, w_down):
        raise ValueError(f"w_gate / w_up / w_down: the grouped GEMM takes bf16 stacks with hidden and inner "
                         f"multiples of 128 and chunks as pad_tokens leaves them, got {w_gate.dtype} "
                         f"{list(w_gate.shape)} and chunk {chunk}")
    out = sorted_products(
        flat, weights, ids,
        lambda x, chosen: grouped_gemm_mgpu(x, (w_gate, w_up), chosen, num_sms=num_sms, interpret=interpret),
        lambda hidden, chosen: grouped_gemm_mgpu(hidden, w_down, chosen, num_sms=num_sms, interpret=interpret),
        num_experts=w_gate.shape[0], chunk=chunk, hidden_dtype=jnp.result_type(flat.dtype, w_gate.dtype))
    return out.astype(flat.dtype)

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
in float32. The GEMM takes bf16 stacks whose contraction is a multiple of 128 and whose output a
multiple of 64 (``takes``: every DeepSeek expert shape); the model runs the jnp reference elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import MAX_TOKENS, pad_tokens
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
    return jnp.einsum("tkd,tk->td", per_token, weights)


def takes(num_tokens: int, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> bool:
    """Whether ``grouped_experts`` runs ``num_tokens`` tokens over these stacks ([E, hidden,
    inner], [E, hidden, inner], [E, inner, hidden]): bf16 weights, hidden and inner multiples of
    128 (each is one launch's contraction and the other's output), at most
    ``fp8_gemm_mgpu.MAX_TOKENS`` tokens."""
    hidden, inner = w_gate.shape[1:]
    return (w_gate.dtype == w_up.dtype == w_down.dtype == jnp.bfloat16 and 0 < num_tokens <= MAX_TOKENS
            and kernel_takes(pad_tokens(num_tokens), inner, hidden) and kernel_takes(pad_tokens(1), hidden, inner))


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
    if not takes(num_tokens, w_gate, w_up, w_down):
        raise ValueError(f"w_gate / w_up / w_down: the grouped GEMM takes bf16 stacks with hidden and inner "
                         f"multiples of 128 and at most {MAX_TOKENS} tokens, got {w_gate.dtype} [E, {hidden}, "
                         f"{inner}] and {num_tokens} tokens")


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
    num_tokens, _ = flat.shape
    num_experts = w_gate.shape[0]
    k = ids.shape[1]
    chosen = jnp.clip(ids.reshape(-1), 0, num_experts - 1)
    assignments = jnp.arange(chosen.shape[0])
    padded = jnp.pad(flat, ((0, pad_tokens(num_tokens) - num_tokens), (0, 0)))[None]
    gate, up = grouped_gemm_mgpu(padded, (w_gate, w_up), chosen, num_sms=num_sms, interpret=interpret)
    rows = (assignments, assignments // k)  # each assignment's own token
    hidden_dtype = jnp.result_type(flat.dtype, w_gate.dtype)
    hidden = (jax.nn.silu(gate[rows]) * up[rows]).astype(hidden_dtype)[:, None, :]     # [T*k, 1, inner]
    hidden = jnp.pad(hidden, ((0, 0), (0, pad_tokens(1) - 1), (0, 0)))
    per_assignment = grouped_gemm_mgpu(hidden, w_down, chosen, num_sms=num_sms, interpret=interpret)[:, 0]
    return combine_assignments(per_assignment, weights).astype(flat.dtype)

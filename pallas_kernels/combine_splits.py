"""The merge of split-KV partials: its math in jnp (the references), its arguments' checks and
the partials' dtype. The kernels are in ``combine_splits_mgpu.py``.

A split-KV decode call (flash decoding) leaves, per batch row, split and query
row, a normalised partial output and its log-sum-exp:

  out [B, S, rows, R] f32 or bf16 (``partial_dtype``), lse [B, S, rows] f32 (natural log;
  -inf: the split saw nothing)

and the result is their average weighted by exp(lse):

  merged[b, r] = sum_s exp(lse[b, s, r] - M) out[b, s, r] / sum_s exp(lse[b, s, r] - M)
  lse[b, r]    = M + log(sum_s exp(lse[b, s, r] - M)),   M = max_s lse[b, s, r]

Two forms: every batch row in the same S splits (``combine_splits_reference``), and a
load-balanced split plan (pallas_kernels/split_plan.py): batch row b in a dynamic number of work
items, item_count[b], laid out flat from item_start[b] in out [W, ...], merged into the decode
call's own outputs, where rows of one item were written directly (``combine_items_reference``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def partial_dtype(out_dtype) -> jnp.dtype:
    """The dtype a split decode kernel's normalised partials take for a merged output of
    ``out_dtype``: bf16 for a bf16 output, else float32.

    A bf16 output keeps 8 significant bits, and so may its partials: the merge is a weighted
    average (weights summing to 1), so partials rounded to bf16 move the result by at most what
    the output's own rounding does (half an ulp, <= 2**-8 of the largest partial). At small
    batches the partials outweigh the cache: at B=1 x 16k x 128 heads (66 splits of ~250 tokens)
    float32 ones are 17 MB written and read back against 10.5 MB of FP8 cache. H100: the merge
    5-15% faster from bf16 (scripts/tune_combine_splits.py --partial-dtype bfloat16 vs float32).
    """
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(out_dtype) == jnp.bfloat16 else jnp.dtype(jnp.float32)


def combine_splits_reference(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge split partials in jnp: out [B, S, rows, R] f32 (or bf16), lse [B, S, rows] f32 ->
    (merged [B, rows, R] f32, lse [B, rows] f32). Rows no split saw get 0 and -inf."""
    out = out.astype(jnp.float32)
    lse_max = jnp.max(lse, axis=1, keepdims=True)
    lse_max = jnp.where(lse_max == -jnp.inf, 0.0, lse_max)
    weight = jnp.exp(lse - lse_max)  # 0 for empty splits
    total = jnp.sum(weight, axis=1)
    merged = jnp.einsum("bsr,bsrd->brd", weight, out) / jnp.where(total > 0, total, 1.0)[..., None]
    merged_lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + lse_max[:, 0], -jnp.inf)
    return merged, merged_lse


def lse_of_total(total, lse_max):
    """The merged log-sum-exp of a row from its weights' total and max (-inf: no split saw it)."""
    return jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + lse_max, -jnp.inf)


def check_splits_args(out: jax.Array, lse: jax.Array) -> tuple[int, int, int, int]:
    """Raise ValueError unless out [B, S, rows, R] f32 or bf16 and lse [B, S, rows] f32 agree
    (the arguments of ``combine_splits_mgpu``); return (B, S, rows, R)."""
    if out.ndim != 4 or lse.ndim != 3:
        raise ValueError(f"out, lse: expected 4 and 3 dimensions, got {out.shape} and {lse.shape}")
    batch, num_splits, num_rows, rank = out.shape
    if lse.shape != (batch, num_splits, num_rows):
        raise ValueError(f"lse: expected shape {(batch, num_splits, num_rows)} to match out {out.shape}, "
                         f"got {lse.shape}")
    if out.dtype not in (jnp.float32, jnp.bfloat16) or lse.dtype != jnp.float32:
        raise ValueError(f"out, lse: expected float32 or bfloat16 partials and a float32 lse, got {out.dtype} "
                         f"and {lse.dtype}")
    return batch, num_splits, num_rows, rank


def combine_items_reference(out: jax.Array, lse: jax.Array, item_start: jax.Array, item_count: jax.Array,
                            merged: jax.Array, merged_lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Merge each batch row's work items in jnp, the math of ``combine_items_mgpu``.

    out [W, rows, R] f32 or bf16 (finite), lse [W, rows] f32, item_start and item_count [B]
    int32 (row b's items out[item_start[b] : item_start[b] + item_count[b]]), merged [B, rows,
    R] and merged_lse [B, rows] f32 -> (merged, merged_lse): rows of two or more items replaced
    by their lse-weighted average (in merged's dtype), the others as given. Query rows no item
    saw get 0 and -inf. Holds a [B, W, rows] weight: for tests and small shapes.
    """
    item = jnp.arange(lse.shape[0], dtype=jnp.int32)
    member = (item[None, :] >= item_start[:, None]) & (item[None, :] < (item_start + item_count)[:, None])
    row_lse = jnp.where(member[:, :, None], lse[None], -jnp.inf)  # [B, W, rows]
    lse_max = jnp.max(row_lse, axis=1)
    lse_max = jnp.where(lse_max == -jnp.inf, 0.0, lse_max)
    weight = jnp.exp(row_lse - lse_max[:, None, :])  # 0 for other rows' items
    total = jnp.sum(weight, axis=1)
    # HIGHEST: a GPU's default float32 matmul may round to TF32 (10 bits), coarser than a bf16 output.
    weighted = jnp.einsum("bwr,wrd->brd", weight, out.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    combined = weighted / jnp.where(total > 0, total, 1.0)[..., None]
    several = (item_count >= 2)[:, None]
    return (jnp.where(several[..., None], combined.astype(merged.dtype), merged),
            jnp.where(several, lse_of_total(total, lse_max), merged_lse))


def check_items_args(out, lse, item_start, item_count, merged, merged_lse, chunk):
    """Raise ValueError unless ``combine_items_mgpu``' arguments agree; return (rows, R)."""
    if out.ndim != 3 or lse.ndim != 2:
        raise ValueError(f"out, lse: expected 3 and 2 dimensions ([W, rows, R], [W, rows]), got {out.shape} and "
                         f"{lse.shape}")
    num_rows, rank = out.shape[1:]
    if lse.shape != (out.shape[0], num_rows):
        raise ValueError(f"lse: expected shape {(out.shape[0], num_rows)} to match out {out.shape}, "
                         f"got {lse.shape}")
    if item_start.ndim != 1 or item_count.shape != item_start.shape:
        raise ValueError(f"item_start, item_count: expected two [B] arrays, got {item_start.shape} and "
                         f"{item_count.shape}")
    batch = item_start.shape[0]
    if merged.shape != (batch, num_rows, rank) or merged_lse.shape != (batch, num_rows):
        raise ValueError(f"merged, merged_lse: expected shapes {(batch, num_rows, rank)} and {(batch, num_rows)} "
                         f"for B={batch} and out {out.shape}, got {merged.shape} and {merged_lse.shape}")
    if out.dtype not in (jnp.float32, jnp.bfloat16) or lse.dtype != jnp.float32:
        raise ValueError(f"out, lse: expected float32 or bfloat16 partials and a float32 lse, got {out.dtype} and "
                         f"{lse.dtype}")
    if item_start.dtype != jnp.int32 or item_count.dtype != jnp.int32:
        raise ValueError(f"item_start, item_count: expected int32, got {item_start.dtype} and {item_count.dtype}")
    if merged.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16) or merged_lse.dtype != jnp.float32:
        raise ValueError(f"merged, merged_lse: expected a bfloat16, float32 or float16 output and a float32 lse, "
                         f"got {merged.dtype} and {merged_lse.dtype}")
    if not isinstance(chunk, int) or chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk: expected a power of two >= 1, got {chunk!r}")
    if rank & (rank - 1):
        raise ValueError(f"out: expected R a power of two (runs of values tile it), got {rank}")
    if out.size >= 2 ** 31:
        raise ValueError(f"out: expected fewer than 2**31 values (int32 offsets), got {out.size}")
    return num_rows, rank

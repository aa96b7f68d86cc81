"""Block-quantized FP8 weights (DeepSeek-V3's format) and the product with them.

A weight matrix W [out, in] is stored as ``float8_e4m3fn`` values with one float32 scale per
``block`` = (rows, cols) tile, 128 x 128 in DeepSeek's releases:

    W[o, i] ~= values[o, i] * scales[o // rows, i // cols]

A stack of matrices (the routed experts, [E, out, in]) has one such grid of scales per matrix
([E, ceil(out / rows), ceil(in / cols)]).

Edge tiles of a matrix whose sides are not multiples of the block are cropped (their scale
covers the rows and columns that exist). This is the checkpoint's own layout (``weight`` and
``weight_scale_inv``), kept as it is: [out, in] puts the contraction axis last (K-major), the
operand layout Hopper's FP8 matrix instructions require.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp

from snapmla_jax.backend import mosaic_kernels_run, resolve_backend, sm_count
from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import (BLOCK, FLOAT_DTYPES, MAX_TOKENS, fp8_gemm_mgpu,
                                                      fp8_grouped_gemm_mgpu, pad_tokens, scale_columns, swiglu)
from snapmla_jax.pallas_kernels.fp8_gemm_mgpu import kernel_takes as gemm_takes
from snapmla_jax.pallas_kernels.fp8_gemm_tiles_mgpu import TilesConfig, fp8_gemm_tiles_mgpu, fp8_grouped_gemm_tiles_mgpu
from snapmla_jax.pallas_kernels.fp8_gemm_tiles_mgpu import kernel_takes as tiles_takes
from snapmla_jax.pallas_kernels.grouped_experts import gather_rows
from snapmla_jax.pallas_kernels.quantize_activations_mgpu import padded_rows as quantizer_rows
from snapmla_jax.pallas_kernels.quantize_activations_mgpu import quantize_activations_mgpu
from snapmla_jax.quantization import FP8_E4M3_MAX, FP8_E4M3_MAX_RECIPROCAL

DEFAULT_BLOCK = (128, 128)  # DeepSeek-V3's weight_block_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockFP8Weight:
    """An FP8 weight with one scale per block; a pytree (``values`` and ``scales`` are its
    leaves, ``block`` static), so it passes through ``jax.jit``, nnx state and the loaders.

    values: float8_e4m3fn [..., out, in] (leading axes: a stack of matrices, e.g. experts).
    scales: float32 [..., ceil(out / block[0]), ceil(in / block[1])]; dequantized = values * scale.
    block:  (rows, cols) of a scale's tile.
    """

    values: jax.Array
    scales: jax.Array
    block: tuple[int, int] = dataclasses.field(default=DEFAULT_BLOCK, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """(..., out, in) of the matrix or stack."""
        return tuple(self.values.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of values and scales together."""
        return self.values.nbytes + self.scales.nbytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTokens:
    """Token rows quantized once for the FP8 GEMMs (``quantize_tokens``), to be moved as rows (a
    MoE's sorted dispatch gathers them into its chunks, ``rows_at``) and passed as the x of
    ``fp8_grouped_matmul``, as often as products of the same rows need them (a MoE's routed and
    shared experts); a pytree.

    values: float8_e4m3fn [..., M, K]
    scales: float32 [..., K / 128, M], the layout the FP8 GEMMs read (no transpose between the
            quantizer and them); row m's block j ~= values[..., m, 128 j:] * scales[..., j, m]
            (0: zeros)
    dtype:  the rows' own dtype (static): a product asked for "in x's dtype" comes in it
    """

    values: jax.Array
    scales: jax.Array
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """(..., M, K) of the rows."""
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return self.values.ndim

    def dequantized(self) -> jax.Array:
        """The rows as [..., M, K] in ``dtype``: values * scale in float32, one rounding (the rows
        as a weight of 1 x 128 blocks, ``dequantize_weight``)."""
        blocks = BlockFP8Weight(self.values, jnp.swapaxes(self.scales, -1, -2), (1, BLOCK))
        return dequantize_weight(blocks, self.dtype)

    def rows_at(self, index: jax.Array) -> QuantizedTokens:
        """Rows [M, K] gathered into [*index.shape, K] (index int, M or beyond: a row of zeros),
        the scales straight into [*index.shape[:-1], K / 128, index.shape[-1]]: a chunked
        dispatch's [G, chunk] index gives the [G, K / 128, chunk] scales the grouped GEMMs read."""
        if self.values.ndim != 2:
            raise ValueError(f"rows_at: expected tokens [M, K], got {list(self.shape)}")
        blocks = jnp.arange(self.scales.shape[0]).reshape(1, -1, 1)
        scales = self.scales.at[blocks, index.reshape(-1, 1, index.shape[-1])].get(mode="fill", fill_value=0)
        return QuantizedTokens(gather_rows(self.values, index),
                               scales.reshape(*index.shape[:-1], *scales.shape[1:]), self.dtype)

    def expand_dims(self) -> QuantizedTokens:
        """The rows [M, K] as one group [1, M, K] (the x of ``fp8_grouped_matmul``)."""
        return QuantizedTokens(self.values[None], self.scales[None], self.dtype)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the scales of a [..., out, in] matrix or stack: (..., ceil(out / rows), ceil(in / cols))."""
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def _check_block(block) -> tuple[int, int]:
    if len(block) != 2 or min(block) <= 0:
        raise ValueError(f"block: expected two positive ints (rows, cols), got {block!r}")
    return int(block[0]), int(block[1])


def _expand(scales: jax.Array, shape: tuple[int, ...], block: tuple[int, int]) -> jax.Array:
    """scales [..., ceil(out/rows), ceil(in/cols)] -> one scale per element [..., out, in] (edges
    cropped). A broadcast, a reshape and a slice: XLA fuses them into the consumer."""
    *lead, out_blocks, in_blocks = scales.shape
    rows, cols = block
    tiled = jnp.broadcast_to(scales[..., :, None, :, None], (*lead, out_blocks, rows, in_blocks, cols))
    return tiled.reshape(*lead, out_blocks * rows, in_blocks * cols)[..., :shape[-2], :shape[-1]]


def quantize_blocks(w: jax.Array, block: tuple[int, int] = DEFAULT_BLOCK) -> BlockFP8Weight:
    """A float matrix w [out, in], or a stack of them [..., out, in] (bf16 / f16 / f32) -> its
    ``BlockFP8Weight``.

    Each block's scale is amax * float32(1 / 448) (``fp8.scale_of_amax``'s product), so the
    block's largest element lands on e4m3's largest finite value; the values are ``w / scale``
    cast to e4m3 with saturation (never inf or NaN). A block of zeros gets scale 0 and values 0.
    ValueError for a w that is not at least 2-D or not floating, or a bad ``block``.
    """
    block = _check_block(block)
    if w.ndim < 2 or not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"w: expected a float matrix [..., out, in], got {w.dtype} {list(w.shape)}")
    *lead, out_dim, in_dim = w.shape
    blocks = scale_shape(w.shape, block)[-2:]
    w32 = jnp.asarray(w, jnp.float32)
    pad = [(0, 0)] * len(lead) + [(0, blocks[0] * block[0] - out_dim), (0, blocks[1] * block[1] - in_dim)]
    padded = jnp.pad(w32, pad)
    amax = jnp.max(jnp.abs(padded.reshape(*lead, blocks[0], block[0], blocks[1], block[1])), axis=(-3, -1))
    scales = amax * FP8_E4M3_MAX_RECIPROCAL
    safe = _expand(jnp.where(scales > 0, scales, 1.0), w.shape, block)
    values = jnp.clip(w32 / safe, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)
    return BlockFP8Weight(values, scales, block)


def quantize_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., M, K] -> (x8 [..., M, K] e4m3, x_scales [..., K / 128, M] float32): DeepSeek's
    activation quantization, one scale per row and 128 channels (``quantize_blocks`` with 1 x 128
    blocks), the scales' last two axes swapped as ``fp8_gemm_mgpu`` reads them."""
    q = quantize_blocks(x, (1, BLOCK))
    return q.values, jnp.swapaxes(q.scales, -1, -2)


def dequantize_weight(w: BlockFP8Weight, dtype=jnp.float32) -> jax.Array:
    """``w`` as a dense [..., out, in] array in ``dtype``: values * scale computed in float32, then
    one rounding to ``dtype`` (the same numbers as the loader's numpy dequantization)."""
    scaled = w.values.astype(jnp.float32) * _expand(w.scales, w.shape, w.block)
    return scaled.astype(dtype)


# Most rows of x ``fp8_matmul`` and ``fp8_grouped_matmul`` give the FP8 GEMM kernel of few tokens
# where the tiled kernel does not run (``tiles_run``; summed groups): decode steps. Up to 64 rows
# it runs 1.4-1.8x the bf16 GEMM at large shapes; above, 0.6-1.4x, and still 2-3x XLA's
# dequantized path (H200, 128 and 256 rows; docs/benchmarks/fp8_gemm_h200.md). 512: the MoE's
# dense dispatch's top (``models.moe.DENSE_TOKEN_RANGE``).
KERNEL_MAX_TOKENS = 512
# The tiled kernel's shape (``fp8_gemm_tiles_mgpu``): two consumer warpgroups of 64 tokens, one
# 128-channel block a step, four in flight: side by side on an H200, three consumers, two blocks a
# step and five in flight were as fast or slower (docs/benchmarks/fp8_gemm_tiles_h200.md).
TILES_CONFIG = TilesConfig()


# Rows of x up to which the FP8 GEMM of few tokens quantizes them in its own pipeline
# (``fp8_gemm_mgpu.quantize_tile``: x read as bf16 by each CTA, no launches before the GEMM's) instead
# of behind XLA launches of their own (the amax reduction, the cast, the scales' transpose). One
# row: a one-token V2-Lite decode step ran 3.74-3.83 ms with it against 4.10-4.27 without (bf16
# weights 3.66-3.83 in the same runs); at 4, 8, 16 and 64 rows the step ran 1.2-3.4x slower with
# it (H200): every CTA of a launch (one a weight tile, group and split) quantizes the same tokens
# again, work that grows with the tokens, where XLA quantizes them once (an H100's MoE layer: 0.306
# vs 0.264 ms at 16 tokens, 1.287 vs 0.347 at 64; docs/models.md, "Where the activations are
# quantized"). 0: XLA quantizes every product.
KERNEL_QUANTIZES_MAX_ROWS = 1


# Rows of x up to which ``fp8_matmul`` multiplies with XLA, the weight dequantized inside the
# product, instead of launching an FP8 GEMM, where the weight is whole 128 x 128 blocks: one row
# against a matrix is a matrix-vector product, which XLA's compiler runs as one fusion reading the
# e4m3 bytes and their scales where they lie (no activation quantization, no partial sums: one
# launch where the kernel path takes two or three). H100, 1 token, ``scripts/bench_fp8_gemm.py``:
# 2.9 / 3.8 / 2.9 us at 576 x 2048, 3072 x 2048, 2048 x 2048 against the FP8 GEMM's 5.9 / 6.7 /
# 5.9 and bf16's 1.8 / 4.8 / 3.4; 4.1 / 5.4 at 2048 x 2816, 2816 x 2048 against bf16's 4.5 / 4.8
# (the FP8 GEMM 13.4 / 15.8 at two rows). A weight whose sides are not whole blocks (V2-Lite's
# dense MLP, 10944 wide) has its scales cropped, and XLA then materializes the dequantized weight:
# 54.7 us at 10944 x 2048 against the FP8 GEMM's 15.3 at two rows, so those keep the kernel.
XLA_MAX_ROWS = 1


# Whether the FP8 GEMMs' activations are quantized by one Mosaic GPU launch
# (``quantize_activations_mgpu``) where the kernels run, instead of XLA's three (the blocks' amax,
# the cast, the scales' transpose). Off: XLA's (``mosaic_quantization``, for benchmarks).
MOSAIC_QUANTIZES = True


@contextlib.contextmanager
def _module_setting(name: str, value):
    """This module's global ``name`` set to ``value`` within the block, restored after it."""
    saved, globals()[name] = globals()[name], value
    try:
        yield
    finally:
        globals()[name] = saved


def xla_rows(max_rows: int):
    """Within the block, programs traced set XLA_MAX_ROWS to ``max_rows`` (benchmarks comparing
    the two paths of a one-row product)."""
    return _module_setting("XLA_MAX_ROWS", max_rows)


def mosaic_quantization(enabled: bool):
    """Within the block, programs traced set MOSAIC_QUANTIZES to ``enabled`` (benchmarks comparing
    the Mosaic GPU quantizer with XLA's)."""
    return _module_setting("MOSAIC_QUANTIZES", enabled)


def kernel_quantization(max_rows: int):
    """Within the block, programs traced set KERNEL_QUANTIZES_MAX_ROWS to ``max_rows`` (benchmarks
    comparing where x is quantized; a program traced before keeps what it was traced with)."""
    return _module_setting("KERNEL_QUANTIZES_MAX_ROWS", max_rows)


def kernel_runs(w: BlockFP8Weight, rows: int, backend: str) -> bool:
    """Whether a product of ``rows`` rows with the block-FP8 weight (stack) ``w`` runs the FP8 GEMM
    kernel: ``backend`` (resolved) "interpret", or "pallas" on a Hopper GPU; 128 x 128 blocks;
    at most KERNEL_MAX_TOKENS rows; shapes of whole tiles (``fp8_gemm_mgpu.kernel_takes``)."""
    return (w.block == (BLOCK, BLOCK) and 0 < rows <= KERNEL_MAX_TOKENS
            and gemm_takes(pad_tokens(rows), *w.shape[-2:])
            and mosaic_kernels_run(backend))


def tiles_run(w: BlockFP8Weight, rows: int, backend: str) -> bool:
    """Whether a product of ``rows`` rows with the block-FP8 matrix (or stack) ``w`` runs on the
    tiled FP8 GEMM (``fp8_gemm_tiles_mgpu``): more than 64 rows (fewer read the weight once in the
    kernel of few tokens), 128 x 128 blocks, out and in whole blocks; ``backend`` (resolved)
    "interpret", or "pallas" on a Hopper GPU."""
    return (w.block == (BLOCK, BLOCK) and rows > MAX_TOKENS
            and tiles_takes(_tile_rows(rows), *w.shape[-2:], TILES_CONFIG)
            and mosaic_kernels_run(backend))


def _tile_rows(rows: int) -> int:
    """``rows`` padded to whole token tiles of the tiled kernel."""
    return -(-rows // TILES_CONFIG.tile_tokens) * TILES_CONFIG.tile_tokens


def _quantized_rows(x, rows: int, backend: str, scale_rows: int | None = None) -> tuple[jax.Array, jax.Array]:
    """x [..., M, K] padded to ``rows`` rows and quantized per row and 128 channels:
    (x8 [..., rows, K] e4m3, scales [..., K / 128, scale_rows or rows] float32, the columns past M
    zeros). Where the kernels run (``backend`` resolved: "pallas" on a Hopper GPU, "interpret") and
    MOSAIC_QUANTIZES: one Mosaic GPU launch; else XLA's ``quantize_activations``. An x already
    quantized (``QuantizedTokens``) is only padded, its scales laid out so."""
    scale_rows = rows if scale_rows is None else scale_rows
    if isinstance(x, QuantizedTokens):
        pad = [(0, 0)] * (x.ndim - 2)
        return (jnp.pad(x.values, pad + [(0, rows - x.shape[-2]), (0, 0)]),
                jnp.pad(x.scales, pad + [(0, 0), (0, scale_rows - x.shape[-2])]))
    if MOSAIC_QUANTIZES and mosaic_kernels_run(backend) and x.ndim in (2, 3) and x.dtype in FLOAT_DTYPES:
        return quantize_activations_mgpu(x, rows, scale_rows, interpret=backend == "interpret")
    pad = [(0, 0)] * (x.ndim - 2) + [(0, rows - x.shape[-2]), (0, 0)]
    x8, scales = quantize_activations(jnp.pad(x, pad))
    return x8, jnp.pad(scales, [(0, 0)] * (x.ndim - 1) + [(0, scale_rows - rows)])


def kernel_quantizes(rows: int) -> bool:
    """Whether the FP8 GEMM of few tokens quantizes a product's ``rows`` rows of x itself
    (KERNEL_QUANTIZES_MAX_ROWS, as set where the program is traced)."""
    return rows <= KERNEL_QUANTIZES_MAX_ROWS


def _kernel_tokens(x: jax.Array, rows: int, backend: str) -> tuple[jax.Array, jax.Array | None]:
    """The FP8 GEMM of few tokens' (tokens, x_scales) for x [..., M, K]: x itself and None up to
    KERNEL_QUANTIZES_MAX_ROWS rows of a bf16, f16 or f32 x (the kernel quantizes it, its tiles'
    rows past M read as zeros: no pad), else x padded to ``rows`` and quantized (``_quantized_rows``;
    the scales as wide as the kernel's slots, ``fp8_gemm_mgpu.scale_columns``)."""
    if kernel_quantizes(x.shape[-2]) and x.dtype in FLOAT_DTYPES and not isinstance(x, QuantizedTokens):
        return x, None
    return _quantized_rows(x, rows, backend, scale_columns(rows, x.shape[-1]))


def quantize_tokens(x: jax.Array, *, backend: str = "auto") -> QuantizedTokens:
    """x [M, K] (bf16, f16 or f32, K a multiple of 128) quantized per row and 128 channels as the
    FP8 GEMMs quantize their x (``_quantized_rows``: the same bytes and scales, ``backend`` picking
    the quantizer), for rows gathered before the products (a MoE's sorted dispatch: each chunk's
    rows come quantized, instead of quantizing every chunk's, the empty ones' included)."""
    if x.ndim != 2 or x.shape[-1] % BLOCK or x.dtype not in FLOAT_DTYPES or not x.shape[0]:
        raise ValueError(f"x: expected [M, K] bfloat16, float16 or float32 with M > 0 and K a multiple of {BLOCK}, "
                         f"got {x.dtype} {list(x.shape)}")
    backend = resolve_backend(backend)
    rows = x.shape[0]
    x8, scales = _quantized_rows(x, quantizer_rows(rows), backend)
    return QuantizedTokens(x8[:rows], scales[:, :rows], x.dtype)


def fp8_matmul(x: jax.Array, w: BlockFP8Weight, *, backend: str = "auto") -> jax.Array:
    """x [..., in] @ W^T for a block-FP8 weight W [out, in] -> [..., out] in x's dtype.

    On a Hopper GPU (backend "pallas", or "auto" there; 128 x 128 weight blocks) this is DeepSeek's
    FP8 GEMM: x quantized to e4m3 per row and 128 channels (by one Mosaic GPU launch,
    ``quantize_activations_mgpu``, or by the kernel of few tokens itself up to
    KERNEL_QUANTIZES_MAX_ROWS rows), FP8 x FP8 products summed in float32
    per block and scaled there. Up to 64 rows of x (out a multiple of 64, in of 128) the kernel of
    few tokens (``pallas_kernels/fp8_gemm_mgpu.py``) reads the weight's e4m3 bytes once (1.6-1.8x
    the bf16 GEMM at large decode shapes, H100 and H200); above, where out and in are whole
    128-blocks (``tiles_run``), the tiled kernel (``pallas_kernels/fp8_gemm_tiles_mgpu.py``: 64 x 2
    tokens by 128 weight rows a CTA, any number of rows); else the kernel of few tokens up to
    KERNEL_MAX_TOKENS rows. "interpret" runs those kernels in Pallas' interpreter.

    Otherwise (other shapes, other devices, "xla") plain XLA: the weight dequantized inside the
    caller's jitted program (one float32 multiply by the tile's scale, one rounding to x's dtype)
    and fed to an ordinary dot accumulating in float32, x unquantized. XLA materializes the
    dequantized weight: 0.30-0.45x the bf16 GEMM at decode shapes, 0.62-1.10x at 4096 rows
    (docs/benchmarks/fp8_gemm_h100.md, fp8_gemm_h200.md).
    """
    if len(w.shape) != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x: expected [..., {w.shape[-1]}] for a weight matrix, got {list(x.shape)} against "
                         f"{list(w.shape)}")
    backend = resolve_backend(backend)
    rows = math.prod(x.shape[:-1])
    if rows <= XLA_MAX_ROWS and all(side % b == 0 for side, b in zip(w.shape, w.block)):
        backend = "xla"
    if tiles_run(w, rows, backend):
        x8, x_scales = _quantized_rows(x.reshape(rows, x.shape[-1]), _tile_rows(rows), backend)
        out_dtype = x.dtype if x.dtype in (jnp.bfloat16, jnp.float32) else jnp.float32
        y = fp8_gemm_tiles_mgpu(x8, x_scales, w.values, w.scales, out_dtype=out_dtype, config=TILES_CONFIG,
                                num_sms=sm_count(), interpret=backend == "interpret")
        return y[:rows].astype(x.dtype).reshape(*x.shape[:-1], w.shape[0])
    if kernel_runs(w, rows, backend):
        tokens, x_scales = _kernel_tokens(x.reshape(rows, x.shape[-1]), pad_tokens(rows), backend)
        y = fp8_gemm_mgpu(tokens, x_scales, w.values, w.scales, num_sms=sm_count(), interpret=backend == "interpret")
        return y[:rows].astype(x.dtype).reshape(*x.shape[:-1], w.shape[0])
    product = jnp.einsum("...i,oi->...o", x, dequantize_weight(w, x.dtype), preferred_element_type=jnp.float32)
    return product.astype(x.dtype)


def fp8_grouped_matmul(x: jax.Array, w, *, matrices: jax.Array | None = None, sum_groups: bool = False,
                       transposed: bool = False, gated: bool = False, out_dtype=jnp.float32, backend: str = "auto"):
    """Products of token groups with matrices of a block-FP8 stack (a MoE layer's experts), in
    float32 (or ``out_dtype``).

      x         [X, T, in], X = 1 (every group multiplies the same tokens) or G; an array, or
                ``QuantizedTokens`` (the rows quantized before, as this would quantize them)
      w         BlockFP8Weight stack [E, out, in], or a tuple of stacks of one shape and block
                (a MoE's gate and up: one launch for both, x quantized once)
      matrices  None (G = E, group g multiplies matrix g) or int [G]: each group's matrix, or
                negative: the group is skipped (its rows of y left unwritten; the FP8 GEMMs read
                nothing for it)
      -> [G, T, out] float32 (a tuple of them for a tuple of stacks): y[g] = x[g or 0] @
         W[matrices[g]]^T; with ``sum_groups`` (one stack, matrices None), [T, out] = the sum
         over g. ``transposed``: [G, out, T] (and [out, T]), the layout the FP8 GEMM of few
         tokens writes: a caller that consumes the result elementwise and transposes after (as
         the MoE's dense dispatch does) lets XLA fuse the transpose instead of copying it.
      gated     w a tuple (gate, up): one result, silu(x @ gate^T) * (x @ up^T), which the FP8 GEMM
                of few tokens computes in its CTAs (the tokens read once for both products, and
                neither product written out); the other paths compute it from the two products
      out_dtype what the result is rounded to once (float32, bfloat16 or float16)

    On a Hopper GPU or in the interpreter this is one launch of an FP8 GEMM, x quantized per row
    and 128 channels, each matrix's e4m3 bytes read where they lie: the tiled kernel
    (``fp8_grouped_gemm_tiles_mgpu``) where ``tiles_run`` (more than 64 rows, out and in whole
    128-blocks) and the groups are not summed, else the kernel of few tokens
    (``fp8_grouped_gemm_mgpu``) where ``kernel_runs`` (at most KERNEL_MAX_TOKENS rows). Otherwise
    XLA on the dequantized weights (the chosen matrices only), x unquantized.
    """
    stacks = w if isinstance(w, tuple) else (w,)
    first = stacks[0]
    if (len(first.shape) != 3 or x.ndim != 3 or x.shape[-1] != first.shape[-1]
            or any(s.shape != first.shape or s.block != first.block for s in stacks)):
        raise ValueError(f"x: expected [groups, tokens, {first.shape[-1]}] against weight stacks [E, out, in] of one "
                         f"shape, got {list(x.shape)} against {[list(s.shape) for s in stacks]}")
    if sum_groups and (matrices is not None or len(stacks) > 1):
        raise ValueError("matrices: a summed product runs every matrix of one stack in order (matrices=None)")
    if gated and (not isinstance(w, tuple) or len(stacks) != 2):
        raise ValueError("w: a gated product takes a tuple of two stacks (gate, up)")
    backend = resolve_backend(backend)
    rows = x.shape[1]

    def returned(ys):
        """The tuple ``ys`` as the caller's ``w`` asks: its one array for one stack or ``gated``."""
        return ys[0] if gated or not isinstance(w, tuple) else ys

    def finished(ys):
        """The float32 products as the caller asked for them: silu(gate) * up where ``gated``, in
        ``out_dtype``."""
        ys = (swiglu(*ys),) if gated else ys
        return returned(tuple(y.astype(out_dtype) for y in ys))

    if not sum_groups and all(tiles_run(s, rows, backend) for s in stacks):
        x8, x_scales = _quantized_rows(x, _tile_rows(rows), backend)
        values, scales = tuple(s.values for s in stacks), tuple(s.scales for s in stacks)
        ys = fp8_grouped_gemm_tiles_mgpu(x8, x_scales, values, scales, matrices, config=TILES_CONFIG,
                                         num_sms=sm_count(), interpret=backend == "interpret")
        return finished(tuple(jnp.swapaxes(y[:, :rows], -1, -2) if transposed else y[:, :rows] for y in ys))
    if all(kernel_runs(s, rows, backend) for s in stacks):
        tokens, x_scales = _kernel_tokens(x, pad_tokens(rows), backend)
        values, scales = tuple(s.values for s in stacks), tuple(s.scales for s in stacks)
        if len(stacks) == 1:
            values, scales = values[0], scales[0]
        ys = fp8_grouped_gemm_mgpu(tokens, x_scales, values, scales, matrices, sum_groups=sum_groups,
                                   transposed=transposed, gated=gated, out_dtype=out_dtype, num_sms=sm_count(),
                                   interpret=backend == "interpret")
        ys = tuple(y[..., :rows] if transposed else y[:rows] if sum_groups else y[:, :rows]
                   for y in (ys if isinstance(ys, tuple) else (ys,)))
        return returned(ys)
    if isinstance(x, QuantizedTokens):
        x = x.dequantized()
    shared = x.shape[0] == 1
    spec = f"{'ti' if shared else 'gti'},goi->{'to' if sum_groups else 'gto'}"

    def product(stack):
        if matrices is not None:
            stack = BlockFP8Weight(stack.values[matrices], stack.scales[matrices], stack.block)
        return jnp.einsum(spec, x[0] if shared else x, dequantize_weight(stack, x.dtype),
                          preferred_element_type=jnp.float32)

    return finished(tuple(jnp.swapaxes(product(s), -1, -2) if transposed else product(s) for s in stacks))

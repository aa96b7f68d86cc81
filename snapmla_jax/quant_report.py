"""The ablation behind SnapMLA's cache layout, as numbers.

``quant_error_report(latent, k_rope)`` reconstructs the [latent, rope] keys
under four FP8 schemes and measures the error in float64:

  per_tensor         one scale for all tokens and all 576 dims
  per_token_576      one scale per token over all 576 dims (RoPE in FP8)
  rope_aware_token   one scale per token over the 512 latent dims, RoPE kept in
                     BF16 (SnapMLA, what LatentCache stores)
  per_token_block128 a scale per token and per 128-channel block of the latent,
                     RoPE kept in BF16 (finer, 12 more bytes per token)
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from snapmla_jax.quantization import AMAX_FLOOR, FP8_E4M3_MAX, fp8_round_trip_np

SCHEMES = ("per_tensor", "per_token_576", "rope_aware_token", "per_token_block128")
CHANNEL_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class SchemeError:
    scheme: str
    bytes_per_token: float
    rel_error: float  # ||x_hat - x|| / ||x|| over [latent, rope]
    mse: float  # mean squared error over [latent, rope]
    latent_rel_error: float
    rope_rel_error: float


@dataclasses.dataclass(frozen=True)
class QuantErrorReport:
    rows: tuple[SchemeError, ...]

    def __getitem__(self, scheme: str) -> SchemeError:
        for row in self.rows:
            if row.scheme == scheme:
                return row
        raise KeyError(scheme)

    def to_markdown(self) -> str:
        lines = ["| scheme | bytes/token | rel. error | MSE | latent rel. error | RoPE rel. error |",
                 "|---|---|---|---|---|---|"]
        for r in self.rows:
            lines.append(f"| {r.scheme} | {r.bytes_per_token:.1f} | {r.rel_error:.3e} | {r.mse:.3e} | "
                         f"{r.latent_rel_error:.3e} | {r.rope_rel_error:.3e} |")
        return "\n".join(lines) + "\n"


def _scale(amax: np.ndarray) -> np.ndarray:
    return np.maximum(amax, AMAX_FLOOR) / FP8_E4M3_MAX


def _bf16_round_trip(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float64)


def _reconstruct(scheme: str, latent: np.ndarray, rope: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    both = np.concatenate([latent, rope], axis=-1)
    rank = latent.shape[-1]
    if scheme == "per_tensor":
        scale = np.full(both.shape[:-1], _scale(np.abs(both).max()))
        out = fp8_round_trip_np(both, scale)
        return out[:, :rank], out[:, rank:]
    if scheme == "per_token_576":
        out = fp8_round_trip_np(both, _scale(np.abs(both).max(-1)))
        return out[:, :rank], out[:, rank:]
    if scheme == "rope_aware_token":
        return fp8_round_trip_np(latent, _scale(np.abs(latent).max(-1))), _bf16_round_trip(rope)
    if scheme == "per_token_block128":
        blocks = latent.reshape(latent.shape[0], -1, CHANNEL_BLOCK)
        out = fp8_round_trip_np(blocks, _scale(np.abs(blocks).max(-1)))
        return out.reshape(latent.shape), _bf16_round_trip(rope)
    raise ValueError(f"scheme: expected one of {SCHEMES}, got {scheme!r}")


def _bytes_per_token(scheme: str, num_tokens: int, rank: int, rope_dim: int) -> float:
    return {
        "per_tensor": rank + rope_dim + 4 / num_tokens,
        "per_token_576": rank + rope_dim + 4,
        "rope_aware_token": rank + 4 + 2 * rope_dim,
        "per_token_block128": rank + 4 * (rank // CHANNEL_BLOCK) + 2 * rope_dim,
    }[scheme]


def _rel(err: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(err) / max(np.linalg.norm(ref), np.finfo(np.float64).tiny))


def quant_error_report(latent, k_rope) -> QuantErrorReport:
    """Reconstruction error of [latent, k_rope] under the four schemes of the module docstring.

    Args:
      latent: [N, R] array-like (any float dtype; R a multiple of 128), the compressed KV.
      k_rope: [N, Dr] array-like, the rotated RoPE keys of the same tokens.
    Returns a QuantErrorReport (index it by scheme name, or ``to_markdown()``).
    Raises ValueError for mismatched or malformed shapes, or non-finite values.
    """
    latent = np.asarray(latent, np.float64)
    rope = np.asarray(k_rope, np.float64)
    if latent.ndim != 2 or latent.shape[1] % CHANNEL_BLOCK:
        raise ValueError(f"latent: expected shape [N, R] with R a multiple of {CHANNEL_BLOCK}, got {list(latent.shape)}")
    if rope.ndim != 2 or rope.shape[0] != latent.shape[0]:
        raise ValueError(f"k_rope: expected shape [{latent.shape[0]}, Dr], got {list(rope.shape)}")
    if not (np.isfinite(latent).all() and np.isfinite(rope).all()):
        raise ValueError("latent/k_rope: expected finite values")
    ref = np.concatenate([latent, rope], axis=-1)
    rows = []
    for scheme in SCHEMES:
        lat_hat, rope_hat = _reconstruct(scheme, latent, rope)
        err = np.concatenate([lat_hat, rope_hat], axis=-1) - ref
        rows.append(SchemeError(
            scheme=scheme,
            bytes_per_token=_bytes_per_token(scheme, latent.shape[0], latent.shape[1], rope.shape[1]),
            rel_error=_rel(err, ref), mse=float(np.mean(err**2)),
            latent_rel_error=_rel(lat_hat - latent, latent), rope_rel_error=_rel(rope_hat - rope, rope)))
    return QuantErrorReport(rows=tuple(rows))

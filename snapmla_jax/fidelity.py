"""What the FP8 latent cache costs in quality, measured on a trained model.

    python -m snapmla_jax.fidelity [--model DIR] [--json F] [--markdown F] [--plot F.png] [--plot-ablation F.png]

DIR defaults to the shipped demo model (``snapmla_jax/assets/demo_model``),
whose held-out file list (``heldout_files.json``) picks the evaluation text
from this machine's Python standard library. Four measurements, all on the
same held-out windows (``--windows`` of ``--seq-len`` tokens, evenly spaced over
the held-out text), each starting from an empty cache:

1. Bits per byte with a BF16 cache and with the FP8 cache. Every position is
   scored by ``model.decode`` in chunks of ``--chunk`` queries, so every
   attention read goes through the cache and ``mla_decode``; the full causal
   forward (no cache) is reported beside them as a check on the decode path.
   Also the mean KL divergence of the FP8 next-byte distribution from the
   BF16 one and how often their argmax agrees, with the same two numbers for
   BF16 decode against the full forward as the floor of bf16 arithmetic.
2. Per layer, the attention output of the FP8 decode against the BF16 decode
   (the ``mla_decode`` result in latent space, before W_UV): mean and 1st-
   percentile cosine similarity per (token, head) vector, and the relative
   error ||fp8 - bf16|| / ||bf16||. Both runs see the same tokens, so a
   layer's error includes what the layers before it passed on.
3. The quantization ablation (``snapmla_jax.quant_error_report``) on the
   latents and RoPE keys the model really writes, read back from the BF16
   cache: per layer and over all layers.
4. Greedy generation from held-out prompts with each cache: how many tokens
   agree before the first difference, beside a control (float32 arithmetic
   instead of bfloat16, BF16 cache) that shows how often greedy decoding
   flips at near-ties under any rounding change.
5. What FP8 weights cost beside the FP8 cache: the same model with its linear
   kernels and routed experts block-quantized as DeepSeek-V3 ships them
   (``models.quantize_weights``, 128 x 128 blocks), its bits per byte with each
   cache against the BF16-weights BF16-cache run, and its greedy agreement with
   that run (FP8 weights and FP8 cache together).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from snapmla_jax.models import MLAModel, load_checkpoint, quantize_weights
from snapmla_jax.models.transformer import param_bytes
from snapmla_jax import byte_corpus, cli
from snapmla_jax.backend import BACKENDS
from snapmla_jax.cache import dequantize
from snapmla_jax.generate import generate
from snapmla_jax.paging import allocate_pages
from snapmla_jax.quant_report import QuantErrorReport, quant_error_report
from snapmla_jax.train_demo import cast_model

PROG = "snapmla_jax.fidelity"
DEFAULT_MODEL_DIR = pathlib.Path(__file__).resolve().parent / "assets" / "demo_model"
HELDOUT_LIST = "heldout_files.json"
LN2 = float(np.log(2.0))
PAGE_SIZE = 64
# A cosine's spread across (token, head) vectors: the 1st percentile shows the
# tail that a mean hides, without being one unlucky vector.
COSINE_TAIL_PERCENTILE = 1.0


@dataclasses.dataclass(frozen=True)
class LayerError:
    """FP8-vs-BF16 error of one layer's attention output (see ``layer_error``)."""

    layer: int
    cosine_mean: float
    cosine_p01: float
    rel_error: float


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """Teacher-forced decode of windows [W, S+1] with one cache kind.

    logprobs [W, S, V] float32: next-token log-probabilities.
    attn: per layer, the latent attention output [W, S, H, R] float32.
    latents, ropes: per layer, what the cache holds for every position,
    float32 [W * S, R] and [W * S, Dr] (read back through ``dequantize``).
    """

    logprobs: np.ndarray
    attn: tuple[np.ndarray, ...]
    latents: tuple[np.ndarray, ...]
    ropes: tuple[np.ndarray, ...]


def load_model_dir(model_dir: str | pathlib.Path) -> tuple[MLAModel, list[str]]:
    """(model, held-out file list) from a train_demo output directory."""
    model_dir = pathlib.Path(model_dir)
    if not (model_dir / HELDOUT_LIST).is_file():
        raise ValueError(f"model: expected a train_demo directory (a checkpoint with {HELDOUT_LIST}), "
                         f"got {str(model_dir)!r}")
    files, _ = byte_corpus.read_file_list(model_dir / HELDOUT_LIST)
    return load_checkpoint(model_dir), files


@nnx.jit(static_argnames=("backend",))
def _decode_chunk(model, input_ids, caches, block_table, seq_lens, backend):
    return model.decode(input_ids, caches, block_table, seq_lens, backend=backend, return_attn=True)


def teacher_forced_decode(model: MLAModel, windows: np.ndarray, kv_cache: str, *, chunk: int,
                          backend: str) -> DecodeRun:
    """Feed windows [W, S+1] int32 (inputs are the first S tokens) through ``model.decode``, ``chunk``
    tokens per call, into a fresh ``kv_cache`` ("fp8" | "bf16") cache. See DecodeRun for the result."""
    num_windows, seq_len = windows.shape[0], windows.shape[1] - 1
    if chunk < 1 or seq_len % chunk:
        raise ValueError(f"chunk: expected a positive divisor of the window length {seq_len}, got {chunk}")
    pages = allocate_pages([seq_len] * num_windows, 0, page_size=PAGE_SIZE)
    block_table = jnp.asarray(pages.block_table)
    caches = model.init_cache(pages.num_pages, PAGE_SIZE, kv_cache=kv_cache)
    logprobs, attn = [], []
    for start in range(0, seq_len, chunk):
        seq_lens = jnp.full((num_windows,), start + chunk, jnp.int32)
        logits, caches, layer_out = _decode_chunk(model, jnp.asarray(windows[:, start:start + chunk]), caches,
                                                  block_table, seq_lens, backend)
        logprobs.append(np.asarray(jax.nn.log_softmax(logits, axis=-1)))
        attn.append([np.asarray(a, np.float32) for a in layer_out])
    positions = np.arange(seq_len)
    slots = (pages.block_table[:, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE).reshape(-1)
    latents, ropes = [], []
    for cache in caches:
        latent, rope = dequantize(cache)
        latents.append(np.asarray(latent).reshape(-1, latent.shape[-1])[slots])
        ropes.append(np.asarray(rope).reshape(-1, rope.shape[-1])[slots])
    return DecodeRun(logprobs=np.concatenate(logprobs, axis=1),
                     attn=tuple(np.concatenate([a[i] for a in attn], axis=1) for i in range(len(attn[0]))),
                     latents=tuple(latents), ropes=tuple(ropes))


def spread_windows(stream: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """``count`` windows of seq_len + 1 tokens with evenly spaced starts over the whole ``stream``
    (so they sample every part of the held-out text, not just its first files): int32 [count, seq_len + 1]."""
    if count < 1:
        raise ValueError(f"count: expected a positive int, got {count}")
    if stream.shape[0] < count * (seq_len + 1):
        raise ValueError(f"stream: {stream.shape[0]} tokens cannot hold {count} disjoint windows of {seq_len + 1}")
    starts = np.linspace(0, stream.shape[0] - seq_len - 1, count).astype(np.int64)
    return stream[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)


def byte_bits(logprobs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log2 p(target) at the byte targets: logprobs [W, S, V], targets [W, S] int -> float64 [n_bytes]."""
    picked = np.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0].astype(np.float64)
    return -picked[targets < byte_corpus.NUM_BYTES] / LN2


def bits_per_byte_from_logprobs(logprobs: np.ndarray, targets: np.ndarray) -> float:
    """Mean -log2 p(target) over byte targets: logprobs [W, S, V], targets [W, S] int -> float."""
    return float(byte_bits(logprobs, targets).mean())


def mean_kl(ref_logprobs: np.ndarray, test_logprobs: np.ndarray) -> float:
    """Mean over positions of KL(ref || test) in nats: two logprobs [W, S, V] -> float."""
    ref = ref_logprobs.astype(np.float64)
    return float(np.mean(np.sum(np.exp(ref) * (ref - test_logprobs.astype(np.float64)), axis=-1)))


def layer_error(layer: int, test: np.ndarray, ref: np.ndarray) -> LayerError:
    """Cosine similarity per vector (last axis) and relative error of ``test`` against ``ref``, in float64."""
    test = test.astype(np.float64).reshape(-1, test.shape[-1])
    ref = ref.astype(np.float64).reshape(-1, ref.shape[-1])
    norms = np.linalg.norm(test, axis=-1) * np.linalg.norm(ref, axis=-1)
    cosine = np.sum(test * ref, axis=-1) / np.maximum(norms, np.finfo(np.float64).tiny)
    return LayerError(layer=layer, cosine_mean=float(cosine.mean()),
                      cosine_p01=float(np.percentile(cosine, COSINE_TAIL_PERCENTILE)),
                      rel_error=float(np.linalg.norm(test - ref) / np.linalg.norm(ref)))


def _agreeing_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return differ[0] if differ else min(len(a), len(b))


def greedy_agreement(model: MLAModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     backend: str, fp8_weights_model: MLAModel | None = None) -> dict:
    """Greedy continuations with the BF16 and the FP8 cache: per prompt the number of leading tokens
    that agree (``max_new_tokens`` when all do), and both texts of the first prompt.

    As a control, the same for the BF16 cache with the weights and arithmetic in float32 instead of
    bfloat16: greedy decoding flips at near-ties, and this shows how often any rounding change
    (not FP8 in particular) makes it flip. ``fp8_weights_model``: also that model (FP8 weights)
    with the FP8 cache against the same BF16-cache run.
    """
    run = lambda m, kind: generate(m, prompts, max_new_tokens=max_new_tokens, kv_cache=kind, backend=backend)
    bf16, fp8 = run(model, "bf16"), run(model, "fp8")
    f32 = run(cast_model(model, jnp.float32), "bf16")
    agree = [_agreeing_prefix(a, b) for a, b in zip(bf16, fp8)]
    control = [_agreeing_prefix(a, b) for a, b in zip(bf16, f32)]
    extra = {}
    if fp8_weights_model is not None:
        both = [_agreeing_prefix(a, b) for a, b in zip(bf16, run(fp8_weights_model, "fp8"))]
        extra = {"fp8_weights_agreeing_prefix": both, "fp8_weights_identical": sum(n == max_new_tokens for n in both)}
    return {"max_new_tokens": max_new_tokens, "num_prompts": len(prompts), **extra,
            "agreeing_prefix": agree, "identical": sum(n == max_new_tokens for n in agree),
            "control_f32_agreeing_prefix": control, "control_f32_identical": sum(n == max_new_tokens for n in control),
            "example_prompt": byte_corpus.decode(prompts[0]),
            "example_bf16": byte_corpus.decode(bf16[0]), "example_fp8": byte_corpus.decode(fp8[0])}


def rope_vs_latent_range(latents: Sequence[np.ndarray], ropes: Sequence[np.ndarray]) -> list[dict]:
    """Per layer: median and max over tokens of amax(k_rope) / amax(latent), the share of tokens whose
    RoPE key holds the token's largest value (those set a 576-wide per-token scale), and the median
    and max over tokens of each part's amax (how far apart tokens' ranges are)."""
    rows = []
    for layer, (latent, rope) in enumerate(zip(latents, ropes)):
        ratio = np.abs(rope).max(-1) / np.maximum(np.abs(latent).max(-1), np.finfo(np.float32).tiny)
        rows.append({"layer": layer, "median_ratio": float(np.median(ratio)), "max_ratio": float(ratio.max()),
                     "rope_sets_scale": float((ratio > 1).mean()),
                     "latent_amax_median": float(np.median(np.abs(latent).max(-1))),
                     "latent_amax_max": float(np.abs(latent).max()),
                     "rope_amax_median": float(np.median(np.abs(rope).max(-1))),
                     "rope_amax_max": float(np.abs(rope).max())})
    return rows


def evaluate(model: MLAModel, windows: np.ndarray, *, chunk: int, backend: str, prompts: Sequence[Sequence[int]],
             gen_tokens: int) -> dict:
    """All four measurements of the module docstring on windows [W, S+1] -> a JSON-serializable dict."""
    targets = windows[:, 1:]
    full = np.asarray(jax.nn.log_softmax(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(windows[:, :-1])), axis=-1))
    bf16 = teacher_forced_decode(model, windows, "bf16", chunk=chunk, backend=backend)
    fp8 = teacher_forced_decode(model, windows, "fp8", chunk=chunk, backend=backend)
    bpb = {"full_forward": bits_per_byte_from_logprobs(full, targets),
           "bf16_cache": bits_per_byte_from_logprobs(bf16.logprobs, targets),
           "fp8_cache": bits_per_byte_from_logprobs(fp8.logprobs, targets)}
    # Paired over the same bytes, so the difference's standard error is far below either mean's.
    diff = byte_bits(fp8.logprobs, targets) - byte_bits(bf16.logprobs, targets)
    # The same model with FP8 weights (DeepSeek's 128 x 128 blocks), with each cache.
    fp8_weights = quantize_weights(nnx.clone(model))
    weights_runs = {f"{kind}_cache": teacher_forced_decode(fp8_weights, windows, kind, chunk=chunk,
                                                           backend=backend).logprobs for kind in ("bf16", "fp8")}
    # And with w_uk / w_uv FP8 too (what the absorbed weights' own rounding adds), FP8 cache.
    fp8_absorbed = quantize_weights(nnx.clone(model), absorbed=True)
    weights_runs["fp8_cache_fp8_absorbed"] = teacher_forced_decode(fp8_absorbed, windows, "fp8", chunk=chunk,
                                                                   backend=backend).logprobs
    weights_diff = {kind: byte_bits(lp, targets) - byte_bits(bf16.logprobs, targets) for kind, lp in weights_runs.items()}
    ablation = [quant_error_report(lat, rope) for lat, rope in zip(bf16.latents, bf16.ropes)]
    pooled = quant_error_report(np.concatenate(bf16.latents), np.concatenate(bf16.ropes))
    return {
        "bits_per_byte": bpb,
        "fp8_vs_bf16_relative": bpb["fp8_cache"] / bpb["bf16_cache"] - 1.0,
        "fp8_minus_bf16_bits_per_byte": float(diff.mean()),
        "fp8_minus_bf16_standard_error": float(diff.std(ddof=1) / np.sqrt(diff.size)),
        "kl_fp8_from_bf16_nats_mean": mean_kl(bf16.logprobs, fp8.logprobs),
        "argmax_agreement": float((bf16.logprobs.argmax(-1) == fp8.logprobs.argmax(-1)).mean()),
        # The same two numbers for BF16-cache decode against the full forward: both bf16, only the
        # order of operations differs (absorbed vs expanded form), a floor for what FP8 adds.
        "kl_bf16_from_full_nats_mean": mean_kl(full, bf16.logprobs),
        "argmax_agreement_bf16_vs_full": float((full.argmax(-1) == bf16.logprobs.argmax(-1)).mean()),
        "layers": [dataclasses.asdict(layer_error(i, f, b)) for i, (f, b) in enumerate(zip(fp8.attn, bf16.attn))],
        "ablation_per_layer": [_report_rows(r) for r in ablation],
        "ablation_all_layers": _report_rows(pooled),
        "rope_vs_latent": rope_vs_latent_range(bf16.latents, bf16.ropes),
        "greedy": greedy_agreement(model, prompts, gen_tokens, backend, fp8_weights_model=fp8_weights),
        "fp8_weights": {
            "param_bytes": {"bf16": param_bytes(model), "fp8": param_bytes(fp8_weights),
                            "fp8_absorbed": param_bytes(fp8_absorbed)},
            "bits_per_byte": {run: bits_per_byte_from_logprobs(lp, targets) for run, lp in weights_runs.items()},
            # Paired against the BF16-weights BF16-cache run, over the same bytes.
            "minus_bf16_bits_per_byte": {run: float(d.mean()) for run, d in weights_diff.items()},
            "minus_bf16_standard_error": {run: float(d.std(ddof=1) / np.sqrt(d.size)) for run, d in weights_diff.items()},
            "kl_from_bf16_nats_mean": {run: mean_kl(bf16.logprobs, lp) for run, lp in weights_runs.items()},
        },
        "num_windows": int(windows.shape[0]), "window_tokens": int(targets.shape[1]),
        "bytes_scored": int((targets < byte_corpus.NUM_BYTES).sum()),
    }


def _report_rows(report: QuantErrorReport) -> list[dict]:
    return [dataclasses.asdict(row) for row in report.rows]


def to_markdown(results: dict) -> str:
    """The results as markdown tables (what docs/fidelity.md quotes)."""
    bpb = results["bits_per_byte"]
    lines = [f"Held-out text: {results['num_windows']} windows of {results['window_tokens']} tokens "
             f"({results['bytes_scored']} bytes scored); backend `{results['backend']}`.", "",
             "| path | bits per byte |", "|---|---|",
             f"| full causal forward (no cache) | {bpb['full_forward']:.4f} |",
             f"| decode, BF16 cache | {bpb['bf16_cache']:.4f} |",
             f"| decode, FP8 cache (SnapMLA) | {bpb['fp8_cache']:.4f} |", "",
             f"FP8 vs BF16: {100 * results['fp8_vs_bf16_relative']:+.3f}% bits per byte "
             f"({results['fp8_minus_bf16_bits_per_byte']:+.5f} +- {results['fp8_minus_bf16_standard_error']:.5f} "
             f"bits per byte, paired standard error).", "",
             "| comparison | mean KL (nats per position) | argmax agreement |", "|---|---|---|",
             f"| FP8-cache decode vs BF16-cache decode | {results['kl_fp8_from_bf16_nats_mean']:.2e} | "
             f"{100 * results['argmax_agreement']:.2f}% |",
             f"| BF16-cache decode vs full forward (floor: same precision, other operation order) | "
             f"{results['kl_bf16_from_full_nats_mean']:.2e} | {100 * results['argmax_agreement_bf16_vs_full']:.2f}% |",
             "",
             "| layer | cosine (mean) | cosine (1st pct.) | relative error |", "|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['cosine_mean']:.6f} | {r['cosine_p01']:.6f} | {r['rel_error']:.3e} |"
              for r in results["layers"]]
    lines += ["", "Quantization ablation on the model's cached latents and RoPE keys, all layers pooled:", "",
              "| scheme | bytes/token | rel. error | latent rel. error | RoPE rel. error |", "|---|---|---|---|---|"]
    lines += [f"| {r['scheme']} | {r['bytes_per_token']:.1f} | {r['rel_error']:.3e} | {r['latent_rel_error']:.3e} | "
              f"{r['rope_rel_error']:.3e} |" for r in results["ablation_all_layers"]]
    schemes = [r["scheme"] for r in results["ablation_all_layers"]]
    lines += ["", "Relative error per layer:", "", "| layer | " + " | ".join(schemes) + " |",
              "|---" * (len(schemes) + 1) + "|"]
    lines += [f"| {i} | " + " | ".join(f"{r['rel_error']:.3e}" for r in rows) + " |"
              for i, rows in enumerate(results["ablation_per_layer"])]
    lines += ["", "Per-token ranges (amax = largest magnitude of a token's part; median and max over tokens):", "",
              "| layer | latent amax median / max | RoPE amax median / max | amax(RoPE)/amax(latent) median / max "
              "| tokens where RoPE sets the 576-wide scale |", "|---|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['latent_amax_median']:.2f} / {r['latent_amax_max']:.2f} | "
              f"{r['rope_amax_median']:.2f} / {r['rope_amax_max']:.2f} | {r['median_ratio']:.2f} / {r['max_ratio']:.2f} | "
              f"{100 * r['rope_sets_scale']:.1f}% |" for r in results["rope_vs_latent"]]
    g, w = results["greedy"], results["fp8_weights"]
    lines += ["", f"Greedy generation, {g['num_prompts']} held-out prompts x {g['max_new_tokens']} new tokens, "
              "tokens before the first difference from the BF16-cache run:", "",
              "| run | identical | agreeing prefix per prompt |", "|---|---|---|",
              f"| FP8 cache (bf16 model) | {g['identical']} of {g['num_prompts']} | {g['agreeing_prefix']} |",
              f"| FP8 weights and FP8 cache | {g['fp8_weights_identical']} of {g['num_prompts']} | "
              f"{g['fp8_weights_agreeing_prefix']} |",
              f"| control: BF16 cache, float32 weights and arithmetic | {g['control_f32_identical']} of "
              f"{g['num_prompts']} | {g['control_f32_agreeing_prefix']} |"]
    base = bpb["bf16_cache"]
    lines += ["", f"FP8 weights (linear kernels and routed experts in 128 x 128 blocks; weights "
              f"{w['param_bytes']['fp8'] / 2**20:.1f} MiB against {w['param_bytes']['bf16'] / 2**20:.1f} MiB), "
              "against BF16 weights with the BF16 cache (paired standard errors):", "",
              "| weights | cache | bits per byte | vs BF16 weights, BF16 cache | mean KL (nats per position) |",
              "|---|---|---|---|---|",
              f"| BF16 | FP8 | {bpb['fp8_cache']:.4f} | {100 * (bpb['fp8_cache'] / base - 1):+.3f}% "
              f"({results['fp8_minus_bf16_bits_per_byte']:+.5f} +- {results['fp8_minus_bf16_standard_error']:.5f}) | "
              f"{results['kl_fp8_from_bf16_nats_mean']:.2e} |"]
    runs = {"bf16_cache": ("FP8", "BF16"), "fp8_cache": ("FP8", "FP8"),
            "fp8_cache_fp8_absorbed": ("FP8, w_uk / w_uv too", "FP8")}
    lines += [f"| {weights} | {cache} | {w['bits_per_byte'][run]:.4f} | "
              f"{100 * (w['bits_per_byte'][run] / base - 1):+.3f}% "
              f"({w['minus_bf16_bits_per_byte'][run]:+.5f} +- {w['minus_bf16_standard_error'][run]:.5f}) | "
              f"{w['kl_from_bf16_nats_mean'][run]:.2e} |" for run, (weights, cache) in runs.items() if run in w['bits_per_byte']]
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib.pyplot on its file-only backend (no display on servers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | pathlib.Path) -> None:
    """Lay out ``fig``, write it to ``path`` as a PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def plot_layers(results: dict, path: str | pathlib.Path) -> None:
    """PNG of the per-layer attention-output error (1 - cosine and relative error, log scale)."""
    plt = pyplot()
    layers = [r["layer"] for r in results["layers"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.semilogy(layers, [1 - r["cosine_mean"] for r in results["layers"]], "o-", label="1 - cosine (mean)")
    ax.semilogy(layers, [1 - r["cosine_p01"] for r in results["layers"]], "s--", label="1 - cosine (1st pct.)")
    ax.semilogy(layers, [r["rel_error"] for r in results["layers"]], "^-", label="relative error")
    ax.set_xlabel("layer")
    ax.set_xticks(layers)
    ax.set_ylabel("FP8 decode vs BF16 decode")
    ax.set_title("Attention output (latent space, before W_UV), held-out text", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_png(fig, path)


def plot_ablation(results: dict, path: str | pathlib.Path) -> None:
    """PNG of the quantization ablation: relative error of [latent, RoPE] per scheme and layer."""
    plt = pyplot()
    per_layer = results["ablation_per_layer"]
    schemes = [r["scheme"] for r in per_layer[0]]
    width = 0.8 / len(schemes)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for j, scheme in enumerate(schemes):
        xs = [i + (j - (len(schemes) - 1) / 2) * width for i in range(len(per_layer))]
        bytes_per_token = per_layer[0][j]["bytes_per_token"]
        ax.bar(xs, [rows[j]["rel_error"] for rows in per_layer], width,
               label=f"{scheme} ({bytes_per_token:.0f} B/token)")
    ax.set_xticks(range(len(per_layer)))
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error of [latent, RoPE key]")
    ax.set_title("FP8 schemes on the model's cached latents and RoPE keys", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    top = max(rows[j]["rel_error"] for rows in per_layer for j in range(len(schemes)))
    ax.set_ylim(0, 1.45 * top)  # headroom for the legend above the bars
    ax.legend(fontsize=7, ncol=2, loc="upper center")
    save_png(fig, path)


def _parser() -> cli.Parser:
    p = cli.Parser(prog="python -m snapmla_jax.fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR),
                   help="train_demo output directory (a checkpoint with heldout_files.json; default: the shipped "
                        "demo model)")
    p.add_argument("--windows", type=int, default=32, help="held-out windows scored (spread over the held-out text)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (at most the model's context)")
    p.add_argument("--chunk", type=int, default=64, help="tokens per decode call (a divisor of --seq-len)")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts for greedy generation")
    p.add_argument("--prompt-bytes", type=int, default=64, help="bytes of each prompt")
    p.add_argument("--gen-tokens", type=int, default=300, help="greedy tokens per prompt")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="write_kv/mla_decode backend (default auto)")
    p.add_argument("--json", help="write all numbers to this file")
    p.add_argument("--markdown", help="write the tables to this file")
    p.add_argument("--plot", help="write the per-layer attention-error PNG to this file")
    p.add_argument("--plot-ablation", help="write the quantization-ablation PNG to this file")
    return p


def _check_args(args) -> None:
    """UsageError naming the flag for a bad count or output path (before any work)."""
    cli.check_positive(args, "windows", "seq_len", "chunk", "prompts", "prompt_bytes", "gen_tokens")
    if args.seq_len % args.chunk:
        raise cli.UsageError(f"--chunk: expected a divisor of --seq-len {args.seq_len}, got {args.chunk}")
    for flag in ("json", "markdown", "plot", "plot_ablation"):
        cli.check_output_file(f"--{flag.replace('_', '-')}", getattr(args, flag))


def print_and_write(results: dict, markdown: str, json_path: str | None, markdown_path: str | None) -> None:
    """Print a command's markdown table; write its results (JSON) and the table where a flag asked."""
    print(markdown)
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps(results, indent=1) + "\n")
    if markdown_path:
        pathlib.Path(markdown_path).write_text(markdown)


def model_flag(path: str) -> tuple[MLAModel, list[str]]:
    """The model and held-out list of the train_demo directory ``--model`` names; UsageError naming
    --model when it is not one."""
    model_dir = pathlib.Path(path)
    if not model_dir.is_dir():
        raise cli.UsageError(f"--model: {path} is not a directory")
    try:
        return load_model_dir(model_dir)
    except ValueError as err:  # not a train_demo directory, or an unreadable checkpoint
        raise cli.flag_error(err, {"model": "--model", "ckpt_dir": "--model"}, default="--model") from err


def heldout_files_flag(heldout: list[str]) -> tuple[pathlib.Path, list[str], list[str]]:
    """(standard library root, held-out files present there, those missing); UsageError naming
    --model when none of its held-out files is on this machine."""
    root = byte_corpus.stdlib_root()
    present, missing = byte_corpus.present_files(root, heldout)
    if not present:
        raise cli.UsageError(f"--model: none of the {len(heldout)} held-out files its {HELDOUT_LIST} lists exist "
                             f"under {root} (another Python version?)")
    return root, present, missing


def _load(args) -> tuple[MLAModel, list[str]]:
    """The model and held-out list of --model, checked against the other flags."""
    model, heldout = model_flag(args.model)
    context = model.cfg.max_position_embeddings
    if args.seq_len > context:
        raise cli.UsageError(f"--seq-len: expected at most the model's context of {context} tokens, got {args.seq_len}")
    # A prompt of --prompt-bytes bytes encodes to that many tokens plus BOS.
    if args.prompt_bytes + 1 + args.gen_tokens > context:
        raise cli.UsageError(f"--gen-tokens: {args.gen_tokens} tokens after prompts of {args.prompt_bytes} bytes pass "
                             f"the model's context of {context} tokens; expected at most "
                             f"{max(context - args.prompt_bytes - 1, 0)}")
    return model, heldout


def _fidelity(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    _check_args(args)
    backend = cli.backend(args.backend)
    model, heldout = _load(args)
    root, present, missing = heldout_files_flag(heldout)
    stream = byte_corpus.token_stream(root, present)
    if stream.shape[0] < args.windows * (args.seq_len + 1):
        raise cli.UsageError(f"--windows: the held-out text ({stream.shape[0]} tokens) holds at most "
                             f"{stream.shape[0] // (args.seq_len + 1)} disjoint windows of --seq-len {args.seq_len} "
                             f"+ 1 tokens, not {args.windows}")
    windows = spread_windows(stream, args.seq_len, args.windows)
    if args.prompts > len(present):
        raise cli.UsageError(f"--prompts: expected 1..{len(present)} (one per held-out file present), "
                             f"got {args.prompts}")
    stride = len(present) // args.prompts
    prompts = [byte_corpus.encode((root / present[i * stride]).read_bytes()[:args.prompt_bytes]).tolist()
               for i in range(args.prompts)]
    results = evaluate(model, windows, chunk=args.chunk, backend=backend, prompts=prompts, gen_tokens=args.gen_tokens)
    results.update(backend=backend, device=str(jax.devices()[0].device_kind), jax_version=jax.__version__,
                   python_version=sys.version.split()[0], heldout_files_missing=missing,
                   date_utc=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                   command="python -m snapmla_jax.fidelity " + " ".join(argv))
    print_and_write(results, to_markdown(results), args.json, args.markdown)
    if args.plot:
        plot_layers(results, args.plot)
    if args.plot_ablation:
        plot_ablation(results, args.plot_ablation)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 2 bad input or out of memory)."""
    return cli.run(PROG, _fidelity, argv, out_of_memory_hint="try fewer --windows or a shorter --seq-len")


if __name__ == "__main__":
    sys.exit(main())

"""FlashMLA's dense BF16 decode beside ours in ``python -m snapmla_jax.bench decode``.

FlashMLA (deepseek-ai/FlashMLA, PyTorch + CUDA) is what a Hopper user runs for MLA decoding.
When it is importable, the decode benchmark times it on the same shapes and cache contents as
our kernels, in the same process, and prints the ratio; when it is not, its column is absent.

Two ways to reach it (``load``):
  - the ``flash_mla`` package (``get_mla_metadata`` + ``flash_mla_with_kvcache``; the older
    interface, metadata from cache_seqlens, and the newer, metadata filled on the first call,
    are both called the same way here);
  - a compiled extension with FlashMLA's own ``dense_decode_fwd`` C++ interface (a path to its
    ``.so``: a build of FlashMLA's SM90 dense decode alone).

FlashMLA reads a bf16 cache of [pages, 64, 1, 576] (latent || rope a token) and a 576-wide
query; ``FlashMLARun`` builds them from our bf16 cache and queries (DLPack, then one
concatenation), and replays its calls over every layer in one CUDA graph, so that Python's
dispatch is not timed (our side runs its layers inside one jit).
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
from typing import Any

import jax

PAGE = 64
RANK = 512


class TorchSync:
    """What a FlashMLA run returns: ``jax.block_until_ready`` calls ``block_until_ready`` on
    leaves it does not own, so timing code written for JAX waits for the CUDA stream too."""

    def block_until_ready(self):
        import torch

        torch.cuda.synchronize()
        return self


class FlashMLA:
    """One way of calling FlashMLA's dense decode: ``decode(q, k_cache, block_table, seq_lens,
    scale, causal, meta)`` -> out [B, s_q, H, 512] bf16, with ``meta`` from ``metadata``."""

    def __init__(self, name: str, module: Any, package: bool):
        self.name, self.module, self.package = name, module, package

    def metadata(self, seq_lens, s_q: int, heads: int):
        """Scheduler metadata for these lengths (reusable while they stay the same)."""
        if self.package:
            return self.module.get_mla_metadata(seq_lens, s_q * heads, 1)
        if hasattr(self.module, "get_sched_meta"):
            return self.module.get_sched_meta(seq_lens, s_q, heads, 1)
        return None, None  # dense_decode_fwd then schedules at every call

    def decode(self, q, k_cache, block_table, seq_lens, scale: float, causal: bool, meta):
        if self.package:
            return self.module.flash_mla_with_kvcache(q, k_cache, block_table, seq_lens, RANK, *meta,
                                                      softmax_scale=scale, causal=causal)[0]
        return self.module.dense_decode_fwd(q, k_cache, RANK, seq_lens, block_table, scale, causal, *meta)[0]


def check_spec(spec: str) -> None:
    """ValueError naming ``--flashmla`` unless ``spec`` is "auto", "none" or an existing file."""
    if spec not in ("auto", "none") and not pathlib.Path(spec).is_file():
        raise ValueError(f"--flashmla: expected 'auto', 'none' or a FlashMLA extension .so, got {spec!r}")


def load(spec: str) -> FlashMLA | None:
    """``spec``: "none"; "auto" (the ``flash_mla`` package if importable with torch and a CUDA
    device, else None); or a path to an extension ``.so`` with ``dense_decode_fwd``. Raises
    ValueError naming ``--flashmla`` for a path that does not load."""
    if spec == "none":
        return None
    if spec == "auto":
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("flash_mla") is None:
            return None
        import torch

        if not torch.cuda.is_available():
            return None
        module = importlib.import_module("flash_mla")
        return FlashMLA(f"flash_mla {getattr(module, '__version__', '')}".strip(), module, package=True)
    check_spec(spec)
    path = pathlib.Path(spec)
    try:
        import torch  # noqa: F401  (the extension links against torch's libraries)

        module_spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except (ImportError, OSError) as err:
        raise ValueError(f"--flashmla: {spec} does not load: {err}") from None
    if not hasattr(module, "dense_decode_fwd"):
        raise ValueError(f"--flashmla: {spec} has no dense_decode_fwd")
    return FlashMLA(f"extension {path.name}", module, package=False)


def to_torch(x: jax.Array):
    """A jax.Array as a torch CUDA tensor (DLPack, no copy)."""
    import torch

    return torch.from_dlpack(x)


class FlashMLARun:
    """FlashMLA over the same problem as our decode chain (``decode.decode_chain``): ``calls``
    calls (default: one a layer), call i over layer i mod layers of the bf16 cache (its pages
    offset by l x pages in one [layers x pages, 64, 1, 576] array), captured in one CUDA graph.
    ``run()`` replays it and returns a ``TorchSync``."""

    def __init__(self, flashmla: FlashMLA, q, q_rope, bf16_cache, block_table, seq_lens, scale: float,
                 calls: int | None = None):
        import torch

        s_q, heads = q.shape[1], q.shape[2]
        self.layers = bf16_cache.num_layers or 1
        self.calls = self.layers if calls is None else calls
        latent, rope = to_torch(bf16_cache.latent), to_torch(bf16_cache.rope)
        self.k_cache = torch.cat([latent, rope], dim=-1).reshape(-1, PAGE, 1, RANK + rope.shape[-1]).contiguous()
        del latent, rope
        self.q = torch.cat([to_torch(q), to_torch(q_rope)], dim=-1).contiguous()
        table = to_torch(block_table).to(torch.int32)
        page_offset = bf16_cache.latent.shape[1] if self.layers > 1 else 0  # pages a layer
        self.tables = [(table + layer * page_offset).contiguous() for layer in range(self.layers)]
        self.seq_lens = to_torch(seq_lens).to(torch.int32).contiguous()
        self.flashmla, self.scale, self.causal = flashmla, scale, s_q > 1
        self.meta = flashmla.metadata(self.seq_lens, s_q, heads)
        self.out = None
        self.graph = self._capture()

    def call(self, layer: int):
        self.out = self.flashmla.decode(self.q, self.k_cache, self.tables[layer], self.seq_lens, self.scale,
                                        self.causal, self.meta)

    def _capture(self):
        import torch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (the newer interface plans on its first call)
                for layer in range(self.layers):
                    self.call(layer)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in range(self.calls):
                self.call(call % self.layers)
        torch.cuda.synchronize()
        return graph

    def run(self) -> TorchSync:
        self.graph.replay()
        return TorchSync()

    def first_layer_output(self):
        """Layer 0's output [B, s_q, H, 512] as float32 torch, computed now."""
        self.call(0)
        out = self.out.float()
        TorchSync().block_until_ready()
        return out

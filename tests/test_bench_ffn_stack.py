"""scripts/bench_ffn_stack.py on the CPU: the floor counts the feed-forward weights each dispatch
reads, its stack runs the grouped kernel where asked, and without a GPU it exits 2."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from script_loader import load_script

import snapmla_jax.models.moe

from snapmla_jax import models
from snapmla_jax.bench.e2e import TINY, feed_forward_stack, random_model

bench = load_script("bench_ffn_stack")


def test_floor_counts_the_feed_forward_weights_each_dispatch_reads():
    model = random_model(TINY, jnp.bfloat16)
    dense_mlp, moe = model.layers[0].mlp, model.layers[1].mlp
    size = lambda module: sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(nnx.state(module)))
    norms = sum(size(layer.post_attention_layernorm) for layer in model.layers)
    routed = sum(getattr(moe, w)[...].nbytes for w in ("w_gate", "w_up", "w_down"))
    always = norms + size(dense_mlp) + size(moe) - routed
    share = 1 - (1 - TINY.num_experts_per_tok / TINY.n_routed_experts)  # one token: k of E experts
    models.moe.set_gather_max_tokens(model, 1)
    assert bench.feed_forward_bytes(model, 1, "xla") == int(always + routed * share)  # gathered
    models.moe.set_gather_max_tokens(model, 0)
    assert bench.feed_forward_bytes(model, 4, "xla") == always + routed  # 4 tokens: dense, every expert
    models.moe.set_dense_token_range(model, None)
    assert bench.feed_forward_bytes(model, 4, "xla") < always + routed  # ragged: the experts 4 tokens pick


def test_the_stack_runs_the_gathered_dispatch_as_the_kernel_where_asked():
    """``feed_forward_stack(backend=...)`` reaches the MoE's gathered dispatch: with bf16 experts
    of sizes the grouped experts take (multiples of 128), their launches appear only with a kernel
    backend, and compute the jnp path's stack (which rounds its products to bf16 at other points:
    2**-9 relative each, a few in a row: 1e-2)."""
    config = dataclasses.replace(TINY, hidden_size=128, moe_intermediate_size=128)
    model = random_model(config, jnp.bfloat16)
    models.moe.set_gather_max_tokens(model, 1)
    graphdef, params = nnx.split(model)
    x = jax.random.normal(jax.random.key(0), (1, 1, config.hidden_size), jnp.float32).astype(jnp.bfloat16)
    texts, outs = {}, {}
    for backend in ("xla", "interpret"):
        compiled = feed_forward_stack.lower(params, x, graphdef=graphdef, backend=backend).compile()
        texts[backend] = compiled.as_text()  # op metadata names the interpreted kernels
        outs[backend] = np.asarray(jnp.asarray(compiled(params, x), jnp.float32), np.float64)
    assert "snapmla_grouped_gemm" in texts["interpret"] and "snapmla_grouped_gemm" not in texts["xla"]
    assert np.abs(outs["interpret"] - outs["xla"]).max() <= 1e-2 * np.abs(outs["xla"]).max()


def test_without_a_gpu_it_exits_2(tmp_path):
    assert bench.main(["--out", str(tmp_path)]) == 2
    assert not (tmp_path / "bench_ffn_stack.json").exists()

"""The end-to-end bench's inputs and floors (``snapmla_jax.bench.e2e``), on the tiny model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from snapmla_jax.bench import e2e


def test_the_decode_rows_start_from_tokens_of_their_own():
    """Rows that all held one token would route to the same experts, and a MoE that skips the
    unchosen experts would then read k of them where a batch's rows read up to k x batch."""
    state = e2e.decode_state(None, 64, 5, e2e.V2_LITE.vocab_size)
    tokens = np.asarray(state.tokens)
    assert tokens.shape == (64, 5) and int(state.step) == 1
    assert len(np.unique(tokens[:, 0])) >= 60  # random ids of 102400: a repeat or two at most
    assert tokens.min() >= 0 and tokens.max() < e2e.V2_LITE.vocab_size


def test_the_floor_counts_the_experts_each_dispatch_reads():
    """bf16 dense reads every expert; block-FP8 dense skips the unchosen experts' gate and up but
    reads every down matrix; ragged (like gathered and sorted) reads the expected share a batch
    chooses, 1 - (1 - k/E)^B, of all three. So dense reads (1 - share) x (all three) more than
    ragged in bf16 and (1 - share) x (the down matrices) more in FP8."""
    cfg = e2e.TINY
    for batch in (1, 3):
        share = 1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch
        for fp8 in (False, True):
            _, params = nnx.split(e2e.random_model(cfg, jnp.bfloat16, fp8_weights=fp8))
            sizes = {name: sum(leaf.nbytes for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                               if name in {getattr(key, "key", None) for key in path})
                     for name in ("w_gate", "w_up", "w_down")}
            total, dense = e2e.weight_bytes_touched(cfg, params, batch, "dense")
            _, ragged = e2e.weight_bytes_touched(cfg, params, batch, "ragged")
            extra = (1 - share) * (sizes["w_down"] if fp8 else sum(sizes.values()))
            assert ragged < dense < total and abs(dense - ragged - extra) <= 2, (batch, fp8)


def test_fp8_ffn_models_keep_the_attention_projections_in_bf16():
    """``fp8_ffn_only``: block-FP8 exactly the weights under the feed-forward blocks (dense MLP,
    shared and routed experts); the attention's projections stay bf16 as in the bf16 model."""
    from snapmla_jax.fp8_weights import BlockFP8Weight
    from snapmla_jax.models.layers import fp8_eligible_weights

    model = e2e.random_model(e2e.TINY, jnp.bfloat16, fp8_weights=True, fp8_ffn_only=True)
    kinds = {path: isinstance(w.get_value(), BlockFP8Weight) for path, w in fp8_eligible_weights(model).items()}
    fp8 = {path for path, is_fp8 in kinds.items() if is_fp8}
    assert fp8 == {path for path in kinds if "/mlp/" in path}
    assert any("self_attn/q" in path for path in kinds) and not any("self_attn" in path for path in fp8)
    assert {"layers/0/mlp/gate_proj/kernel", "layers/1/mlp/w_down"} <= fp8  # a dense MLP and the experts


def test_fp8_large_models_keep_the_weights_below_the_threshold_in_bf16():
    """``fp8_min_elements`` (the fp8-large kind's ``DECODE_MIN_FP8_ELEMENTS``): block-FP8 exactly
    the eligible weights of at least that many elements, an expert stack counted whole."""
    from snapmla_jax.fp8_weights import BlockFP8Weight
    from snapmla_jax.models.layers import fp8_eligible_weights, is_absorbed_weight, weight_elements

    sizes = {path: weight_elements(w.get_value())
             for path, w in fp8_eligible_weights(e2e.random_model(e2e.TINY, jnp.bfloat16)).items()
             if not is_absorbed_weight(path)}
    threshold = sorted(set(sizes.values()))[len(set(sizes.values())) // 2]
    model = e2e.random_model(e2e.TINY, jnp.bfloat16, fp8_weights=True, fp8_min_elements=threshold)
    fp8 = {path for path, w in fp8_eligible_weights(model).items() if isinstance(w.get_value(), BlockFP8Weight)}
    assert fp8 == {path for path, n in sizes.items() if n >= threshold}
    assert fp8 and fp8 != set(sizes)


def test_models_that_cannot_fit_together_are_refused_naming_weights(monkeypatch):
    """Side-by-side models larger than the memory XLA may use are refused before any is built,
    with their sizes; a limit that holds them (or none known) passes."""
    from snapmla_jax import cli

    kinds = ["bf16", "fp8", "fp8-large"]
    total = sum(sum(leaf.size * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(nnx.state(
        e2e.abstract_model(e2e.TINY, jnp.bfloat16, **e2e.weight_kind_options(kind))))) for kind in kinds)
    bf16_only = sum(leaf.size * jnp.dtype(leaf.dtype).itemsize
                    for leaf in jax.tree.leaves(nnx.state(e2e.abstract_model(e2e.TINY, jnp.bfloat16))))
    assert bf16_only < total < 3 * bf16_only  # the FP8 kinds are smaller, and counted
    e2e.check_models_fit(e2e.TINY, kinds, None)
    e2e.check_models_fit(e2e.TINY, kinds, total + e2e.HEADROOM_BYTES)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    with pytest.raises(cli.UsageError) as info:
        e2e.check_models_fit(e2e.TINY, kinds, total + e2e.HEADROOM_BYTES - 1)
    message = str(info.value)
    assert message.startswith("--weights: the models take ") and "XLA_PYTHON_CLIENT_MEM_FRACTION=0.5" in message
    assert "\n" not in message and "fp8-large " in message

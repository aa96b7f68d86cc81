"""The grouped experts (pallas_kernels/grouped_experts.py: two launches of the BF16 grouped GEMM, one
group an assignment or one group a chunk of an expert's sorted tokens) against float64, interpreted
on the CPU and compiled under ``pytest -m gpu``, and the MoE's gathered and sorted dispatches through
them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import snapmla_jax.models.moe
import snapmla_jax.pallas_kernels.grouped_experts as grouped_experts_module

from snapmla_jax import models
from snapmla_jax.pallas_kernels.grouped_experts import (chunk_rows, expert_ranks, gather_rows, grouped_experts,
                                                        grouped_experts_reference, num_chunks, sorted_experts,
                                                        sorted_products, sorted_takes, takes)
from snapmla_jax.backend import lower_for_cuda


def _problem(seed, *, tokens, k, experts=8, hidden=256, inner=128, dtype=jnp.bfloat16):
    """Random bf16-representable weights and tokens (one token 30x the others), distinct experts a
    token but shared between tokens, positive gate weights; hidden and inner the smallest the
    grouped GEMM takes in both launches (multiples of 128)."""
    rng = np.random.default_rng(seed)
    bf = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    w_gate, w_up = (bf(rng.standard_normal((experts, hidden, inner)) / np.sqrt(hidden)) for _ in range(2))
    w_down = bf(rng.standard_normal((experts, inner, hidden)) / np.sqrt(inner))
    x = rng.standard_normal((tokens, hidden))
    x[0] *= 30.0  # an outlier token
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.random((tokens, k)).astype(np.float32) + 0.1
    arrays = [jnp.asarray(a, dtype) for a in (bf(x),)] + [jnp.asarray(weights), jnp.asarray(ids)]
    return arrays + [jnp.asarray(w, dtype) for w in (w_gate, w_up, w_down)]


def _float64(x, weights, ids, w_gate, w_up, w_down, *, round_hidden=None):
    """The routed experts in float64 per assignment; ``round_hidden``: the activations' dtype the
    kernel rounds ``hidden`` to between its launches (None: no rounding)."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    x, weights, w_gate, w_up, w_down = map(f64, (x, weights, w_gate, w_up, w_down))
    ids = np.asarray(ids)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for s, e in enumerate(ids[t]):
            gate, up = x[t] @ w_gate[e], x[t] @ w_up[e]
            hidden = gate / (1.0 + np.exp(-gate)) * up
            if round_hidden is not None:
                hidden = np.asarray(jnp.asarray(hidden, jnp.float32).astype(round_hidden).astype(jnp.float32),
                                    np.float64)
            out[t] += weights[t, s] * (hidden @ w_down[e])
    return out


def _rel(out, ref):
    return float(np.max(np.abs(np.asarray(jnp.asarray(out, jnp.float32), np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("tokens,k", [(1, 6), (3, 2), (2, 4), (5, 4)])
def test_interpreted_kernel_matches_float64(tokens, k):
    problem = _problem(tokens, tokens=tokens, k=k)
    out = grouped_experts(*problem, interpret=True)
    assert out.shape == problem[0].shape and out.dtype == jnp.bfloat16
    # With hidden rounded to bf16 as the kernel rounds it, what is left is float32 sums of
    # <= 256 products (~1e-6 relative) and the bf16 output (2**-9 = 2e-3 of the largest
    # output, relative to the max): 4e-3.
    assert _rel(out, _float64(*problem, round_hidden=jnp.bfloat16)) < 4e-3
    # Against unrounded float64: plus hidden's bf16 rounding (2**-9 relative a value, summed
    # over 128 features with mixed signs), as the jnp path pays it too: 1e-2.
    assert _rel(out, _float64(*problem)) < 1e-2
    assert _rel(grouped_experts_reference(*problem), _float64(*problem)) < 1e-2


@pytest.mark.parametrize("tokens,k,chunk", [(37, 3, 16), (81, 2, 32), (41, 4, 16), (70, 3, 128)])
def test_interpreted_sorted_experts_match_float64(tokens, k, chunk):
    """Sorted into chunks: a hot expert (half the tokens) spans several chunks, the last chunk of
    an expert is partial, and the launches' unused chunks are skipped. The same roundings as the
    gathered launches (hidden to bf16 between them, the bf16 output), so the same bounds."""
    problem = _problem(tokens, tokens=tokens, k=k)
    ids = np.asarray(problem[2]).copy()
    rng, others = np.random.default_rng(tokens), [e for e in range(8) if e != 5]
    for t in range(0, tokens, 2):  # expert 5 in half the tokens
        ids[t] = [5, *rng.choice(others, k - 1, replace=False)]
    problem[2] = jnp.asarray(ids)
    assert (ids == 5).sum() > chunk or chunk == 128  # several chunks of one expert
    out = sorted_experts(*problem, chunk=chunk, interpret=True)
    assert out.shape == problem[0].shape and out.dtype == jnp.bfloat16
    assert _rel(out, _float64(*problem, round_hidden=jnp.bfloat16)) < 4e-3
    assert _rel(out, _float64(*problem)) < 1e-2


def test_sorted_products_skip_assignments_of_weight_zero():
    """An assignment of weight 0 takes no chunk row (another device's expert under expert
    parallelism): the products never see it, and the rest are those of the assignments left.
    float32 products on both sides: only summation order differs (1e-6)."""
    x, weights, ids, *experts = _problem(4, tokens=24, k=3, dtype=jnp.float32)
    zero = jnp.asarray(np.random.default_rng(0).random(weights.shape) < 0.5)
    weights = jnp.where(zero, 0.0, weights)
    seen = []

    def product(stack):
        def run(x, chosen):
            seen.append(np.asarray(chosen))
            return jnp.einsum("gth,gho->gto", x, stack[jnp.maximum(chosen, 0)])
        return run

    chunk = 16
    out = sorted_products(x, weights, ids, lambda x, c: (product(experts[0])(x, c), product(experts[1])(x, c)),
                          product(experts[2]), num_experts=8, chunk=chunk)
    assert _rel(out, _float64(x, weights, ids, *experts)) < 1e-5
    counts = np.bincount(np.asarray(ids)[~np.asarray(zero)], minlength=8)
    used = seen[0][seen[0] >= 0]
    # One chunk an expert for each chunk of rows it has, none for an expert left without rows.
    np.testing.assert_array_equal(np.bincount(used, minlength=8), -(-counts // chunk))
    assert len(seen[0]) == num_chunks(24, 3, 8, chunk)


@pytest.mark.parametrize("tokens, k, zero_share", [(24, 3, 0.0), (37, 6, 0.3), (5, 2, 1.0)])
def test_sorted_chunks_are_the_same_counted_pairwise_or_scattered(tokens, k, zero_share, monkeypatch):
    """The chunks' rows and experts (what the GEMMs see) from the pairwise counts against the
    running sum and scatters (PAIRWISE_MAX_PAIRS 0), and against what they must be: each chunk one
    expert's tokens in token order, an expert's chunks full but its last, unused chunks -1 and
    zero rows; assignments of weight 0 (every one, in the last case) take no row."""
    x, weights, ids, *experts = _problem(tokens, tokens=tokens, k=k, dtype=jnp.float32)
    weights = jnp.where(jnp.asarray(np.random.default_rng(tokens).random(weights.shape) < zero_share), 0.0, weights)
    x = x + jnp.arange(tokens, dtype=jnp.float32)[:, None] * 1000  # a row's token readable from its values
    chunk = 16
    seen = {}

    def run(path):
        def gate_up(rows, chosen):
            seen[path] = (np.asarray(rows), np.asarray(chosen))
            return jnp.zeros((*rows.shape[:2], 128))
        return sorted_products(x, weights, ids, gate_up, lambda h, c: jnp.zeros((*h.shape[:2], 256)),
                               num_experts=8, chunk=chunk)

    run("pairwise")
    monkeypatch.setattr(grouped_experts_module, "PAIRWISE_MAX_PAIRS", 0)
    run("scattered")
    for got in seen["pairwise"], seen["scattered"]:
        rows, chosen = got
        assert len(chosen) == num_chunks(tokens, k, 8, chunk) and rows.shape == (len(chosen), chunk, 256)
        taken, ids_np = np.asarray(weights) != 0, np.asarray(ids)
        for e in range(8):
            want_tokens = [t for t in range(tokens) for s in range(k) if ids_np[t, s] == e and taken[t, s]]
            mine = np.flatnonzero(chosen == e)
            assert len(mine) == -(-len(want_tokens) // chunk)
            got_rows = rows[mine].reshape(-1, 256)[:len(want_tokens)]
            np.testing.assert_array_equal(got_rows, np.asarray(x)[want_tokens])
            assert not rows[mine].reshape(-1, 256)[len(want_tokens):].any()  # the last chunk's rest: zeros
        assert not rows[chosen < 0].any() and set(chosen[chosen >= 0]) <= set(range(8))
    np.testing.assert_array_equal(seen["pairwise"][1], seen["scattered"][1])
    np.testing.assert_array_equal(seen["pairwise"][0], seen["scattered"][0])


@pytest.mark.parametrize("tokens, k, experts, repeats", [(1, 1, 4, False), (37, 6, 64, False), (130, 8, 16, False),
                                                        (29, 4, 6, True), (400, 6, 64, False), (350, 6, 12, True)])
def test_expert_ranks_are_a_stable_sort_s_positions_within_each_expert(tokens, k, experts, repeats):
    """The counted ranks against the positions a stable argsort by expert gives, and the counts
    against a bincount, on fresh routings (pairwise up to PAIRWISE_MAX_PAIRS pairs, a running sum
    over the tokens above: 400 x 6 and 350 x 6):
    distinct experts a token as the router makes them, or ids with repeats within a token and
    assignments that take no row (id ``experts``), which are ranked too (by slot)."""
    rng = np.random.default_rng(tokens * k)
    if repeats:
        expert = rng.integers(0, experts + 1, (tokens, k))
    else:
        expert = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)])
    flat = expert.reshape(-1)
    order = np.argsort(flat, kind="stable")
    want = np.empty_like(flat)
    for e in np.unique(flat):
        want[order[flat[order] == e]] = np.arange(np.sum(flat == e))
    got, counts = expert_ranks(jnp.asarray(expert, jnp.int32), experts)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), want)
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(flat, minlength=experts + 1)[:experts])


@pytest.mark.parametrize("dtype, shape", [(jnp.float8_e4m3fn, (9, 256)), (jnp.bfloat16, (9, 2, 6)),
                                          (jnp.bfloat16, (5, 3)), (jnp.float8_e4m3fn, (7, 6)), (jnp.float32, (4, 5)),
                                          (jnp.int8, (6, 8))])
def test_gather_rows_moves_the_same_bits_as_an_element_gather(dtype, shape):
    """Rows moved as 32-bit words (8- and 16-bit rows of whole words) or as elements (odd widths,
    32-bit values) against numpy's gather of the rows' bytes, with zeros at index N and beyond; the
    rows hold every bit pattern of their width that the random bytes give (NaNs, negative zeros)."""
    rng = np.random.default_rng(sum(shape))
    itemsize = jnp.dtype(dtype).itemsize
    raw = rng.integers(0, 256, (*shape, itemsize), dtype=np.uint8)
    rows = jax.lax.bitcast_convert_type(jnp.asarray(raw), dtype) if itemsize > 1 else jnp.asarray(raw[..., 0]).view(dtype)
    index = rng.integers(0, shape[0] + 3, (3, 4)).astype(np.int32)
    index[0, 0] = shape[0]  # an empty row
    got = gather_rows(rows, jnp.asarray(index))
    assert got.shape == (3, 4, *shape[1:]) and got.dtype == rows.dtype
    as_bytes = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)).reshape(*a.shape, itemsize)
    padded = np.concatenate([as_bytes(rows), np.zeros((3, *shape[1:], itemsize), np.uint8)])
    np.testing.assert_array_equal(as_bytes(got), padded[index])


def test_chunks_hold_the_mean_assignments_with_headroom_and_bound_every_routing():
    assert chunk_rows(1, 6, 64) == 16 and chunk_rows(184, 6, 160) == 16  # 7 a chunk on average
    assert chunk_rows(364, 6, 160) == 32 and chunk_rows(836, 6, 64) == 128  # 14; 78
    assert chunk_rows(100_000, 8, 256) == 128  # one 128-token tile at most
    # The worst routing: every token on the same k experts, T rows each.
    for tokens, k, experts, chunk in [(37, 3, 8, 16), (5, 2, 64, 16), (300, 6, 16, 128)]:
        worst = k * -(-tokens // chunk)
        spread = (tokens * k) // chunk + min(experts, tokens * k)
        assert worst <= num_chunks(tokens, k, experts, chunk) and spread >= num_chunks(tokens, k, experts, chunk)


def test_takes_bf16_stacks_of_whole_tiles_only():
    x, _, _, w_gate, w_up, w_down = _problem(0, tokens=2, k=2)
    assert takes(2, w_gate, w_up, w_down)
    assert not takes(2, w_gate.astype(jnp.float32), w_up, w_down)
    assert not takes(65, w_gate, w_up, w_down)  # more tokens than one token tile: not a decode step's
    narrow = _problem(0, tokens=2, k=2, hidden=96, inner=80)
    assert not takes(2, *narrow[3:])
    assert sorted_takes(128, w_gate, w_up, w_down) and sorted_takes(16, w_gate, w_up, w_down)
    assert not sorted_takes(20, w_gate, w_up, w_down)  # not a whole token tile
    assert not sorted_takes(16, *narrow[3:]) and not sorted_takes(16, w_gate, w_up, w_down.astype(jnp.float32))


def test_out_of_range_ids_are_clipped_not_read_past_the_weights():
    """A traced id cannot be checked: ids outside [0, E) read expert 0 or E - 1, as clipped ids do."""
    x, weights, ids, *experts = _problem(3, tokens=2, k=3)
    bad = ids.at[0, 1].set(8 + 5).at[1, 2].set(-3)
    run = jax.jit(lambda ids: grouped_experts(x, weights, ids, *experts, interpret=True))
    np.testing.assert_array_equal(run(bad), run(jnp.clip(bad, 0, 7)))


@pytest.mark.parametrize("change,name", [
    (lambda p: p.__setitem__(2, p[2].astype(jnp.int16)), "ids"),
    (lambda p: p.__setitem__(1, p[1][:, :1]), "weights / ids"),
    (lambda p: p.__setitem__(5, p[5][:, :, :8]), "w_gate / w_up / w_down"),
    (lambda p: p.__setitem__(3, p[3].astype(jnp.float32)), "bf16 stacks"),
])
def test_bad_input_raises_value_error_naming_the_argument(change, name):
    problem = _problem(0, tokens=2, k=2)
    change(problem)
    with pytest.raises(ValueError, match=name):
        grouped_experts(*problem, interpret=True)


def test_kernels_lower_for_cuda_at_model_shapes():
    """Both launches lower through Mosaic GPU at V2-Lite's and V3's expert shapes (T = 1, 4),
    without a GPU."""
    for experts, hidden, inner, k in [(64, 2048, 1408, 6), (256, 7168, 2048, 8)]:
        for tokens in (1, 4):
            args = (jnp.zeros((tokens, hidden), jnp.bfloat16), jnp.ones((tokens, k), jnp.float32),
                    jnp.zeros((tokens, k), jnp.int32),
                    jax.ShapeDtypeStruct((experts, hidden, inner), jnp.bfloat16),
                    jax.ShapeDtypeStruct((experts, hidden, inner), jnp.bfloat16),
                    jax.ShapeDtypeStruct((experts, inner, hidden), jnp.bfloat16))
            lower_for_cuda(lambda *a: grouped_experts(*a), *args)


def _moe_layer(dtype, hidden=256, inner=128):
    from snapmla_jax.models.config import MLAConfig
    cfg = MLAConfig(vocab_size=16, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                    n_routed_experts=8, moe_intermediate_size=inner, num_experts_per_tok=3, n_shared_experts=1,
                    topk_method="greedy", scoring_func="softmax")
    layer = models.moe.MoE(cfg, dtype=dtype, rngs=nnx.Rngs(0))
    models.moe.set_gather_max_tokens(layer, 4)
    return layer


@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_gathered_dispatch_through_the_kernel_matches_jnp(monkeypatch, tokens):
    """``MoE(x, backend="interpret")`` runs its gathered dispatch through ``grouped_experts`` (a
    bf16 layer of the shapes it takes; checked by making the jnp reference unreachable from it) and
    matches the jnp dispatch (backend "xla"), which rounds each assignment's products to bf16
    where the kernel keeps float32 until hidden: bf16 roundings of the output and of hidden
    (2**-9 each, relative), 1e-2 of the output scale."""
    layer = _moe_layer(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(tokens), (1, tokens, 256), jnp.float32).astype(jnp.bfloat16)
    want = layer(x, backend="xla")
    monkeypatch.setattr(snapmla_jax.models.moe, "grouped_experts_reference", None)
    got = layer(x, backend="interpret")
    assert _rel(got, np.asarray(jnp.asarray(want, jnp.float32), np.float64)) < 1e-2


def test_moe_sorted_dispatch_through_the_kernel_matches_jnp(monkeypatch):
    """From ``sorted_min_tokens`` on, where dense would run, a bf16 layer the grouped GEMM takes
    runs sorted with backend "interpret" (checked by making the dense path unreachable) and keeps
    dense with "xla"; the two agree within the bf16 roundings of hidden and of the output (1e-2)."""
    layer = _moe_layer(jnp.bfloat16)
    models.moe.set_dense_token_range(layer, (1, 64))
    tokens = 40
    assert layer.sorted_min_tokens == models.moe.SORTED_MIN_TOKENS == 160  # the default
    assert layer.dispatch(tokens, "interpret") == "dense"
    assert models.moe.set_sorted_min_tokens(layer, None) == 1  # never
    assert layer.dispatch(tokens, "interpret") == "dense"
    assert models.moe.set_sorted_min_tokens(layer, tokens + 1) == 1
    assert layer.dispatch(tokens, "interpret") == "dense"
    models.moe.set_sorted_min_tokens(layer, 16)
    assert layer.dispatch(tokens, "interpret") == "sorted" and layer.dispatch(tokens, "xla") == "dense"
    _assert_interpreted_matches_jnp(layer, tokens, monkeypatch, unreachable="_dense_experts")


def _assert_interpreted_matches_jnp(layer, tokens: int, monkeypatch, *, unreachable: str) -> None:
    """``layer`` on [2, tokens / 2, 256] bf16 inputs with backend "interpret", its method
    ``unreachable`` made so, against backend "xla": within the bf16 roundings of hidden and of
    the output (1e-2)."""
    x = jax.random.normal(jax.random.key(tokens), (2, tokens // 2, 256), jnp.float32).astype(jnp.bfloat16)
    want = layer(x, backend="xla")
    monkeypatch.setattr(models.moe.MoE, unreachable, None)
    got = layer(x, backend="interpret")
    assert _rel(got, np.asarray(jnp.asarray(want, jnp.float32), np.float64)) < 1e-2


def test_moe_sorted_dispatch_replaces_ragged_above_the_dense_range(monkeypatch):
    """A call above ``dense_token_range`` (a prompt's prefill) runs sorted where its GEMMs run
    (checked by making the ragged path unreachable), ragged with "xla" or with sorted off; the two
    agree within the bf16 roundings of hidden and of the output (1e-2)."""
    layer = _moe_layer(jnp.bfloat16)
    models.moe.set_dense_token_range(layer, (1, 16))
    models.moe.set_sorted_min_tokens(layer, 16)
    tokens = 40
    assert layer.dispatch(tokens, "interpret") == "sorted" and layer.dispatch(tokens, "xla") == "ragged"
    models.moe.set_sorted_min_tokens(layer, None)
    assert layer.dispatch(tokens, "interpret") == "ragged"
    models.moe.set_sorted_min_tokens(layer, 16)
    _assert_interpreted_matches_jnp(layer, tokens, monkeypatch, unreachable="_ragged_experts")


def test_moe_sorted_dispatch_runs_long_calls_in_blocks(monkeypatch):
    """Above ``SORTED_BLOCK_TOKENS`` the sorted dispatch runs blocks of that many tokens in a loop
    (the last one padded with tokens of gate weight 0), bounding its float32 temporaries; the
    result agrees with the jnp dispatch within the bf16 roundings of hidden and of the output (1e-2),
    as one block does."""
    layer = _moe_layer(jnp.bfloat16)
    models.moe.set_dense_token_range(layer, (1, 16))
    models.moe.set_sorted_min_tokens(layer, 16)
    tokens = 40
    x = jax.random.normal(jax.random.key(3), (2, tokens // 2, 256), jnp.float32).astype(jnp.bfloat16)
    want = np.asarray(jnp.asarray(layer(x, backend="xla"), jnp.float32), np.float64)
    launched = []  # the token count of each sorted launch as it is traced
    sorted_experts = models.moe.sorted_experts

    def recorded(flat, *args, **kwargs):
        launched.append(flat.shape[0])
        return sorted_experts(flat, *args, **kwargs)

    monkeypatch.setattr(models.moe, "sorted_experts", recorded)
    jax.make_jaxpr(lambda x: layer(x, backend="interpret"))(x)
    assert launched == [tokens]
    monkeypatch.setattr(models.moe, "SORTED_BLOCK_TOKENS", 16)  # three blocks, the last 8 tokens short
    launched.clear()
    got = layer(x, backend="interpret")
    assert launched == [16]  # traced once, run by the loop for each block
    assert _rel(got, want) < 1e-2


@pytest.mark.gpu
def test_compiled_prefill_runs_sorted_blocks_at_v2_lite_shapes():
    """A prompt's prefill at V2-Lite's MoE shapes with the model's defaults on a GPU: more tokens
    than ``SORTED_BLOCK_TOKENS`` (two blocks, the second mostly padding) run the sorted dispatch,
    and agree with ragged_dot (backend "xla") within the bf16 roundings of hidden and of the
    output (1e-2)."""
    from snapmla_jax.capacity import MODEL_SHAPES
    layer = models.moe.MoE(MODEL_SHAPES["v2-lite"], dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    tokens = models.moe.SORTED_BLOCK_TOKENS + 200
    assert layer.dispatch(tokens, "pallas") == "sorted" and layer.dispatch(tokens, "xla") == "ragged"
    x = jax.random.normal(jax.random.key(5), (1, tokens, layer.cfg.hidden_size), jnp.bfloat16)
    graphdef, state = nnx.split(layer)
    call = jax.jit(lambda state, x, backend: nnx.merge(graphdef, state)(x, backend=backend), static_argnames="backend")
    want = np.asarray(jnp.asarray(call(state, x, "xla"), jnp.float32), np.float64)
    got = call(state, x, "pallas")
    assert _rel(got, want) < 1e-2 and np.abs(want).max() > 0


@pytest.mark.parametrize("shape, default", [("v2-lite", 160), ("v2", 16), ("v3", 16)])
def test_the_sorted_default_starts_earlier_for_large_experts(shape, default, monkeypatch):
    """V2-Lite's experts (8.7M parameters) run sorted from SORTED_MIN_TOKENS tokens, V2's (23.6M)
    and V3's (44M) from SORTED_MIN_TOKENS_LARGE_EXPERTS; a library default of None stays None."""
    from snapmla_jax.capacity import MODEL_SHAPES
    cfg = MODEL_SHAPES[shape]
    assert models.moe.default_sorted_min_tokens(cfg) == default
    monkeypatch.setattr(models.moe, "SORTED_MIN_TOKENS", None)
    assert models.moe.default_sorted_min_tokens(cfg) is None


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "16"])
def test_set_sorted_min_tokens_refuses_what_is_not_none_or_a_positive_int(bad):
    with pytest.raises(ValueError, match="sorted_min_tokens: expected None or an int >= 1"):
        models.moe.set_sorted_min_tokens(_moe_layer(jnp.bfloat16), bad)


def test_moe_gathered_dispatch_falls_back_to_jnp_where_the_kernel_does_not_take_the_stacks():
    """float32 stacks, and hidden / inner not multiples of 128: the gathered dispatch runs the jnp
    reference with backend "interpret" too, to float32 summation order of the "xla" one."""
    for dtype, hidden, inner in [(jnp.float32, 256, 128), (jnp.bfloat16, 96, 80)]:
        layer = _moe_layer(dtype, hidden, inner)
        x = jax.random.normal(jax.random.key(0), (1, 3, hidden), jnp.float32).astype(dtype)
        with jax.default_matmul_precision("float32"):
            want, got = layer(x, backend="xla"), layer(x, backend="interpret")
        assert _rel(got, np.asarray(jnp.asarray(want, jnp.float32), np.float64)) < 1e-5


def _v2_lite_problem(tokens):
    """The routed experts of ``tokens`` tokens at V2-Lite's expert shapes (64 experts, 6 a token)."""
    rng = np.random.default_rng(tokens)
    experts, hidden, inner, k = 64, 2048, 1408, 6
    w = lambda *shape: jnp.asarray(rng.standard_normal(shape) * 0.02, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.random((tokens, k)) + 0.1, jnp.float32)
    return x, weights, ids, w(experts, hidden, inner), w(experts, hidden, inner), w(experts, inner, hidden)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3])
def test_compiled_kernel_matches_float64_at_v2_lite_shapes(tokens):
    """Compiled, at V2-Lite's expert shapes (2048-term sums: float32 order ~1e-6), against float64
    with hidden rounded as the kernel rounds it (bounds as in the interpreter test), and against
    the jnp path (which rounds each assignment's output to bf16 too: 1e-2)."""
    problem = _v2_lite_problem(tokens)
    compiled = grouped_experts(*problem)
    assert _rel(compiled, _float64(*problem, round_hidden=jnp.bfloat16)) < 4e-3  # as the interpreter test
    assert _rel(compiled, np.asarray(jnp.asarray(grouped_experts_reference(*problem), jnp.float32), np.float64)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [40, 836])
def test_compiled_sorted_experts_match_float64_at_v2_lite_shapes(tokens):
    """Compiled at V2-Lite's expert shapes and the chunk the MoE picks (16 and 128 rows; at 836
    tokens 103 launched, about 64 used, the rest skipped): bounds as in the interpreter test."""
    problem = _v2_lite_problem(tokens)
    out = sorted_experts(*problem, chunk=chunk_rows(tokens, 6, 64))
    assert _rel(out, _by_expert_float32(*problem)) < 1e-2


def _by_expert_float32(x, weights, ids, w_gate, w_up, w_down):
    """The routed experts in float32 (HIGHEST: sums of exact bf16 products, ~1e-6 relative), one
    expert at a time on its tokens: at 836 tokens x 6 the per-assignment gathers of
    ``grouped_experts_reference`` would copy 58 GB of weights a stack. Each expert's tokens are
    padded to the most any expert has (weight 0 on row 0), so that one compiled step serves every
    expert: eager ops on each expert's own row count compiled anew for every count."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    ids, weights = np.asarray(ids), np.asarray(weights, np.float32)
    experts = np.unique(ids)
    assigned = [np.nonzero(ids == e) for e in experts]
    rows = np.zeros((len(experts), max(len(t) for t, _ in assigned)), np.int32)
    row_weights = np.zeros(rows.shape, np.float32)
    for i, (tokens, slots) in enumerate(assigned):
        rows[i, :len(tokens)], row_weights[i, :len(tokens)] = tokens, weights[tokens, slots]

    @jax.jit
    def run(x, rows, row_weights, experts, w_gate, w_up, w_down):
        def one_expert(out, step):
            tokens, token_weights, e = step
            xs = f32(x)[tokens]
            hidden = jax.nn.silu(xs @ f32(w_gate[e])) * (xs @ f32(w_up[e]))
            return out.at[tokens].add(token_weights[:, None] * (hidden @ f32(w_down[e]))), None
        return jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32), (rows, row_weights, experts))[0]

    with jax.default_matmul_precision("highest"):
        return np.asarray(run(x, rows, row_weights, jnp.asarray(experts, jnp.int32), w_gate, w_up, w_down), np.float64)


def test_the_by_expert_reference_is_the_per_assignment_one():
    """The compiled test's reference against the float64 per-assignment one (hidden unrounded):
    float32 sums of 256 terms, 1e-5."""
    problem = _problem(9, tokens=11, k=3)
    assert _rel(_by_expert_float32(*problem), _float64(*problem)) < 1e-5

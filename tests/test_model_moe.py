"""The dropless MoE layer against a float64 per-token reference, for each routing method."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import snapmla_jax.models.moe

from snapmla_jax import models
from cpu_devices import run_with_cpu_devices
from snapmla_jax.models.config import MLAConfig
from snapmla_jax.models.moe import MoE

HIDDEN, INNER, EXPERTS, TOKENS = 48, 24, 8, 40


@pytest.fixture(autouse=True)
def float32_matmuls():
    """The float32 thresholds below assume float32 products. On a GPU, JAX's default float32
    matmul is TF32 (10 mantissa bits: 1e-4 to 5e-4 relative errors, which failed these tests
    on an H100); on the CPU this changes nothing."""
    with jax.default_matmul_precision("float32"):
        yield


def make_cfg(topk_method: str, scoring_func: str, **extra) -> MLAConfig:
    return MLAConfig(vocab_size=16, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                     n_routed_experts=EXPERTS, moe_intermediate_size=INNER, topk_method=topk_method,
                     scoring_func=scoring_func, **extra)


def randomize(moe: MoE, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh float32 weights (router wide enough that top-k choices are far from ties); returns them."""
    weights = {
        "router": rng.standard_normal((HIDDEN, EXPERTS)) * 2 / np.sqrt(HIDDEN),
        "w_gate": rng.standard_normal((EXPERTS, HIDDEN, INNER)) / np.sqrt(HIDDEN),
        "w_up": rng.standard_normal((EXPERTS, HIDDEN, INNER)) / np.sqrt(HIDDEN),
        "w_down": rng.standard_normal((EXPERTS, INNER, HIDDEN)) / np.sqrt(INNER),
        "bias": 0.3 * rng.standard_normal(EXPERTS),
    }
    weights = {k: v.astype(np.float32) for k, v in weights.items()}
    moe.gate.kernel.set_value(jnp.asarray(weights["router"]))
    for name in ("w_gate", "w_up", "w_down"):
        getattr(moe, name).set_value(jnp.asarray(weights[name]))
    if hasattr(moe.gate, "e_score_correction_bias"):
        moe.gate.e_score_correction_bias.set_value(jnp.asarray(weights["bias"]))
    if moe.shared_experts is not None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            kernel = getattr(moe.shared_experts, proj).kernel
            value = rng.standard_normal(kernel.shape) / np.sqrt(kernel.shape[0])
            kernel.set_value(jnp.asarray(value, jnp.float32))
    return weights


def silu(x):
    return x / (1 + np.exp(-x))


def reference_moe(x: np.ndarray, w: dict, cfg: MLAConfig, shared) -> np.ndarray:
    """float64, token by token, written from DeepSeek's routing description."""
    x = x.astype(np.float64)
    logits = x @ w["router"].astype(np.float64)
    if cfg.scoring_func == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        if cfg.topk_method == "greedy":
            chosen = np.argsort(-scores[t])[:cfg.num_experts_per_tok]
        else:
            choice = scores[t] + (w["bias"] if cfg.topk_method == "noaux_tc" else 0.0)
            groups = choice.reshape(cfg.n_group, -1)
            group_score = (np.sort(groups, axis=1)[:, -2:].sum(1) if cfg.topk_method == "noaux_tc"
                           else groups.max(1))
            allowed = np.argsort(-group_score)[:cfg.topk_group]
            masked = np.full_like(groups, -np.inf)
            masked[allowed] = groups[allowed]
            chosen = np.argsort(-masked.reshape(-1))[:cfg.num_experts_per_tok]
        gates = scores[t, chosen]
        if cfg.norm_topk_prob:
            gates = gates / gates.sum()
        gates = gates * cfg.routed_scaling_factor
        for gate, e in zip(gates, chosen):
            h = silu(x[t] @ w["w_gate"][e]) * (x[t] @ w["w_up"][e])
            out[t] += gate * (h @ w["w_down"][e])
    if shared is not None:
        k = lambda proj: np.asarray(getattr(shared, proj).kernel[...], np.float64)
        out += (silu(x @ k("gate_proj")) * (x @ k("up_proj"))) @ k("down_proj")
    return out


ROUTINGS = {
    "v2_lite_greedy_softmax": dict(topk_method="greedy", scoring_func="softmax", num_experts_per_tok=2,
                                   n_shared_experts=2),
    "v2_group_limited": dict(topk_method="group_limited_greedy", scoring_func="softmax", num_experts_per_tok=3,
                             n_group=4, topk_group=2, routed_scaling_factor=16.0, n_shared_experts=1),
    "v3_noaux_tc_sigmoid": dict(topk_method="noaux_tc", scoring_func="sigmoid", num_experts_per_tok=2, n_group=4,
                                topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, n_shared_experts=1),
    "greedy_no_shared": dict(topk_method="greedy", scoring_func="sigmoid", num_experts_per_tok=1),
}


# (MoE.dense_token_range, MoE.gather_max_tokens) per dispatch: every token count ragged,
# dense, or gathered.
DISPATCHES = {"ragged": (None, 0), "dense": ((1, 1 << 30), 0), "gathered": (None, 1 << 30)}


def set_dispatch(model, dispatch: str) -> int:
    token_range, gather_max = DISPATCHES[dispatch]
    models.moe.set_gather_max_tokens(model, gather_max)
    return models.moe.set_dense_token_range(model, token_range)


@pytest.mark.parametrize("dispatch", sorted(DISPATCHES))
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_moe_matches_float64_per_token_reference(routing, dispatch):
    cfg = make_cfg(**ROUTINGS[routing])
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert set_dispatch(moe, dispatch) == 1
    rng = np.random.default_rng(len(routing))
    weights = randomize(moe, rng)
    x = rng.standard_normal((2, TOKENS // 2, HIDDEN)).astype(np.float32)
    # An outlier token. Not larger: float32 sigmoid rounds logits above ~17 to
    # exactly 1.0, and ties between experts have no defined winner.
    x[0, 3] *= 4.0
    got = np.asarray(jax.jit(lambda m, v: m(v))(moe, jnp.asarray(x)), np.float64).reshape(TOKENS, HIDDEN)
    want = reference_moe(x.reshape(TOKENS, HIDDEN), weights, cfg, moe.shared_experts)
    # float32 products over <= 48-term sums and a k-term gate mix: ~1e-6 relative;
    # a wrong expert or gate would be off by O(1).
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-5, f"relative error {err:.2e}"


def moe_jaxpr(num_tokens: int, token_range=None, gather_max: int = 0) -> str:
    cfg = make_cfg(**ROUTINGS["v3_noaux_tc_sigmoid"])
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    models.moe.set_dense_token_range(moe, token_range)
    models.moe.set_gather_max_tokens(moe, gather_max)
    return str(jax.make_jaxpr(lambda v: moe(v))(jnp.ones((1, num_tokens, HIDDEN), jnp.float32)))


def test_new_layers_take_the_library_default_and_none_is_ragged():
    cfg = make_cfg(**ROUTINGS["v3_noaux_tc_sigmoid"])
    layer = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert layer.dense_token_range == models.moe.DENSE_TOKEN_RANGE
    assert layer.gather_max_tokens == models.moe.GATHER_MAX_TOKENS
    jaxpr = moe_jaxpr(TOKENS, None)
    # gate, up and down each one grouped product over the T*k sorted assignments
    # (80 rows = 40 tokens x top-2), never an all-experts product.
    assert jaxpr.count("= ragged_dot_general[") == 3
    assert f"f32[{TOKENS * 2},{HIDDEN}] = ragged_dot_general[" in jaxpr


@pytest.mark.parametrize("num_tokens, dense", [(7, False), (8, True), (16, True), (17, False)])
def test_moe_runs_dense_inside_the_token_range_only(num_tokens, dense):
    jaxpr = moe_jaxpr(num_tokens, (8, 16))  # inclusive at both ends
    assert ("ragged_dot_general" not in jaxpr) == dense
    # Dense: gate and up as products of every expert on every token, [E, T, I] each.
    assert jaxpr.count(f"f32[{EXPERTS},{num_tokens},{INNER}] = dot_general[") == (2 if dense else 0)


@pytest.mark.parametrize("num_tokens, gathered", [(2, True), (3, True), (4, False)])
def test_moe_gathers_the_chosen_experts_up_to_gather_max_tokens(num_tokens, gathered):
    # Checked before the dense range: with both covering T, gathered wins.
    jaxpr = moe_jaxpr(num_tokens, (1, 1 << 30), gather_max=3)
    # Gathered: each of gate, up, down a [T*k, ...] copy of the chosen experts' matrices.
    copies = jaxpr.count(f"f32[{num_tokens * 2},{HIDDEN},{INNER}] = gather[")
    assert copies == (2 if gathered else 0)
    assert jaxpr.count(f"f32[{num_tokens * 2},{INNER},{HIDDEN}] = gather[") == (1 if gathered else 0)
    assert (f"f32[{EXPERTS},{num_tokens},{INNER}] = dot_general[" in jaxpr) == (not gathered)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_a_bad_gather_max_tokens_is_refused(bad):
    moe = MoE(make_cfg(**ROUTINGS["greedy_no_shared"]), dtype=jnp.float32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="gather_max_tokens"):
        models.moe.set_gather_max_tokens(moe, bad)
    assert moe.gather_max_tokens == models.moe.GATHER_MAX_TOKENS


def test_a_changed_token_range_compiles_a_new_program():
    # The dispatch is part of the graphdef, so a jit with the graphdef static (as generate
    # and the benchmarks call the model) traces again when it changes; a switch read at trace
    # time instead once handed the second program the first one's dispatch.
    cfg = make_cfg(**ROUTINGS["v3_noaux_tc_sigmoid"])
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    call = jax.jit(lambda state, x, graphdef: nnx.merge(graphdef, state)(x), static_argnames="graphdef")
    x = jnp.ones((TOKENS, HIDDEN), jnp.float32)
    texts = {}
    for name, token_range in (("ragged", None), ("dense", (1, 1 << 30)), ("ragged_again", None)):
        models.moe.set_dense_token_range(moe, token_range)
        graphdef, state = nnx.split(moe)
        texts[name] = str(call.trace(state, x, graphdef=graphdef).jaxpr)
    assert "ragged_dot_general" in texts["ragged"] and "ragged_dot_general" not in texts["dense"]
    assert texts["ragged_again"] == texts["ragged"]


@pytest.mark.parametrize("token_range", [(0, 4), (5, 4), (1,), "dense", (1.5, "x")])
def test_a_bad_token_range_is_refused(token_range):
    moe = MoE(make_cfg(**ROUTINGS["greedy_no_shared"]), dtype=jnp.float32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dense_token_range"):
        models.moe.set_dense_token_range(moe, token_range)
    assert moe.dense_token_range == models.moe.DENSE_TOKEN_RANGE  # unchanged


@pytest.mark.parametrize("dispatch", sorted(DISPATCHES))
def test_moe_in_bfloat16_stays_within_bfloat16_rounding(dispatch):
    cfg = make_cfg(**ROUTINGS["v3_noaux_tc_sigmoid"])
    moe = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    set_dispatch(moe, dispatch)
    rng = np.random.default_rng(11)
    weights = randomize(moe, rng)
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    # The same weights rounded to bf16 (the router computes in float32 from them either way).
    nnx.update(moe, jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 and a.ndim > 1 else a,
                                 nnx.state(moe, nnx.Param)))
    rounded = {k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16), np.float32) if v.ndim > 1 else v
               for k, v in weights.items()}
    want = reference_moe(x, rounded, cfg, moe.shared_experts)
    got = np.asarray(jax.jit(lambda m, v: m(v))(moe, jnp.asarray(x, jnp.bfloat16)), np.float64)
    # Input and weights are bf16 in both; the layer then rounds activations to bf16 (2**-9
    # relative) two or three times per term: measured 4.9e-3 (dense) and 5.2e-3 (ragged) rms
    # relative. 2e-2 still fails on a dropped or doubled expert or a lost gate weight (O(1)).
    rms = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))
    assert rms <= 2e-2, f"{dispatch}: rms relative error {rms:.2e}"


EXPERT_PARALLEL_HLO = """
import json, re, jax, jax.numpy as jnp, numpy as np
from flax import nnx
import snapmla_jax.models.moe
from snapmla_jax import models
from snapmla_jax.models.config import MLAConfig
from snapmla_jax.models.moe import MoE
from snapmla_jax.models.sharding import expert_sharding, shard_model
cfg = MLAConfig(vocab_size=16, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128)
fresh = MoE(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
models.moe.set_gather_max_tokens(fresh, 16)
layer = shard_model(fresh, expert_sharding())
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
replicated = shard_model(fresh, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
x = jax.random.normal(jax.random.key(0), (8, 64), jnp.float32)
out = {"gather_max": [fresh.gather_max_tokens, layer.gather_max_tokens, replicated.gather_max_tokens]}
for name, token_range in (("ragged", None), ("dense", (1, 1 << 30))):
    models.moe.set_dense_token_range(layer, token_range)
    graphdef, state = nnx.split(layer)
    hlo = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x).compile().as_text()
    shapes = re.findall(r"= \\w+\\[([\\d,]*)\\]\\S* (?:all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)", hlo)
    out[name] = [int(np.prod([int(d) for d in s.split(",") if d])) for s in shapes]
print(json.dumps(out))
"""


def test_expert_parallel_moe_never_gathers_expert_weights():
    # Experts split over two CPU devices (expert_sharding), tokens replicated: XLA's partitioner
    # must keep each device on its own experts and exchange only activations, in both
    # dispatches. A gathered expert stack would be a collective of >= one expert matrix.
    result = run_with_cpu_devices(2, ["-c", EXPERT_PARALLEL_HLO])
    assert result.returncode == 0, result.stderr[-3000:]
    sizes = json.loads(result.stdout.strip().splitlines()[-1])
    # The placement turned the gathered dispatch off where the experts were split (it would
    # copy expert weights between devices), not where they were replicated, nor in the original.
    assert sizes.pop("gather_max") == [16, 0, 16]
    one_expert_matrix = 64 * 128
    for name in ("ragged", "dense"):
        assert sizes[name], f"{name}: no collective at all: the experts were not split"
        assert max(sizes[name]) < one_expert_matrix, (name, sizes[name])


@pytest.mark.parametrize("num_tokens, want", [(1, "gathered"), (2, "gathered"), (3, "ragged"), (4, "dense"),
                                              (9, "dense"), (10, "ragged")])
def test_choose_dispatch_checks_gathered_first_then_the_inclusive_dense_range(num_tokens, want):
    # The one rule MoE.__call__ and the e2e benchmark's weight-byte count both use.
    assert models.moe.choose_dispatch(num_tokens, (4, 9), 2) == want
    assert models.moe.choose_dispatch(num_tokens, None, 0) == "ragged"

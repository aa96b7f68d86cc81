"""The FP8 fidelity tool: its metrics against hand-computed values, and the CLI on a tiny trained model."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cli_checks import assert_usage_error, tree_snapshot
from snapmla_jax.models import MLAModel, save_checkpoint
from snapmla_jax import byte_corpus as bc
from snapmla_jax import fidelity
from snapmla_jax import train_demo as td


@pytest.fixture(scope="module")
def tiny_model():
    return MLAModel(td.tiny_config(), rngs=nnx.Rngs(3), dtype=jnp.float32)


@pytest.fixture(scope="module")
def windows():
    rng = np.random.default_rng(0)
    out = rng.integers(0, bc.NUM_BYTES, size=(2, 65)).astype(np.int32)
    out[:, 0] = bc.BOS_ID
    out[0, 40] = bc.EOS_ID
    return out


def test_layer_error_of_a_scaled_copy_is_the_scale_and_cosine_one():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((3, 5, 2, 64))
    err = fidelity.layer_error(7, ref * 1.01, ref)
    assert err.layer == 7
    assert err.cosine_mean == pytest.approx(1.0, abs=1e-12) and err.cosine_p01 == pytest.approx(1.0, abs=1e-12)
    assert err.rel_error == pytest.approx(0.01, rel=1e-9)


def test_layer_error_sees_orthogonal_vectors():
    ref = np.zeros((4, 8))
    ref[:, 0] = 1.0
    test = np.zeros((4, 8))
    test[:, 1] = 1.0
    err = fidelity.layer_error(0, test, ref)
    assert err.cosine_mean == pytest.approx(0.0, abs=1e-12) and err.rel_error == pytest.approx(2**0.5)


def test_bits_per_byte_is_eight_for_uniform_bytes_and_skips_specials():
    logprobs = np.full((1, 4, bc.VOCAB_SIZE), -np.inf, np.float32)
    logprobs[..., :256] = -np.log(256.0)
    logprobs[0, 3, bc.EOS_ID] = 0.0
    targets = np.array([[1, 2, 3, bc.EOS_ID]])
    assert fidelity.bits_per_byte_from_logprobs(logprobs, targets) == pytest.approx(8.0, rel=1e-6)


def test_spread_windows_cover_the_stream_evenly():
    stream = np.arange(1000, dtype=np.int32)
    windows = fidelity.spread_windows(stream, 9, 4)
    assert windows[:, 0].tolist() == [0, 330, 660, 990] and windows[-1, -1] == 999
    np.testing.assert_array_equal(np.diff(windows, axis=1), 1)
    with pytest.raises(ValueError, match="stream"):
        fidelity.spread_windows(stream[:30], 9, 4)


def test_mean_kl_is_zero_for_equal_and_matches_hand_value():
    ref = np.log(np.array([[[0.5, 0.5]]]))
    test = np.log(np.array([[[0.25, 0.75]]]))
    assert fidelity.mean_kl(ref, ref) == 0.0
    assert fidelity.mean_kl(ref, test) == pytest.approx(0.5 * np.log(2.0) + 0.5 * np.log(0.5 / 0.75), rel=1e-12)


def test_bf16_cache_decode_reproduces_the_full_forward(tiny_model, windows):
    run = fidelity.teacher_forced_decode(tiny_model, windows, "bf16", chunk=16, backend="xla")
    full = np.asarray(jax.nn.log_softmax(tiny_model(jnp.asarray(windows[:, :-1])), axis=-1))
    # The model is float32; decode's BF16 path rounds the query, the cached latent and RoPE key and
    # the probabilities to bf16 (relative 2**-9 each) in every layer. On this model that moves a
    # log-probability by 3e-3 on average and 4e-2 at worst; the bounds leave 3x margin, while a
    # harness that fed wrong positions, pages or lengths shifts every position's distribution.
    diff = np.abs(run.logprobs - full)
    assert diff.mean() < 1e-2 and diff.max() < 0.1
    assert len(run.attn) == td.tiny_config().num_hidden_layers
    assert run.attn[0].shape == (2, 64, td.tiny_config().num_attention_heads, td.tiny_config().kv_lora_rank)


def test_cache_read_back_holds_the_models_latents(tiny_model, windows):
    run = fidelity.teacher_forced_decode(tiny_model, windows, "bf16", chunk=32, backend="xla")
    inputs = jnp.asarray(windows[:, :-1])
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
    layer0 = tiny_model.layers[0]
    c_kv, k_pe = layer0.self_attn.latents(layer0.input_layernorm(tiny_model.embed_tokens(inputs)), positions)
    # The cache stores bf16: equal up to one bf16 rounding (relative 2**-8 bounds it, 2**-9 typical).
    np.testing.assert_allclose(run.latents[0], np.asarray(c_kv).reshape(-1, c_kv.shape[-1]), rtol=2**-8, atol=1e-6)
    np.testing.assert_allclose(run.ropes[0], np.asarray(k_pe).reshape(-1, k_pe.shape[-1]), rtol=2**-8, atol=1e-6)


def test_teacher_forced_decode_rejects_a_chunk_that_does_not_divide(tiny_model, windows):
    with pytest.raises(ValueError, match="chunk"):
        fidelity.teacher_forced_decode(tiny_model, windows, "fp8", chunk=24, backend="xla")


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("fidelity")
    model_dir = root / "model"
    # A train_demo directory as the trainer writes one (tests/test_train_demo.py runs the trainer's
    # CLI): the tiny model in bf16, with the held-out list of the default split. Untrained, as the
    # trainer's few steps would leave it: near-uniform predictions.
    save_checkpoint(td.cast_model(tiny_model, jnp.bfloat16), model_dir)
    bc.write_file_list(model_dir / fidelity.HELDOUT_LIST, bc.split_files().heldout_files,
                       heldout_fraction=bc.DEFAULT_HELDOUT_FRACTION)
    paths = {"json": root / "f.json", "markdown": root / "f.md", "plot": root / "f.png",
             "plot-ablation": root / "a.png"}
    assert fidelity.main(["--model", str(model_dir), "--windows", "2", "--seq-len", "64", "--chunk", "32",
                          "--prompts", "2", "--prompt-bytes", "16", "--gen-tokens", "8", "--backend", "xla",
                          *[f"--{k}={v}" for k, v in paths.items()]]) == 0
    return json.loads(paths["json"].read_text()), paths


def test_cli_reports_fp8_close_to_bf16_on_a_tiny_model(cli_results):
    results, _ = cli_results
    bpb = results["bits_per_byte"]
    # A near-untrained model predicts ~uniformly (~8 bits); the FP8 pipeline's per-element error
    # (~2**-4 relative) changes its logits far too little to move that by 1%.
    assert abs(bpb["fp8_cache"] / bpb["bf16_cache"] - 1) < 0.01
    assert abs(bpb["full_forward"] / bpb["bf16_cache"] - 1) < 0.01
    assert results["fp8_minus_bf16_bits_per_byte"] == pytest.approx(bpb["fp8_cache"] - bpb["bf16_cache"], abs=1e-9)
    assert results["fp8_minus_bf16_standard_error"] > 0 and results["kl_bf16_from_full_nats_mean"] >= 0
    assert [r["layer"] for r in results["layers"]] == [0, 1]
    assert all(0.99 < r["cosine_mean"] <= 1.0 + 1e-12 for r in results["layers"])
    greedy = results["greedy"]
    assert greedy["num_prompts"] == 2 and len(greedy["agreeing_prefix"]) == len(greedy["control_f32_agreeing_prefix"]) == 2
    assert all(0 <= n <= 8 for n in greedy["agreeing_prefix"] + greedy["control_f32_agreeing_prefix"])
    assert results["backend"] == "xla" and results["heldout_files_missing"] == []


def test_cli_reports_what_fp8_weights_cost_beside_the_cache(cli_results):
    results, _ = cli_results
    weights, bf16 = results["fp8_weights"], results["bits_per_byte"]["bf16_cache"]
    # FP8 weights hold 1 byte an element (plus 4 a block) where bf16 holds 2; the embedding, LM
    # head and norms stay bf16, so the model shrinks, by less than half.
    assert 0.5 * weights["param_bytes"]["bf16"] < weights["param_bytes"]["fp8"] < weights["param_bytes"]["bf16"]
    # w_uk / w_uv FP8 too: fewer bytes still.
    assert weights["param_bytes"]["fp8_absorbed"] < weights["param_bytes"]["fp8"]
    for kind in ("bf16_cache", "fp8_cache", "fp8_cache_fp8_absorbed"):
        # e4m3 weights (2**-4 relative per element) move a near-uniform model's logits far too
        # little to change its ~8 bits per byte by 1%.
        assert abs(weights["bits_per_byte"][kind] / bf16 - 1) < 0.01
        assert weights["minus_bf16_bits_per_byte"][kind] == pytest.approx(weights["bits_per_byte"][kind] - bf16,
                                                                           abs=1e-9)
        assert weights["minus_bf16_standard_error"][kind] > 0 and weights["kl_from_bf16_nats_mean"][kind] >= 0
    greedy = results["greedy"]
    assert len(greedy["fp8_weights_agreeing_prefix"]) == 2 and 0 <= greedy["fp8_weights_identical"] <= 2


def test_cli_ablation_keeps_rope_exact_only_in_rope_aware_schemes(cli_results):
    results, _ = cli_results
    pooled = {r["scheme"]: r for r in results["ablation_all_layers"]}
    # The RoPE keys come from a bf16 cache, so keeping them in bf16 reproduces them exactly;
    # an FP8 RoPE part (3 mantissa bits) cannot.
    assert pooled["rope_aware_token"]["rope_rel_error"] == 0.0
    assert pooled["per_token_576"]["rope_rel_error"] > 1e-3
    assert len(results["ablation_per_layer"]) == 2


def test_cli_writes_markdown_and_png(cli_results):
    _, paths = cli_results
    text = paths["markdown"].read_text()
    assert "FP8 cache (SnapMLA)" in text and "rope_aware_token" in text
    for name in ("plot", "plot-ablation"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_model_dir_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="model"):
        fidelity.load_model_dir(tmp_path)


@pytest.mark.parametrize("argv, needle", [
    (["--backend", "bogus"], "--backend: expected one of"),
    (["--backend", "pallas"], "--backend: \"pallas\" compiles for a CUDA GPU"),
    (["--model", "/nope"], "--model: /nope is not a directory"),
    (["--model", "."], "--model: expected a train_demo directory"),
    (["--chunk", "100"], "--chunk: expected a divisor of --seq-len 512, got 100"),
    (["--chunk", "0"], "--chunk: expected an int >= 1"),
    (["--windows", "0"], "--windows: expected an int >= 1"),
    (["--windows", "many"], "--windows: expected an int, got 'many'"),
    (["--windows", "100000"], "--windows: the held-out text"),
    (["--prompts", "1000"], "--prompts: expected 1.."),
    (["--seq-len", "1024", "--chunk", "64"], "--seq-len: expected at most the model's context of 512"),
    (["--gen-tokens", "500"], "--gen-tokens: 500 tokens after prompts of 64 bytes pass the model's context"),
    (["--json", "."], "--json: . is a directory"),
    (["--plot", "nowhere/f.png"], "--plot: the directory nowhere does not exist"),
    (["--bogus"], "--bogus"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fidelity, "evaluate", lambda *_, **__: pytest.fail("evaluation started on bad input"))
    before = tree_snapshot(tmp_path)
    code = fidelity.main(argv)
    out, err = capsys.readouterr()
    assert_usage_error(code, err, needle)
    assert err.startswith("snapmla_jax.fidelity: error: "), err
    assert tree_snapshot(tmp_path) == before


def test_help_exits_0(capsys):
    assert fidelity.main(["--help"]) == 0
    assert "--chunk" in capsys.readouterr().out

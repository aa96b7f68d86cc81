"""``python -m snapmla_jax.bench capacity``: the plumbing on CPU devices (``--tiny``), the
rows each cache format fits, and bad flags."""

import json

import jax.numpy as jnp
import pytest

from cpu_devices import run_with_cpu_devices
from snapmla_jax import cli
from snapmla_jax.bench import capacity
from snapmla_jax.bench import e2e
from snapmla_jax import models
from snapmla_jax.capacity import MODEL_SHAPES


def test_capacity_bench_times_both_caches_data_parallel_on_two_devices(tmp_path):
    result = run_with_cpu_devices(2, ["-m", "snapmla_jax.bench", "capacity", "--tiny", "--devices", "2",
                                      "--batch-per-device", "3", "--contexts", "64", "200", "--backend", "xla",
                                      "--steps", "2", "--iters", "1", "--out", tmp_path])
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((tmp_path / "capacity.json").read_text())
    assert saved["environment"]["devices"] == 2
    rows = saved["rows"]
    assert [(r["context"], r["kv_cache"], r["status"], r["batch"]) for r in rows] == [
        (64, "fp8", "ok", 6), (64, "bf16", "ok", 6), (200, "fp8", "ok", 6), (200, "bf16", "ok", 6)]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    page = (tmp_path / "capacity.md").read_text()
    assert "on 2 x cpu, data-parallel attention" in page
    assert "`python -m snapmla_jax.bench capacity --tiny --devices 2 --batch-per-device 3" in page
    assert "| 64 | fp8 | 3 | given | 6 |" in page


def test_capacity_bench_makes_block_fp8_weights_with_fp8_weights(tmp_path):
    from snapmla_jax.bench.capacity import main

    assert main(["--tiny", "--fp8-weights", "--batch-per-device", "2", "--contexts", "64", "--backend", "xla",
                 "--steps", "2", "--iters", "1", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "capacity.json").read_text())
    assert saved["environment"]["weights"] == "block-FP8"
    # The sorted dispatch's default as block-FP8 experts take it, not the bf16 stacks'.
    assert saved["environment"]["sorted_moe_tokens"] == models.moe.default_sorted_min_tokens(e2e.TINY, fp8=True)
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in saved["rows"])
    assert "random block-FP8 weights" in (tmp_path / "capacity.md").read_text()


@pytest.mark.parametrize("flag, set_to, recorded, says", [
    (["--sorted-moe-tokens", "4"], 4, 4, "The MoE's sorted dispatch from 4 gathered tokens on."),
    (["--sorted-moe-tokens", "0"], None, None, "The MoE's sorted dispatch off (dense)."),
    ([], "unset", 160, "The MoE's sorted dispatch from 160 gathered tokens on.")])
def test_sorted_moe_tokens_sets_the_sorted_dispatch_in_every_moe_layer(tmp_path, monkeypatch, flag, set_to, recorded,
                                                                       says):
    from snapmla_jax import models
    from snapmla_jax.bench.capacity import main

    seen = []
    monkeypatch.setattr(models.moe, "set_sorted_min_tokens",
                        lambda model, n: seen.append((len(models.moe.moe_layers(model)), n)))
    assert main(["--tiny", *flag, "--batch-per-device", "2", "--contexts", "64", "--caches", "fp8",
                 "--backend", "xla", "--steps", "2", "--iters", "1", "--out", str(tmp_path)]) == 0
    assert seen == ([] if set_to == "unset" else [(1, set_to)])  # the tiny model's one MoE layer
    result = json.loads((tmp_path / "capacity.json").read_text())
    assert result["environment"]["sorted_moe_tokens"] == recorded
    assert [row["kv_cache"] for row in result["rows"]] == ["fp8"]  # --caches
    assert says in (tmp_path / "capacity.md").read_text()


def test_the_step_breakdown_sorts_kernels_into_attention_collectives_and_the_rest():
    from snapmla_jax.bench.timing import GpuEvent

    ms = 1_000_000
    events = [GpuEvent("s", "snapmla_decode_fp8_mgpu_small_mosaic_gpu_kernel", 0, 8 * ms),
              GpuEvent("s", "snapmla_mgpu_decode_inputs", 0, 2 * ms),
              GpuEvent("s", "snapmla_write_kv", 0, ms),
              GpuEvent("s", "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 0, 2 * ms),
              GpuEvent("s", "gemm_fusion_dot_1155", 0, 6 * ms),
              GpuEvent("s", "snapmla_grouped_gemm", 0, ms)]
    # 2 steps on 2 devices: each part / 4.
    assert capacity.step_breakdown(events, steps=2, devices=2) == {"attention": 2.75, "collectives": 0.5,
                                                                   "other": 1.75, "busy": 5.0}


def test_profile_adds_the_breakdown_table(tmp_path):
    assert capacity.main(["--tiny", "--profile", "--batch-per-device", "2", "--contexts", "64", "--backend", "xla",
                          "--steps", "2", "--iters", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "capacity.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"]  # the profiled call had tokens left to decode
    # A CPU trace has no GPU activity: zeros, and the table says "-" for the share.
    assert all(r["profile_ms"] == {"attention": 0.0, "collectives": 0.0, "other": 0.0, "busy": 0.0} for r in rows)
    page = (tmp_path / "capacity.md").read_text()
    assert "| context | cache | attention | collectives | other | busy | collectives / busy |" in page
    assert "| 64 | fp8 | 0.00 | 0.00 | 0.00 | 0.00 | - |" in page


def test_a_call_that_runs_out_of_tokens_fails_its_row(tmp_path, monkeypatch):
    # Rows sized without the profiled call's steps: that call would decode nothing and its trace
    # would hold no kernels, so it must fail the row instead of reporting an empty breakdown.
    monkeypatch.setattr(capacity, "decode_steps", lambda steps, iters, profile: 1 + (iters + 1) * steps)
    assert capacity.main(["--tiny", "--profile", "--batch-per-device", "2", "--contexts", "64", "--backend", "xla",
                          "--steps", "2", "--iters", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "capacity.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["failed: decoded 0 of 2 steps: the rows hold 5 tokens"] * 2


def test_random_fp8_weights_are_made_fp8_with_the_spread_of_the_bf16_ones():
    from snapmla_jax import models
    from snapmla_jax.bench import e2e
    from snapmla_jax.fp8_weights import BlockFP8Weight, dequantize_weight
    from snapmla_jax.models.layers import fp8_eligible_weights
    from snapmla_jax.models.transformer import param_bytes

    model = e2e.random_model(e2e.TINY, jnp.bfloat16, fp8_weights=True, fp8_absorbed=True)
    weights = [v.get_value() for v in fp8_eligible_weights(model).values()]
    assert weights and all(isinstance(w, BlockFP8Weight) for w in weights)
    # N(0, 0.02) after dequantization: the e4m3 values' spread times their scale.
    spread = float(jnp.std(jnp.concatenate([dequantize_weight(w).reshape(-1) for w in weights])))
    assert abs(spread - e2e.WEIGHT_STD) < 0.1 * e2e.WEIGHT_STD
    bf16 = e2e.random_model(e2e.TINY, jnp.bfloat16)
    assert param_bytes(model) < param_bytes(bf16)
    assert set(fp8_eligible_weights(models.quantize_weights(bf16))) == set(fp8_eligible_weights(model))
    # Without --fp8-absorbed: the same but w_uk / w_uv, made in bf16.
    default = e2e.random_model(e2e.TINY, jnp.bfloat16, fp8_weights=True)
    kinds = {path: isinstance(v.get_value(), BlockFP8Weight) for path, v in fp8_eligible_weights(default).items()}
    assert {path for path, fp8 in kinds.items() if not fp8} == {
        f"layers/{i}/self_attn/{name}" for i in range(e2e.TINY.num_hidden_layers) for name in ("w_uk", "w_uv")}
    assert default.layers[0].self_attn.w_uk.get_value().dtype == jnp.bfloat16


def test_rows_that_fit_are_bounded_by_memory_and_by_the_int32_rows():
    v2_lite = MODEL_SHAPES["v2-lite"]  # 27 layers: 644 B (FP8) and 1152 B (BF16) a token a layer
    gib = 2**30
    pages = -(-(32768 + 9) // 64)
    rows, limit = capacity.rows_that_fit(v2_lite, 40 * gib, 32768, 9, "bf16")
    assert limit == "memory" and rows == 40 * gib // (pages * 64 * 27 * 1152)
    # 200 GiB holds 376 FP8 rows: past the Triton kernels' 2**31 - 1 latent elements (127 rows),
    # which the compiled kernels on a Hopper GPU do not have.
    rows, limit = capacity.rows_that_fit(v2_lite, 200 * gib, 32768, 9, "fp8")
    assert limit == "memory" and rows == 200 * gib // (pages * 64 * 27 * 644) == 376
    assert capacity.rows_that_fit(v2_lite, None, 32768, 9, "fp8") == ((2**31 - 1) // (pages * 64), "int32 rows")


@pytest.mark.parametrize("flags, message", [
    (["--tiny", "--contexts", "0"], "--contexts: expected ints >= 1, got 0"),
    (["--tiny", "--batch-per-device", "0"], "--batch-per-device: expected an int >= 1, got 0"),
    (["--tiny", "--devices", "2"], "--devices: expected 1 to 1 (the devices JAX sees), got 2"),
    (["--tiny", "--reserve-gib", "-1"], "--reserve-gib: expected a number >= 0, got -1.0"),
    (["--tiny", "--sorted-moe-tokens", "-1"], "--sorted-moe-tokens: expected an int >= 0 (0: never), got -1"),
    (["--tiny", "--caches", "fp16"], "--caches"),
    (["--tiny", "--backend", "xla"], "--batch-per-device: needed where the device reports no memory (a CPU)"),
])
def test_bad_flags_are_refused_naming_them(tmp_path, flags, message):
    with pytest.raises(cli.UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        capacity.main([*flags, "--out", str(tmp_path)])

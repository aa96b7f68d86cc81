"""orbax checkpoints of MLAModel: bit-exact round trip, restoring onto a
sharding or another dtype, and clear errors for broken checkpoint directories."""

import glob
import json
import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cpu_devices import run_with_cpu_devices
from snapmla_jax.models import MLAConfig, MLAModel, load_checkpoint, save_checkpoint
from snapmla_jax.models.checkpoint import CheckpointError

CFG = MLAConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, q_lora_rank=24,
                n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                first_k_dense_replace=1, n_group=2, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
                norm_topk_prob=True, routed_scaling_factor=2.5)
TOKENS = np.arange(12, dtype=np.int32).reshape(2, 6) * 5 % 64


def flat_state(model) -> dict:
    return {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="module")
def model():
    m = MLAModel(CFG, rngs=nnx.Rngs(3), dtype=jnp.float32)
    # A non-zero router bias: it is state outside nnx.Param and must survive too.
    m.layers[1].mlp.gate.e_score_correction_bias.set_value(jnp.asarray(np.linspace(-0.3, 0.4, 4), jnp.float32))
    return m


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("ckpt") / "model"
    save_checkpoint(model, path)
    return path


def test_round_trip_is_bit_exact_including_router_bias(model, saved):
    restored = load_checkpoint(saved)
    assert restored.cfg == CFG
    want, got = flat_state(model), flat_state(restored)
    assert set(got) == set(want)
    for path in want:
        assert got[path].dtype == want[path].dtype, path
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))
    np.testing.assert_array_equal(np.asarray(restored(jnp.asarray(TOKENS))), np.asarray(model(jnp.asarray(TOKENS))))


def test_restore_in_another_dtype_casts_params_but_keeps_router_bias_float32(model, saved):
    restored = load_checkpoint(saved, dtype=jnp.bfloat16)
    kernel = restored.layers[0].self_attn.q_a_proj.kernel[...]
    assert kernel.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(kernel),
                                  np.asarray(model.layers[0].self_attn.q_a_proj.kernel[...].astype(jnp.bfloat16)))
    assert restored.layers[1].mlp.gate.e_score_correction_bias[...].dtype == jnp.float32


def test_restore_onto_a_given_single_device_sharding(saved):
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    restored = load_checkpoint(saved, sharding=sharding)
    assert all(leaf.sharding == sharding for leaf in jax.tree.leaves(nnx.state(restored)))


def test_a_placement_that_does_not_fit_is_named_before_orbax_reads(saved):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    too_long = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("model",)), P(None, None, None, None))
    with pytest.raises(ValueError, match=r"sharding: .* does not fit .* of shape") as raised:
        load_checkpoint(saved, sharding=too_long)
    assert not isinstance(raised.value, CheckpointError)  # the argument is wrong, not the checkpoint


SHARDED_RESTORE = """
import sys, jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from flax import nnx
from snapmla_jax.models import load_checkpoint
mesh = Mesh(np.array(jax.devices()), ("model",))
def by_path(path, leaf):
    # Split the output axis of every 2-D kernel over both devices; replicate the rest.
    spec = P(None, "model") if len(leaf.shape) == 2 and leaf.shape[1] % 2 == 0 else P()
    return NamedSharding(mesh, spec)
model = load_checkpoint(sys.argv[1], sharding=by_path)
kernel = model.layers[0].self_attn.q_a_proj.kernel[...]
assert len(jax.devices()) == 2 and kernel.sharding.spec == P(None, "model"), kernel.sharding
assert len(kernel.addressable_shards) == 2 and kernel.addressable_shards[0].data.shape == (32, 12)
np.save(sys.argv[2], np.asarray(kernel))
"""


def test_restore_onto_a_two_device_named_sharding(model, saved, tmp_path):
    out = tmp_path / "kernel.npy"
    result = run_with_cpu_devices(2, ["-c", SHARDED_RESTORE, saved, out])  # two devices need a fresh process
    assert result.returncode == 0, result.stderr[-3000:]
    np.testing.assert_array_equal(np.load(out), np.asarray(model.layers[0].self_attn.q_a_proj.kernel[...]))


def copy_checkpoint(saved: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    subprocess.run(["cp", "-r", str(saved), str(dst)], check=True)
    return dst


def test_unfinished_save_without_config_is_reported(saved, tmp_path):
    broken = copy_checkpoint(saved, tmp_path / "partial")
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json.*did not finish"):
        load_checkpoint(broken)


def test_corrupted_config_is_reported(saved, tmp_path):
    broken = copy_checkpoint(saved, tmp_path / "garbled")
    (broken / "config.json").write_text('{"format": "snapmla-jax/mla-model/1", "dtype": "float32", "conf')
    with pytest.raises(CheckpointError, match="config.json is corrupted"):
        load_checkpoint(broken)


def test_missing_weights_directory_is_reported(saved, tmp_path):
    broken = copy_checkpoint(saved, tmp_path / "no_state")
    subprocess.run(["rm", "-r", str(broken / "state")], check=True)
    with pytest.raises(CheckpointError, match="weights are missing"):
        load_checkpoint(broken)


def test_truncated_weight_files_are_reported_without_an_orbax_traceback(saved, tmp_path):
    broken = copy_checkpoint(saved, tmp_path / "truncated")
    data_files = [f for f in glob.glob(str(broken / "state" / "**" / "d" / "*"), recursive=True) if os.path.isfile(f)]
    assert data_files, "expected orbax data files under state/"
    for path in data_files:
        with open(path, "r+b") as f:
            f.truncate(7)
    with pytest.raises(CheckpointError, match="cannot read the saved weights"):
        load_checkpoint(broken)


def test_config_that_does_not_fit_the_saved_arrays_is_reported(saved, tmp_path):
    broken = copy_checkpoint(saved, tmp_path / "mismatch")
    record = json.loads((broken / "config.json").read_text())
    record["config"]["kv_lora_rank"] = 20
    (broken / "config.json").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="does not fit.*w_uk"):
        load_checkpoint(broken)


def test_not_a_directory_is_reported(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "absent")


def test_saving_over_an_existing_checkpoint_needs_overwrite(model, saved, tmp_path):
    target = copy_checkpoint(saved, tmp_path / "existing")
    with pytest.raises(ValueError, match="overwrite"):
        save_checkpoint(model, target)
    save_checkpoint(model, target, overwrite=True)
    np.testing.assert_array_equal(np.asarray(load_checkpoint(target)(jnp.asarray(TOKENS))),
                                  np.asarray(model(jnp.asarray(TOKENS))))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]  # no staging directory left


@pytest.mark.parametrize("make, reason", [
    (lambda p: p.write_text("a file"), "is a file"),
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("someone's")), "is a non-empty directory and not a "
                                                                       "snapmla-jax checkpoint"),
    (lambda p: (p.mkdir(), (p / "config.json").write_text('{"model_type": "deepseek_v2"}')),
     "is a non-empty directory and not a snapmla-jax checkpoint"),
])
def test_overwrite_replaces_only_our_own_checkpoints(model, tmp_path, make, reason):
    target = tmp_path / "target"
    make(target)
    before = sorted((p.name, p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match=f"ckpt_dir: .*target {reason}"):
        save_checkpoint(model, target, overwrite=True)
    assert sorted((p.name, p.read_bytes() if p.is_file() else None) for p in tmp_path.rglob("*")) == before


def test_a_path_below_a_file_is_refused_before_writing(model, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot be created: .*file is a file"):
        save_checkpoint(model, tmp_path / "file" / "ckpt")


def test_an_interrupted_overwrite_leaves_the_old_checkpoint_loadable(model, saved, tmp_path, monkeypatch):
    import snapmla_jax.models.checkpoint as ckpt

    target = copy_checkpoint(saved, tmp_path / "existing")
    before = sorted(str(p.relative_to(target)) for p in target.rglob("*"))

    def interrupted(model, directory):
        (pathlib.Path(directory) / "state").mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "write_checkpoint", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(model, target, overwrite=True)
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
    np.testing.assert_array_equal(np.asarray(load_checkpoint(target)(jnp.asarray(TOKENS))),
                                  np.asarray(model(jnp.asarray(TOKENS))))


def test_a_new_nested_directory_is_created(model, tmp_path):
    save_checkpoint(model, tmp_path / "a" / "b")
    load_checkpoint(tmp_path / "a" / "b")

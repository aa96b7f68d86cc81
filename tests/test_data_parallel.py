"""Data-parallel attention with expert parallelism (``snapmla_jax.data_parallel``,
``generate(..., mesh=)``): the tokens of one device, the experts' sums of one device, each
device holding its own rows' pages, and the same program over four processes under
``jax.distributed``.

Several CPU devices exist only in a fresh process (``cpu_devices``). These tests run the
write and the decode attention with backend "xla": the Mosaic GPU interpreter keeps one
state for all devices, and its end-of-kernel check that no barrier is left allocated fails
when two CPU devices run a kernel at the same time. The compiled kernels inside the layout are
tested on GPUs (``pytest -m gpu``, tests/test_generate_cli.py).
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from cpu_devices import run_processes, run_with_cpu_devices
from snapmla_jax import MLAConfig, MLAModel, generate
from snapmla_jax.paging import allocate_pages

TINY_MOE = """
import json, jax, jax.numpy as jnp, numpy as np
from flax import nnx
from snapmla_jax import MLAConfig, MLAModel, generate
cfg = MLAConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                kv_lora_rank=64, qk_nope_head_dim=8, qk_rope_head_dim=64, v_head_dim=8, q_lora_rank=24,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                first_k_dense_replace=1, max_position_embeddings=256)
model = MLAModel(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
"""

GENERATE_ON_MESHES = TINY_MOE + """
rng = np.random.default_rng(1)
# Ragged rows: one token, parts of a page, a row over two pages (70) and one over three (130).
prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (1, 5, 70, 9, 130)]
out = {}
# Each cache and each of greedy and sampled decoding on the meshes: the sampling (its key and the
# global logits it draws from) does not depend on the cache the logits came through.
for kv_cache, temperature in (("fp8", 0.0), ("bf16", 0.9)):
    run = lambda mesh: generate(model, prompts, max_new_tokens=12, kv_cache=kv_cache, temperature=temperature,
                                seed=3, backend="xla", mesh=mesh)
    key = f"{kv_cache} {temperature}"
    out[key] = {"one": run(None)}
    for n in (2, 4):  # 5 rows: padded to 6 and to 8
        out[key][n] = run(jax.sharding.Mesh(jax.devices()[:n], ("data",)))
print(json.dumps(out))
"""


def test_generate_on_two_and_four_devices_gives_the_tokens_of_one_device():
    result = run_with_cpu_devices(4, ["-c", GENERATE_ON_MESHES])
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(runs) == {"fp8 0.0", "bf16 0.9"}
    for key, tokens in runs.items():
        one = tokens["one"]
        # A float32 model: the mesh reorders the experts' sums (float32 rounding), far below the
        # margins between the top logits; sampling draws from the same global logits and key.
        assert tokens["2"] == one and tokens["4"] == one, key
        assert len(one) == 5 and all(len(row) == 12 for row in one)
        assert min(len(set(row)) for row in one) >= 2, key  # not a constant stream


EXPERT_PARALLEL_MOE = TINY_MOE + """
from jax.sharding import PartitionSpec as P
from snapmla_jax.data_parallel import param_specs, place_model
mesh = jax.sharding.Mesh(jax.devices()[:4], ("data",))
model.layers[2].mlp.dense_token_range = None
placed = place_model(model, mesh)
ranges = [[list(r) if r else r for r in (m.layers[i].mlp.dense_token_range for i in (1, 2))] for m in (model, placed)]
errors = {}
for tokens in (1, 6, 40):  # the gathered, dense and ragged dispatches of one device
    x = jax.random.normal(jax.random.key(tokens), (4 * tokens, cfg.hidden_size), jnp.float32) * 3
    # An outlier token, routed like any other.
    x = x.at[0].multiply(40.0)
    moe, placed_moe = model.layers[1].mlp, placed.layers[1].mlp
    for name, gather, dense in (("gathered", 8, None), ("dense", 0, (1, 512)), ("ragged", 0, None)):
        moe.gather_max_tokens, moe.dense_token_range = gather, dense
        placed_moe.gather_max_tokens, placed_moe.dense_token_range = gather, dense
        want = moe(x)
        graphdef, params = nnx.split(placed_moe)
        run = jax.jit(jax.shard_map(lambda p, x: nnx.merge(graphdef, p)(x), mesh=mesh,
                                    in_specs=(param_specs(params, "data"), P("data")), out_specs=P("data"),
                                    check_vma=False))
        got = run(params, x)
        errors[f"{tokens} {name}"] = float(jnp.abs(got - want).max() / jnp.abs(want).max())
shards = [s.data.shape for s in placed.layers[1].mlp.w_gate[...].addressable_shards]
print(json.dumps({"errors": errors, "shards": shards, "ranges": ranges}))
"""


def test_expert_parallel_moe_sums_every_expert_of_every_token_for_each_dispatch():
    result = run_with_cpu_devices(4, ["-c", EXPERT_PARALLEL_MOE])
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["shards"] == [[2, 32, 16]] * 4  # 8 experts, 2 a device
    # The gathered batch is 4x the tokens on a quarter of the experts: the dense range's top 4x.
    # The model placed from is unchanged, and a layer without a dense range keeps none.
    assert out["ranges"] == [[[4, 512], None], [[4, 2048], None]]
    # float32 throughout: the devices' partial sums added in another order; 1e-5 of the largest
    # output is ~100 float32 ulps of it, and a lost or doubled expert would move it by ~10%.
    assert set(out["errors"]) == {f"{t} {n}" for t in (1, 6, 40) for n in ("gathered", "dense", "ragged")}
    assert all(err < 1e-5 for err in out["errors"].values()), out["errors"]


SPLIT_CACHES = TINY_MOE + """
from snapmla_jax.data_parallel import create_caches
mesh = jax.sharding.Mesh(jax.devices()[:4], ("data",))
caches = create_caches(model, 3, 64, "fp8", mesh)
print(json.dumps([[list(s.data.shape) for s in a.addressable_shards] for a in jax.tree.leaves(caches[0])]))
"""


def test_each_device_holds_only_its_own_pages():
    result = run_with_cpu_devices(4, ["-c", SPLIT_CACHES])
    assert result.returncode == 0, result.stderr[-3000:]
    latent, scale, rope = json.loads(result.stdout.strip().splitlines()[-1])
    assert latent == [[3, 64, 64]] * 4 and scale == [[3, 64]] * 4 and rope == [[3, 64, 64]] * 4


def test_page_groups_number_each_group_from_zero():
    table = allocate_pages([1, 70, 3, 130], 10, page_size=64, groups=2)
    # Group 0 (rows 0-1) needs 1 + 2 pages, group 1 (rows 2-3) 1 + 3: a pool of 4 a device.
    assert table.num_pages == 4 and table.groups == 2
    np.testing.assert_array_equal(table.block_table, [[0, 0, 0], [1, 2, 0], [0, 0, 0], [1, 2, 3]])
    with pytest.raises(ValueError, match=r"groups: expected a positive int dividing the 4 rows, got 3"):
        allocate_pages([1, 2, 3, 4], 1, groups=3)


@pytest.fixture(scope="module")
def model():
    cfg = MLAConfig(vocab_size=31, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                    kv_lora_rank=64, qk_nope_head_dim=8, qk_rope_head_dim=64, v_head_dim=8,
                    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1)
    return MLAModel(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("mesh, message", [
    ("data", r"mesh: expected a 1-D jax.sharding.Mesh, got str"),
    (jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("a", "b")),
     r"mesh: expected one axis \(the batch rows and the experts split over it\), got axes \('a', 'b'\)"),
])
def test_a_mesh_that_is_not_one_axis_is_refused_naming_it(model, mesh, message):
    with pytest.raises(ValueError, match=message):
        generate(model, [[1, 2]], max_new_tokens=2, backend="xla", mesh=mesh)


def test_experts_that_do_not_divide_over_the_mesh_are_refused_naming_it():
    code = TINY_MOE + """
try:
    generate(model, [[1, 2]], max_new_tokens=2, backend="xla", mesh=jax.sharding.Mesh(jax.devices()[:3], ("data",)))
except ValueError as err:
    print(str(err).splitlines()[0])
"""
    result = run_with_cpu_devices(3, ["-c", code])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1].startswith(
        "mesh: 3 devices must divide the model's 8 routed experts (each device holds an equal share)")


PROCESSES = """
import json, sys
import jax
process, count, port, checkpoint = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
if count > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # collectives between CPU processes
    jax.distributed.initialize(f"localhost:{port}", num_processes=count, process_id=process)
import numpy as np
from snapmla_jax import expert_sharding, generate, load_checkpoint
rng = np.random.default_rng(1)
prompts = [rng.integers(0, 97, n).tolist() for n in (1, 5, 70, 9, 130)]
# Every process passes the same prompts; the mesh spans every process's device.
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",)) if count > 1 else None
run = lambda model: generate(model, prompts, max_new_tokens=10, kv_cache="fp8", backend="xla", mesh=mesh)
# Loaded whole in each process and placed by generate, or loaded straight into the mesh layout.
out = {"loaded": run(load_checkpoint(checkpoint))}
if mesh is not None:
    out["placed"] = run(load_checkpoint(checkpoint, sharding=expert_sharding(mesh, "data")))
print(json.dumps({"devices": jax.device_count(), "local": jax.local_device_count(), "tokens": out}))
"""


def test_four_processes_under_jax_distributed_give_the_tokens_of_one(tmp_path):
    # The multi-host path: one process per device (here four processes of one CPU device each,
    # talking through gloo), one global mesh; each process reads the whole result.
    made = run_with_cpu_devices(1, ["-c", TINY_MOE + f"""
from snapmla_jax import save_checkpoint
save_checkpoint(model, {str(tmp_path / "ckpt")!r})
"""])
    assert made.returncode == 0, made.stderr[-3000:]
    (one,) = run_processes(1, PROCESSES, tmp_path / "ckpt")
    assert one.returncode == 0, one.stderr[-3000:]
    results = run_processes(4, PROCESSES, tmp_path / "ckpt")
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    want = json.loads(one.stdout.strip().splitlines()[-1])["tokens"]["loaded"]
    assert min(len(set(row)) for row in want) >= 2  # not a constant stream
    for result in results:
        got = json.loads(result.stdout.strip().splitlines()[-1])
        assert (got["devices"], got["local"]) == (4, 1)
        # float32: the same tokens (the experts' sums reordered only).
        assert got["tokens"] == {"loaded": want, "placed": want}

"""Parity with Hugging Face transformers' PyTorch DeepseekV2/V3, checkpoint
conversion (incl. FP8 block-quantized weights) and the convert CLI.

The reference side runs in a separate Python 3.11 venv with torch and
transformers (the project never imports torch): tests/reference/make_hf_reference.py
builds tiny random checkpoints with save_pretrained and writes float64
reference logits. Its interpreter is $SNAPMLA_REF_PYTHON, default
<repo>/.venv-ref/bin/python. Without it these tests skip locally and FAIL
under CI=true.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from cpu_devices import run_with_cpu_devices
from snapmla_jax.models import MLAConfig, load_checkpoint, load_hf_checkpoint
from snapmla_jax.models.hf_loader import INDEX_FILE, SafetensorsFile
from snapmla_jax.convert import main as convert_main

REPO = pathlib.Path(__file__).resolve().parents[1]
REF_PYTHON = os.environ.get("SNAPMLA_REF_PYTHON", str(REPO / ".venv-ref" / "bin" / "python"))
REF_SCRIPT = REPO / "tests" / "reference" / "make_hf_reference.py"
FULL_FORWARD_VARIANTS = ("v2_lite", "v2", "v3")


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory) -> pathlib.Path:
    """Directory with one subdirectory per variant (checkpoint, input_ids.npy, logits.npy)."""
    if not os.path.isfile(REF_PYTHON):
        message = (f"reference venv missing: {REF_PYTHON} (build it with `bash scripts/install.sh --tests`, "
                   "or set SNAPMLA_REF_PYTHON)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    out = tmp_path_factory.mktemp("hf_reference")
    result = subprocess.run([REF_PYTHON, str(REF_SCRIPT), str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"reference script failed:\n{result.stderr[-4000:]}"
    return out


def relative_error(got, want) -> float:
    """max |got - want| / max |want| (float64)."""
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def forward(model, variant_dir: pathlib.Path) -> np.ndarray:
    return np.asarray(model(jnp.asarray(np.load(variant_dir / "input_ids.npy"))))


@pytest.mark.parametrize("variant", FULL_FORWARD_VARIANTS)
def test_full_forward_matches_transformers_float32(hf_reference, variant):
    model = load_hf_checkpoint(hf_reference / variant, dtype=jnp.float32, progress=False)
    err = relative_error(forward(model, hf_reference / variant), np.load(hf_reference / variant / "logits.npy"))
    print(f"{variant}: float32 full forward vs transformers float64, max relative logit error {err:.2e}")
    # float32 rounding through 2-3 layers of <= 160-term dot products is ~1e-6
    # relative (measured 4e-7 to 8e-7); 1e-4 is the bound. A convention
    # error (RoPE layout, YaRN scale, routing) costs O(1).
    assert err <= 1e-4


def test_fp8_block_quantized_checkpoint_matches_dequantized_reference(hf_reference):
    # This checkpoint also has a multi-token-prediction layer to skip, scales in
    # another shard than their weights, the older `rope_scaling` config spelling
    # and non-interleaved RoPE.
    variant = hf_reference / "v3_fp8"
    assert MLAConfig.from_hf(variant).rope_type == "yarn"
    model = load_hf_checkpoint(variant, dtype=jnp.float32, progress=False)
    err = relative_error(forward(model, variant), np.load(variant / "logits.npy"))
    print(f"v3_fp8: float32 forward vs dequantized transformers float64, max relative logit error {err:.2e}")
    assert err <= 1e-4  # same float32 bound as the unquantized models: dequantization itself is exact


@pytest.mark.parametrize("variant", ["v3", "v3_fp8"])
def test_bfloat16_load_stays_within_bfloat16_rounding(hf_reference, variant):
    model = load_hf_checkpoint(hf_reference / variant, dtype=jnp.bfloat16, progress=False)
    assert model.layers[1].mlp.w_gate[...].dtype == jnp.bfloat16
    assert model.layers[1].mlp.gate.e_score_correction_bias[...].dtype == jnp.float32
    got, want = forward(model, hf_reference / variant), np.load(hf_reference / variant / "logits.npy")
    rms = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)))
    print(f"{variant}: bfloat16 model vs transformers float64, rms relative logit error {rms:.2e}")
    # Every weight and activation is rounded to bf16 (2**-9 relative), dozens of
    # times over 2-3 layers: measured 1.2-1.7% rms. 5% flags a wrong cast or
    # dequantization (which costs O(100%)).
    assert rms <= 0.05


def test_saved_configs_are_read_as_their_families(hf_reference):
    lite, v2, v3 = (MLAConfig.from_hf(hf_reference / v) for v in FULL_FORWARD_VARIANTS)
    assert lite.q_lora_rank is None and lite.topk_method == "greedy" and lite.rope_type == "yarn"
    assert v2.topk_method == "group_limited_greedy" and v2.tie_word_embeddings and v2.rope_type == "default"
    assert v3.topk_method == "noaux_tc" and v3.scoring_func == "sigmoid" and v3.rope_interleave


def decode_errors(model, tokens: np.ndarray, full: np.ndarray, kv_cache: str, prompt_len: int) -> tuple[float, float]:
    """Prefill ``prompt_len`` tokens, decode the rest one at a time (backend="xla").

    Returns (max |decode - full| / max |full|, rms(decode - full) / rms(full))
    over every decoded token's logits.
    """
    batch, total = tokens.shape
    page_size = 4
    pages_per_row = -(-total // page_size)
    # Pages handed out in reverse, so that slots differ from positions.
    table = jnp.asarray(np.arange(batch * pages_per_row, dtype=np.int32)[::-1].reshape(batch, pages_per_row).copy())
    caches = model.init_cache(batch * pages_per_row, page_size, kv_cache=kv_cache)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    _, caches = model.prefill(jnp.asarray(tokens[:, :prompt_len]), lengths, caches, table, backend="xla")
    step = nnx.jit(lambda m, ids, c, t, s: m.decode(ids, c, t, s, backend="xla"), donate_argnums=2)
    diffs = []
    for pos in range(prompt_len, total):
        logits, caches = step(model, jnp.asarray(tokens[:, pos:pos + 1]), caches, table,
                              jnp.full((batch,), pos + 1, jnp.int32))
        diffs.append(np.asarray(logits[:, 0], np.float64) - full[:, pos])
    diffs, decoded = np.stack(diffs, axis=1), full[:, prompt_len:]
    return (float(np.abs(diffs).max() / np.abs(decoded).max()),
            float(np.sqrt(np.mean(diffs ** 2) / np.mean(decoded ** 2))))


@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
def test_decode_path_matches_full_forward_within_cache_rounding(hf_reference, variant):
    model = load_hf_checkpoint(hf_reference / variant, dtype=jnp.float32, progress=False)
    tokens = np.load(hf_reference / variant / "input_ids.npy")
    full = np.asarray(model(jnp.asarray(tokens)), np.float64)
    bf16_max, bf16_rms = decode_errors(model, tokens, full, "bf16", prompt_len=5)
    fp8_max, fp8_rms = decode_errors(model, tokens, full, "fp8", prompt_len=5)
    print(f"{variant}: decode vs full forward, relative logit error max / rms: "
          f"bf16 cache {bf16_max:.2e} / {bf16_rms:.2e}, fp8 cache {fp8_max:.2e} / {fp8_rms:.2e}")
    # bf16 cache: c_kv and k_pe are rounded once (2**-9 relative per element);
    # measured 0.2-0.4% max. A wrong position, slot or mask costs O(100%).
    assert bf16_max <= 1e-2
    # fp8 cache: e4m3's 2**-4 relative step on the latent, which these random
    # (untrained, chaotic) models amplify through MoE routing flips: measured
    # rms 4-15%, max 10-35%. An rms bound of 25% still fails on a broken
    # scale or layout (errors ~100% or NaN).
    assert fp8_rms <= 0.25


# ---- placement onto devices ----
SHARDED_HF_LOAD = """
import sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from snapmla_jax.models import load_checkpoint, load_hf_checkpoint, save_checkpoint
variant = sys.argv[1]
mesh = Mesh(np.array(jax.devices()), ("model",))
def by_path(path, leaf):
    # Expert stacks [E, ...] split by expert, 2-D kernels by output column, the rest replicated.
    if path.split("/")[-1] in ("w_gate", "w_up", "w_down"):
        return NamedSharding(mesh, P("model"))
    if len(leaf.shape) == 2 and leaf.shape[1] % 2 == 0:
        return NamedSharding(mesh, P(None, "model"))
    return NamedSharding(mesh, P())
model = load_hf_checkpoint(variant, dtype=jnp.float32, progress=False, sharding=by_path)
w_gate = model.layers[1].mlp.w_gate[...]
assert len(jax.devices()) == 2 and w_gate.sharding.spec == P("model"), w_gate.sharding
assert [s.data.shape[0] for s in w_gate.addressable_shards] == [w_gate.shape[0] // 2] * 2
assert model.layers[0].self_attn.o_proj.kernel[...].sharding.spec == P(None, "model")
logits = model(jnp.asarray(np.load(variant + "/input_ids.npy")))
# orbax writes each device's shards; the restore puts them back where by_path says.
save_checkpoint(model, sys.argv[4])
restored = load_checkpoint(sys.argv[4], sharding=by_path).layers[1].mlp.w_gate[...]
assert restored.sharding.spec == P("model"), restored.sharding
assert all((a.data == b.data).all() for a, b in zip(restored.addressable_shards, w_gate.addressable_shards))
np.save(sys.argv[2], np.asarray(w_gate))
np.save(sys.argv[3], np.asarray(logits))
"""


def test_hf_checkpoint_loads_onto_a_two_device_mesh_runs_and_saves_from_it(hf_reference, tmp_path):
    # An FP8 MoE checkpoint (scales dequantized on the way), its expert stacks split over two
    # CPU devices (which exist only in a fresh process: the flag is read at JAX start-up), then
    # saved from the mesh and restored onto it: the path for a model larger than one host's
    # memory, which `convert` (one process, one device) cannot take.
    variant = hf_reference / "v3_fp8"
    w_gate_file, logits_file = tmp_path / "w_gate.npy", tmp_path / "logits.npy"
    result = run_with_cpu_devices(2, ["-c", SHARDED_HF_LOAD, variant, w_gate_file, logits_file, tmp_path / "saved"])
    assert result.returncode == 0, result.stderr[-3000:]
    direct = load_hf_checkpoint(variant, dtype=jnp.float32, progress=False)
    np.testing.assert_array_equal(np.load(w_gate_file), np.asarray(direct.layers[1].mlp.w_gate[...]))
    # The sharded model's forward is the same float32 math split over devices (partial sums
    # added in another order): the float32 parity bound of the unsharded tests.
    assert relative_error(np.load(logits_file), np.load(variant / "logits.npy")) <= 1e-4


def test_hf_loader_rejects_a_placement_that_does_not_fit_before_reading(hf_reference, monkeypatch):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import snapmla_jax.models.hf_loader

    from snapmla_jax import models

    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    too_long = NamedSharding(mesh, P(None, None, None, None))  # more axes than any weight has
    monkeypatch.setattr(models.hf_loader.SafetensorsFile, "read", lambda *_: pytest.fail("data read before the check"))
    with pytest.raises(ValueError, match=r"sharding: .* does not fit .* of shape"):
        load_hf_checkpoint(hf_reference / "v2_lite", dtype=jnp.float32, progress=False, sharding=too_long)


# ---- loader errors ----
def rewrite_checkpoint(src: pathlib.Path, dst: pathlib.Path, edit) -> pathlib.Path:
    """Copy checkpoint ``src`` into one model.safetensors under ``dst`` after ``edit(tensors)``."""
    with open(src / INDEX_FILE) as f:
        weight_map = json.load(f)["weight_map"]
    files = {file: SafetensorsFile(str(src / file)) for file in set(weight_map.values())}
    tensors = {name: np.array(files[file].read(name)) for name, file in weight_map.items()}
    edit(tensors)
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("edit, named", [
    (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"), r"missing.*layers\.1\.mlp\.w_up"),
    (lambda t: t.pop("model.layers.0.self_attn.kv_b_proj.weight"), r"missing.*layers\.0\.self_attn\.w_uk"),
    (lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.ones(3, np.float32)}),
     r"unexpected.*model\.layers\.0\.self_attn\.extra\.weight"),
    (lambda t: t.update({"model.layers.0.mlp.gate_proj.weight": np.ones((95, 64), np.float32)}),
     r"mis-shaped.*model\.layers\.0\.mlp\.gate_proj\.weight \(expected \[96, 64\], got \[95, 64\]\)"),
])
def test_loader_names_missing_unexpected_and_misshaped_tensors(hf_reference, tmp_path, edit, named):
    broken = rewrite_checkpoint(hf_reference / "v2_lite", tmp_path / "broken", edit)
    with pytest.raises(ValueError, match=named):
        load_hf_checkpoint(broken, dtype=jnp.float32, progress=False)


def test_fp8_weight_without_its_scale_is_rejected(hf_reference, tmp_path):
    broken = tmp_path / "no_scale"
    shutil.copytree(hf_reference / "v3_fp8", broken)
    index = json.loads((broken / INDEX_FILE).read_text())
    del index["weight_map"]["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    (broken / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight.*without.*_scale_inv"):
        load_hf_checkpoint(broken, dtype=jnp.float32, progress=False)


# ---- convert CLI ----
def test_convert_cli_writes_a_checkpoint_that_reloads_bit_exactly(hf_reference, tmp_path):
    variant = hf_reference / "v3_fp8"
    out = tmp_path / "converted"
    assert convert_main(["--hf-dir", str(variant), "--out", str(out), "--dtype", "float32", "--quiet"]) == 0
    direct = load_hf_checkpoint(variant, dtype=jnp.float32, progress=False)
    reloaded = load_checkpoint(out)
    np.testing.assert_array_equal(forward(reloaded, variant), forward(direct, variant))


def test_convert_cli_with_experts_split_over_two_devices_writes_the_same_checkpoint(hf_reference, tmp_path):
    variant = hf_reference / "v3_fp8"
    out = tmp_path / "sharded"
    convert = ["-m", "snapmla_jax.convert", "--hf-dir", variant, "--quiet", "--shard-experts"]
    result = run_with_cpu_devices(2, [*convert, "--out", out, "--dtype", "float32"])
    assert result.returncode == 0, result.stderr[-3000:]
    direct = load_hf_checkpoint(variant, dtype=jnp.float32, progress=False)
    np.testing.assert_array_equal(forward(load_checkpoint(out), variant), forward(direct, variant))
    # Three devices do not divide the 8 experts: exit 2 naming the flag, one line.
    bad = run_with_cpu_devices(3, [*convert, "--out", tmp_path / "bad"])
    assert bad.returncode == 2 and bad.stderr.startswith("snapmla_jax.convert: error: --shard-experts: 3 devices: ")
    assert bad.stderr.count("\n") == 1


def test_convert_cli_copies_the_tokenizer_so_the_output_generates(hf_reference, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from snapmla_jax.tokenizer import load_tokenizer

    variant = tmp_path / "hf"
    shutil.copytree(hf_reference / "v2", variant)
    vocab = {"[UNK]": 0, "def": 1, "f": 2, "return": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(variant / "tokenizer.json"))
    out = tmp_path / "converted"
    assert convert_main(["--hf-dir", str(variant), "--out", str(out), "--quiet"]) == 0
    assert (out / "tokenizer.json").read_bytes() == (variant / "tokenizer.json").read_bytes()
    assert load_tokenizer(out).encode("def f return") == [1, 2, 3]


def test_convert_cli_bad_input_exits_2_with_one_line(tmp_path, capsys):
    assert convert_main(["--hf-dir", str(tmp_path / "absent"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "absent" in err and "\n" not in err
    assert convert_main(["--out", str(tmp_path / "o")]) == 2
    assert "--hf-dir" in capsys.readouterr().err


def test_convert_module_runs_as_a_script(hf_reference, tmp_path):
    result = subprocess.run([sys.executable, "-m", "snapmla_jax.convert", "--hf-dir", str(hf_reference / "v2"),
                             "--out", str(tmp_path / "o"), "--quiet"], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert load_checkpoint(tmp_path / "o").embed_tokens.embedding[...].dtype == jnp.bfloat16  # the CLI's default

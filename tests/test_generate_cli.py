"""``python -m snapmla_jax.generate`` end to end on a tiny orbax checkpoint with a
byte-level BPE tokenizer trained here; bad input exits 2 with one line."""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from cpu_devices import run_with_cpu_devices
from cli_checks import assert_usage_error, tree_snapshot
from snapmla_jax.models import MLAConfig, MLAModel, load_checkpoint, save_checkpoint
from snapmla_jax.generate import generate, main
from snapmla_jax.tokenizer import load_tokenizer

CONTEXT = 64
CORPUS = ["the quick brown fox jumps over the lazy dog", "a cache of latent vectors in eight bits",
          "multi head latent attention decodes one token at a time", "héllo wörld, ünïcode bytes"] * 4
STATS_LINE = re.compile(r"^prefill: \d+ tokens, [\d.]+ tokens/s \| decode: \d+ tokens, [\d.]+ tokens/s \| "
                        r"KV cache \((fp8|bf16)\): \d+ bytes \| compile: [\d.]+ s$")


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    return tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tokenizer = _train_tokenizer()
    cfg = MLAConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64,
                    v_head_dim=16, max_position_embeddings=CONTEXT)
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    save_checkpoint(MLAModel(cfg, rngs=nnx.Rngs(1), dtype=jnp.float32), path)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return path


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_tokenizer_round_trips_and_finds_eos(checkpoint):
    tokenizer = load_tokenizer(checkpoint)
    ids = tokenizer.encode("héllo wörld")
    assert ids[0] == 0  # <s> added by the post-processor
    assert tokenizer.decode(ids) == "héllo wörld"
    assert tokenizer.eos_id == 1


def test_byte_level_tokenizer_declared_in_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "ByteTokenizer", "bos_token_id": 256, "eos_token_id": 257}))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.encode("é!") == [256, 0xC3, 0xA9, ord("!")]
    assert tokenizer.decode([256, 0xC3, 0xA9, 257, ord("!")]) == "é!"  # ids >= 256 dropped
    assert tokenizer.decode([0xC3]) == "\ufffd"  # a cut UTF-8 sequence decodes to U+FFFD
    assert tokenizer.eos_id == 257


def test_text_output_ends_with_the_stats_line(checkpoint, capsys):
    code, out, err = _run(capsys, "--model", checkpoint, "--prompt", "the quick", "--max-new-tokens", 6,
                          "--backend", "xla", "--eos-id", -1)
    assert code == 0, err
    lines = out.rstrip("\n").split("\n")
    assert STATS_LINE.match(lines[-1]), lines[-1]
    assert "decode: 5 tokens" in lines[-1] and "KV cache (fp8)" in lines[-1]


def test_json_batch_matches_generate_with_the_same_settings(checkpoint, tmp_path, capsys):
    batch = tmp_path / "prompts.txt"
    batch.write_text("the quick brown\na cache\nmulti head latent attention decodes\n")
    flags = ["--temperature", 0.8, "--top-k", 20, "--top-p", 0.9, "--seed", 11]
    code, out, err = _run(capsys, "--model", checkpoint, "--batch-file", batch, "--max-new-tokens", 8,
                          "--kv-cache", "bf16", "--backend", "xla", "--json", *flags)
    assert code == 0, err
    record = json.loads(out)
    tokenizer = load_tokenizer(checkpoint)
    prompts = [tokenizer.encode(line) for line in batch.read_text().splitlines()]
    expected = generate(load_checkpoint(checkpoint), prompts, max_new_tokens=8, kv_cache="bf16", temperature=0.8,
                        top_k=20, top_p=0.9, seed=11, eos_id=tokenizer.eos_id, backend="xla")
    assert [c["tokens"] for c in record["completions"]] == expected
    assert [c["text"] for c in record["completions"]] == [tokenizer.decode(t) for t in expected]
    assert [c["prompt_tokens"] for c in record["completions"]] == [len(p) for p in prompts]
    assert all(c["finish_reason"] in ("eos", "length") for c in record["completions"])
    assert record["stats"]["kv_cache_bytes"] > 0 and record["stats"]["prefill_tokens"] == sum(map(len, prompts))


def test_query_terms_flag_reaches_generate(checkpoint, capsys, monkeypatch):
    import snapmla_jax.generate as generate_module
    stream_init, seen = generate_module.GenerationStream.__init__, []

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("query_terms"))
        assert kwargs.get("qk_promotion", "missing") is None  # the flag's default: each kernel's own
        stream_init(self, *args, **kwargs)

    monkeypatch.setattr(generate_module.GenerationStream, "__init__", recording)
    code, out, err = _run(capsys, "--model", checkpoint, "--prompt", "a cache", "--max-new-tokens", 6,
                          "--backend", "xla", "--eos-id", -1, "--query-terms", 2, "--json")
    assert code == 0, err
    assert seen[0] == 2
    tokenizer = load_tokenizer(checkpoint)
    expected = generate(load_checkpoint(checkpoint), [tokenizer.encode("a cache")], max_new_tokens=6, eos_id=None,
                        backend="xla", query_terms=2)
    assert [c["tokens"] for c in json.loads(out)["completions"]] == expected


def test_qk_promotion_flag_reaches_generate(checkpoint, capsys, monkeypatch):
    import snapmla_jax.generate as generate_module
    stream_init, seen = generate_module.GenerationStream.__init__, []

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("qk_promotion"))
        stream_init(self, *args, **kwargs)

    monkeypatch.setattr(generate_module.GenerationStream, "__init__", recording)
    code, out, err = _run(capsys, "--model", checkpoint, "--prompt", "a cache", "--max-new-tokens", 4,
                          "--backend", "xla", "--qk-promotion", 128, "--json")
    assert code == 0, err
    assert seen == [128]


def test_fp8_weights_flag_quantizes_a_converted_checkpoint(checkpoint, capsys):
    from snapmla_jax.fp8_weights import BlockFP8Weight
    from snapmla_jax.models import quantize_weights
    from snapmla_jax.models.layers import fp8_eligible_weights
    from snapmla_jax.models.transformer import param_bytes

    flags = ["--model", checkpoint, "--prompt", "a cache", "--max-new-tokens", 5, "--backend", "xla",
             "--eos-id", -1, "--json"]
    code, out, err = _run(capsys, *flags, "--fp8-weights")
    assert code == 0, err
    record = json.loads(out)
    model = quantize_weights(load_checkpoint(checkpoint), (128, 128))
    assert record["fp8_weights"] == sorted(path for path, w in fp8_eligible_weights(model).items()
                                           if isinstance(w.get_value(), BlockFP8Weight))
    assert "layers/0/self_attn/w_uk" not in record["fp8_weights"]  # quantize_weights' default: bf16
    assert record["weight_bytes"] == param_bytes(model)
    expected = generate(model, [load_tokenizer(checkpoint).encode("a cache")], max_new_tokens=5, eos_id=None,
                        backend="xla")
    assert [c["tokens"] for c in record["completions"]] == expected
    code, out, err = _run(capsys, *flags)
    assert code == 0, err
    plain = json.loads(out)
    assert plain["fp8_weights"] == [] and plain["weight_bytes"] > record["weight_bytes"]


def test_fp8_min_elements_flag_keeps_the_smaller_weights_in_bf16(checkpoint, capsys):
    from snapmla_jax.fp8_weights import BlockFP8Weight
    from snapmla_jax.models import quantize_weights
    from snapmla_jax.models.layers import fp8_eligible_weights, weight_elements

    sizes = sorted({weight_elements(w.get_value()) for w in fp8_eligible_weights(load_checkpoint(checkpoint)).values()})
    threshold = sizes[len(sizes) // 2]
    code, out, err = _run(capsys, "--model", checkpoint, "--prompt", "a cache", "--max-new-tokens", 5, "--backend",
                          "xla", "--eos-id", -1, "--json", "--fp8-weights", "--fp8-min-elements", threshold)
    assert code == 0, err
    model = quantize_weights(load_checkpoint(checkpoint), (128, 128), min_elements=threshold)
    kept = sorted(path for path, w in fp8_eligible_weights(model).items() if isinstance(w.get_value(), BlockFP8Weight))
    assert 0 < len(kept) < len(fp8_eligible_weights(model)) - 2 * model.cfg.num_hidden_layers
    assert json.loads(out)["fp8_weights"] == kept


def test_fp8_weights_flag_quantizes_a_hugging_face_checkpoint_as_it_loads(checkpoint, tmp_path, capsys):
    from hf_tiny import HF_MOE_CONFIG, write_tiny_hf_checkpoint
    from snapmla_jax.models import load_hf_checkpoint

    hf_dir = tmp_path / "hf"
    write_tiny_hf_checkpoint(hf_dir, seed=2, hf_config={**HF_MOE_CONFIG, "vocab_size": 320})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, hf_dir / name)
    code, out, err = _run(capsys, "--model", hf_dir, "--prompt", "a cache", "--max-new-tokens", 5,
                          "--backend", "xla", "--eos-id", -1, "--json", "--fp8-weights")
    assert code == 0, err
    record = json.loads(out)
    model = load_hf_checkpoint(hf_dir, jnp.bfloat16, progress=False, fp8_weights=True, quantize_fp8_weights=True)
    assert "layers/1/mlp/w_down" in record["fp8_weights"] and "layers/0/mlp/up_proj/kernel" in record["fp8_weights"]
    expected = generate(model, [load_tokenizer(hf_dir).encode("a cache")], max_new_tokens=5, eos_id=None,
                        backend="xla")
    assert [c["tokens"] for c in record["completions"]] == expected


def test_streamed_text_equals_the_text_printed_at_the_end(checkpoint, capsys):
    common = ["--model", checkpoint, "--prompt", "héllo", "--max-new-tokens", 12, "--backend", "xla",
              "--eos-id", -1, "--temperature", 1.0, "--seed", 2]
    code_s, streamed, _ = _run(capsys, *common, "--chunk-size", 3)
    code_n, whole, _ = _run(capsys, *common, "--no-stream")
    assert code_s == code_n == 0
    assert streamed.rsplit("\n", 2)[0] == whole.rsplit("\n", 2)[0]


def test_module_runs_as_a_program(checkpoint):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    ok = subprocess.run([sys.executable, "-m", "snapmla_jax.generate", "--model", str(checkpoint), "--prompt",
                         "a cache", "--max-new-tokens", "4", "--backend", "xla"], capture_output=True, text=True,
                        env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert STATS_LINE.match(ok.stdout.rstrip("\n").split("\n")[-1])
    bad = subprocess.run([sys.executable, "-m", "snapmla_jax.generate", "--model", str(checkpoint), "--prompt",
                          "x", "--kv-cache", "int4"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "--kv-cache" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("argv,needle", [
    (["--prompt", "x", "--bogus"], "--bogus"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens: expected an int >= 1, got 0"),
    (["--prompt", "x", "--max-new-tokens", "many"], "--max-new-tokens: expected an int, got 'many'"),
    (["--prompt", "x", "--top-p", "0"], "--top-p: expected a float in (0, 1]"),
    (["--prompt", "x", "--temperature", "-1"], "--temperature: expected a float >= 0"),
    (["--prompt", "x", "--top-k", "-1"], "--top-k: expected an int >= 0"),
    (["--prompt", "x", "--kv-cache", "int4"], "--kv-cache: expected one of"),
    (["--prompt", "x", "--query-terms", "3"], "--query-terms: expected one of 1, 2, got 3"),
    (["--prompt", "x", "--qk-promotion", "64"], "--qk-promotion: expected one of 128, 256, 512, got 64"),
    (["--prompt", "x", "--chunk-size", "0"], "--chunk-size: expected an int >= 1"),
    (["--prompt", "x", "--fp8-min-elements", "1024"], "--fp8-min-elements: chooses among the weights --fp8-weights"),
    (["--prompt", "x", "--fp8-weights", "--fp8-min-elements", "-1"], "--fp8-min-elements: expected an int >= 0"),
    (["--prompt", "x", "--dtype", "int8"], "--dtype: expected one of"),
    (["--prompt", "x", "--backend", "pallas"], "--backend: \"pallas\" compiles for a CUDA GPU"),
    (["--prompt", "x", "--batch-file", "b.txt"], "--batch-file: not allowed with argument --prompt"),
    (["--prompt", ""], "--prompt"),
    ([], "--prompt or --batch-file"),
    (["--prompt", "the " * CONTEXT], "--prompt: the prompt has"),
    (["--prompt", "the quick brown fox", "--max-new-tokens", str(CONTEXT)],
     "--max-new-tokens: the prompt has 14 tokens; 64 new ones would pass the model's context of 64 tokens "
     "(at most 50)"),
    (["--prompt", "x", "--max-new-tokens", "4", "--eos-id", "999"],
     "--eos-id: expected -1 (none) or a token id in [0, 320), got 999"),
    (["--prompt", "x", "--max-new-tokens", "4", "--eos-id", "-5"], "--eos-id: expected -1 (none) or a token id"),
])
def test_bad_input_exits_2_with_one_line(checkpoint, tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    before = tree_snapshot(tmp_path)
    code, out, err = _run(capsys, "--model", checkpoint, "--backend", "xla", *argv)
    assert_usage_error(code, err, needle)
    assert out == "" and err.startswith("snapmla_jax.generate: error:"), err
    assert tree_snapshot(tmp_path) == before


def test_bad_batch_files_exit_2(checkpoint, tmp_path, capsys):
    blank = tmp_path / "blank.txt"
    blank.write_text("first prompt\n\nthird prompt\n")
    for path, needle in ((blank, "line 2"), (tmp_path / "missing.txt", "--batch-file")):
        code, _, err = _run(capsys, "--model", checkpoint, "--batch-file", path)
        assert_usage_error(code, err, needle)


def test_missing_model_or_tokenizer_exits_2(checkpoint, tmp_path, capsys, monkeypatch):
    code, _, err = _run(capsys, "--model", tmp_path / "nowhere", "--prompt", "x")
    assert_usage_error(code, err, "--model")
    # A directory that is no model is named as such, whatever tokenizer files it lacks.
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _run(capsys, "--model", empty, "--prompt", "x")
    assert_usage_error(code, err, "--model: ")
    assert "--model: " in err and "is neither a snapmla-jax checkpoint" in err and "tokenizer" not in err
    code, _, err = _run(capsys, "--model", empty, "--tokenizer", checkpoint, "--prompt", "x")
    assert code == 2 and "neither a snapmla-jax checkpoint" in err
    # A checkpoint without a tokenizer: the flag that supplies one.
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    code, _, err = _run(capsys, "--model", bare, "--prompt", "x")
    assert_usage_error(code, err, "holds no tokenizer")
    assert "--tokenizer DIR" in err
    code, _, err = _run(capsys, "--model", bare, "--tokenizer", empty, "--prompt", "x")
    assert_usage_error(code, err)
    assert err.startswith("snapmla_jax.generate: error: --tokenizer: "), err
    # The module, not the package's generate function of the same name.
    module = importlib.import_module("snapmla_jax.generate")
    monkeypatch.setattr(module, "DEFAULT_MODEL_DIR", tmp_path / "no_demo_model")
    code, _, err = _run(capsys, "--prompt", "x")
    assert_usage_error(code, err, "demo model is not installed")


def test_prompts_are_counted_from_1_as_the_lines_of_the_batch_file(checkpoint, tmp_path, capsys):
    batch = tmp_path / "prompts.txt"
    batch.write_text("a cache\n" + "the " * CONTEXT + "\nmulti head\n")
    code, _, err = _run(capsys, "--model", checkpoint, "--batch-file", batch, "--max-new-tokens", 4)
    assert_usage_error(code, err)
    assert f"--batch-file: prompt 2 (line 2 of {batch}) has" in err, err
    batch.write_text("the quick brown fox jumps over the lazy dog\na cache\n")
    code, _, err = _run(capsys, "--model", checkpoint, "--batch-file", batch, "--max-new-tokens", CONTEXT - 3)
    assert code == 2 and f"--max-new-tokens: prompt 1 (line 1 of {batch}) has" in err, err


def test_a_batch_of_100k_prompts_is_refused_before_allocating_saying_what_fits(checkpoint, tmp_path, capsys,
                                                                               monkeypatch):
    batch = tmp_path / "prompts.txt"
    batch.write_text("a cache\n" * 100_000)
    # 100k pages of 64 tokens, past the token rows the kernels address in one layer's cache array
    # (made 2**20 here: the real 2**31 - 1 would need 33M prompts), whatever the host's memory.
    monkeypatch.setattr(importlib.import_module("snapmla_jax.generate"), "MAX_TOKEN_SLOTS", 2**20)
    code, out, err = _run(capsys, "--model", checkpoint, "--batch-file", batch, "--max-new-tokens", 8)
    assert_usage_error(code, err)
    assert out == "" and err.startswith("snapmla_jax.generate: error: --batch-file: 100000 prompts with --max-new-tokens 8 need ")
    fit = int(re.search(r"the first (\d+) prompts would fit", err).group(1))
    assert 0 < fit < 100_000


def test_a_batch_larger_than_the_memory_budget_is_refused_saying_what_fits(checkpoint, tmp_path, capsys,
                                                                          monkeypatch):
    module = importlib.import_module("snapmla_jax.generate")
    model = load_checkpoint(checkpoint)
    page_bytes = sum(c.nbytes for c in model.init_cache(1, module.DEFAULT_PAGE_SIZE, kv_cache="fp8"))
    # Room for 2 pages; each of these prompts with 8 new tokens takes one (64 tokens a page).
    monkeypatch.setattr(module, "cache_budget", lambda devices=None: (2 * page_bytes, "a 2-page test budget"))
    batch = tmp_path / "prompts.txt"
    batch.write_text("a cache\nthe quick\nmulti head\n")
    code, out, err = _run(capsys, "--model", checkpoint, "--batch-file", batch, "--max-new-tokens", 8)
    assert_usage_error(code, err)
    assert out == "" and "--batch-file: 3 prompts with --max-new-tokens 8 need" in err and "more than a 2-page test budget" in err
    assert err.rstrip().endswith("the first 2 prompts would fit"), err
    batch.write_text("a cache\nthe quick\n")
    assert _run(capsys, "--model", checkpoint, "--batch-file", batch, "--max-new-tokens", 8, "--backend", "xla",
                "--json")[0] == 0


def test_device_out_of_memory_is_one_line(checkpoint, capsys, monkeypatch):
    module = importlib.import_module("snapmla_jax.generate")

    def out_of_memory(self):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.00GiB.\n"
                                         "BufferAssignment OOM Debugging.")
        yield

    monkeypatch.setattr(module.GenerationStream, "__iter__", out_of_memory)
    code, _, err = _run(capsys, "--model", checkpoint, "--prompt", "a cache", "--max-new-tokens", 4)
    assert_usage_error(code, err)
    assert "out of device memory (RESOURCE_EXHAUSTED: Out of memory" in err and "--max-new-tokens" in err


def test_help_exits_0(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0 and "--kv-cache" in out and "--batch-file" in out


def _cli_on_cpu_devices(count: int, *argv) -> subprocess.CompletedProcess:
    return run_with_cpu_devices(count, ["-m", "snapmla_jax.generate", *argv])


def test_shard_experts_runs_the_demo_model_over_two_devices_with_the_same_tokens(capsys):
    # The bundled demo model has 8 experts a MoE layer: 4 on each device, the rest replicated;
    # its weights quantized to FP8 after loading (--fp8-weights) and placed again, values and
    # scales of an expert stack split alike.
    argv = ["--prompt", "def ", "--max-new-tokens", "8", "--json", "--dtype", "float32", "--fp8-weights"]
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    sharded = _cli_on_cpu_devices(2, *argv, "--shard-experts")
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    one, two = json.loads(out), json.loads(sharded.stdout)
    assert (one["devices"], two["devices"]) == (1, 2)
    assert "layers/1/mlp/w_gate" in two["fp8_weights"] and two["fp8_weights"] == one["fp8_weights"]
    # Greedy tokens of the same model run in float32: the split only reorders the experts' sums
    # (float32 rounding, far below the margins between the top logits).
    assert two["completions"][0]["tokens"] == one["completions"][0]["tokens"]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache", ["fp8", "bf16"])
def test_shard_experts_over_the_gpus_gives_the_tokens_of_one_gpu(capsys, kv_cache):
    # The CPU test above runs the partitioned program on the XLA path; here the
    # compiled write and decode kernels run inside the expert-parallel program, their operands
    # replicated over the GPUs, and the 8 experts split over 2, 4 or 8 of them.
    gpus = len(jax.devices("gpu"))
    if gpus < 2:
        pytest.skip(f"needs two or more GPUs, found {gpus}")
    argv = ["--prompt", "def ", "--max-new-tokens", "16", "--json", "--dtype", "float32", "--kv-cache", kv_cache]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err[-3000:]
    code, sharded, err = _run(capsys, *argv, "--shard-experts")
    assert code == 0, err[-3000:]
    one, every = json.loads(out), json.loads(sharded)
    assert (one["devices"], every["devices"]) == (1, gpus)
    # Greedy tokens of one float32 model: the split reorders the experts' sums (float32
    # rounding), far below the margins between the top logits, and the attention kernels see
    # the same inputs on every GPU.
    assert every["completions"][0]["tokens"] == one["completions"][0]["tokens"]
    assert len(set(one["completions"][0]["tokens"])) >= 3  # not a constant stream


def test_shard_experts_that_do_not_divide_over_the_devices_exit_2_naming_the_flag():
    result = _cli_on_cpu_devices(3, "--prompt", "def ", "--shard-experts")  # 8 experts, 3 devices
    assert result.returncode == 2
    assert result.stderr.startswith("snapmla_jax.generate: error: --shard-experts: 3 devices: sharding:")
    assert result.stderr.count("\n") == 1


def test_devices_serves_a_batch_data_parallel_with_the_tokens_of_one_device(capsys, tmp_path):
    # Three prompts over two devices (padded to four rows); the demo model's 8 experts, 4 a device.
    # backend "xla" on both sides: tests/test_data_parallel.py says why the interpreter is not used.
    batch = tmp_path / "prompts.txt"
    batch.write_text("def \nThe river\nimport numpy as\n")
    argv = ["--batch-file", str(batch), "--max-new-tokens", "8", "--json", "--dtype", "float32", "--backend", "xla"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err[-3000:]
    parallel = _cli_on_cpu_devices(2, *argv, "--devices", "2")
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    one, two = json.loads(out), json.loads(parallel.stdout)
    assert (one["devices"], two["devices"]) == (1, 2)
    # float32: the experts' sums in another order only (float32 rounding).
    assert [c["tokens"] for c in two["completions"]] == [c["tokens"] for c in one["completions"]]
    assert two["stats"]["prefill_tokens"] == one["stats"]["prefill_tokens"]  # the padding row is not counted


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache", ["fp8", "bf16"])
def test_devices_over_the_gpus_gives_the_tokens_of_one_gpu(capsys, tmp_path, kv_cache):
    # The compiled write and decode kernels inside the data-parallel program, each GPU on its
    # own rows and pages, the 8 experts split over the GPUs (2, 4 or 8 of them).
    gpus = len(jax.devices("gpu"))
    if gpus < 2:
        pytest.skip(f"needs two or more GPUs, found {gpus}")
    batch = tmp_path / "prompts.txt"
    batch.write_text("def \nThe river\nimport numpy as\n")
    argv = ["--batch-file", str(batch), "--max-new-tokens", "16", "--json", "--dtype", "float32",
            "--kv-cache", kv_cache]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err[-3000:]
    code, parallel, err = _run(capsys, *argv, "--devices", str(gpus))
    assert code == 0, err[-3000:]
    one, every = json.loads(out), json.loads(parallel)
    assert (one["devices"], every["devices"]) == (1, gpus)
    assert [c["tokens"] for c in every["completions"]] == [c["tokens"] for c in one["completions"]]
    assert len(set(one["completions"][0]["tokens"])) >= 3  # not a constant stream


def test_devices_that_do_not_divide_the_experts_exit_2_naming_the_flag():
    result = _cli_on_cpu_devices(3, "--prompt", "def ", "--devices", "3")  # 8 experts, 3 devices
    assert result.returncode == 2
    assert result.stderr.startswith("snapmla_jax.generate: error: --devices: 3 devices: sharding:")
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize("flags, message", [
    (["--devices", "0"], "--devices: expected 1 to 1 (the devices JAX sees), got 0"),
    (["--devices", "2"], "--devices: expected 1 to 1 (the devices JAX sees), got 2"),
    (["--devices", "1", "--shard-experts"], "--shard-experts: not allowed with argument --devices"),
])
def test_bad_devices_exit_2_naming_the_flag(capsys, flags, message):
    code, out, err = _run(capsys, "--prompt", "def ", *flags)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1, err


BUDGET_ON_TWO_DEVICES = """
import sys
import snapmla_jax.generate as g
# Three pages of the demo model's fp8 cache a device (4 layers x 64 tokens x 644 B a page).
g.cache_budget = lambda devices=None: (3 * 4 * 64 * 644, "a 3-page test budget")
sys.exit(g.main(["--batch-file", sys.argv[1], "--max-new-tokens", "200", "--devices", "2", "--backend", "xla"]))
"""


def test_devices_whose_share_of_the_cache_does_not_fit_exit_2_saying_what_would(tmp_path):
    batch = tmp_path / "prompts.txt"
    batch.write_text("def \nThe river\nimport numpy as\n")  # rows 0-1 on device 0, row 2 and a padding row on 1
    result = run_with_cpu_devices(2, ["-c", BUDGET_ON_TWO_DEVICES, batch])
    assert result.returncode == 2, result.stderr[-3000:]
    # 200 new tokens: 4 pages a row, 8 a device; 60 new tokens keep every row in one page (2 a device).
    assert result.stderr.startswith("snapmla_jax.generate: error: --batch-file: 3 prompts with --max-new-tokens "
                                    "200 need 0.00 GiB of fp8 KV cache on one of the 2 devices (each holds its "
                                    "share of the prompts), more than a 3-page test budget; all 3 with "
                                    "--max-new-tokens"), result.stderr
    assert result.stderr.count("\n") == 1

"""The long-context retrieval scorer: oracle models it must score 1 and 0, its cache path against the
full forward, the emulated schemes against quant_report, and the CLI on a tiny model."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cli_checks import assert_usage_error, tree_snapshot
from snapmla_jax import byte_corpus as bc
from snapmla_jax import fidelity_long as fl
from snapmla_jax import long_context_tasks as lct
from snapmla_jax import train_demo as td
from snapmla_jax.cache import LatentCache
from snapmla_jax.models import MLAModel, save_checkpoint
from snapmla_jax.quant_report import quant_error_report


@pytest.fixture(scope="module")
def tiny_model():
    return MLAModel(td.tiny_config(), rngs=nnx.Rngs(3), dtype=jnp.float32)


@pytest.fixture(scope="module")
def tasks():
    return [lct.make_task(kind, 256, depth, 0) for kind in ("passkey", "copy") for depth in (0.0, 1.0)]


class OracleModel(nnx.Module):
    """Knows the tokens [B, T]: predicts the next one (shifted by ``shift``) wherever it is fed the right
    token at the right position, and byte 0 elsewhere. Its cache is a placeholder."""

    def __init__(self, tokens: np.ndarray, shift: int):
        self.tokens = nnx.Variable(jnp.asarray(tokens, jnp.int32))
        self.shift = shift

    def init_cache(self, num_pages, page_size, kv_cache):
        return (LatentCache.create(num_pages, page_size, kv_lora_rank=128, rope_dim=64, dtype=kv_cache),)

    def decode(self, input_ids, caches, block_table, seq_lens, *, backend, kv_transform, q_transform, query_terms=1,
               qk_promotion=None):
        tokens = self.tokens[...]
        positions = seq_lens[:, None] - input_ids.shape[1] + jnp.arange(input_ids.shape[1])
        fed_right = input_ids == jnp.take_along_axis(tokens, positions, axis=1)
        following = jnp.take_along_axis(tokens, jnp.minimum(positions + 1, tokens.shape[1] - 1), axis=1)
        guess = jnp.where(fed_right, (following + self.shift) % bc.NUM_BYTES, 0)
        return 30.0 * jax.nn.one_hot(guess, bc.VOCAB_SIZE), caches

    def prefill(self, input_ids, lengths, caches, block_table, *, backend, last_only):
        """The last prompt position's prediction ([B, vocab]): the token after the prompt, if the
        prompt is the known tokens' prefix."""
        assert last_only
        tokens = self.tokens[...]
        columns = jnp.arange(input_ids.shape[1])
        known = jnp.all((input_ids == tokens[:, :input_ids.shape[1]]) | (columns >= lengths[:, None]), axis=1)
        following = jnp.take_along_axis(tokens, lengths[:, None], axis=1)[:, 0]
        guess = jnp.where(known, (following + self.shift) % bc.NUM_BYTES, 0)
        return 30.0 * jax.nn.one_hot(guess, bc.VOCAB_SIZE), caches


@pytest.mark.parametrize("prefill", [False, True])
def test_a_model_that_knows_the_answer_scores_one(tasks, prefill):
    oracle = OracleModel(np.stack([t.tokens for t in tasks]), shift=0)
    # chunk 3 < the longest answer: a prefilled batch's answers take several decode calls.
    score = fl.retrieval_accuracy(oracle, tasks, "fp8", backend="xla", chunk=3 if prefill else 100,
                                  batch_size=len(tasks), prefill=prefill)
    assert score.accuracy == 1.0 and (score.byte_correct == 1.0).all()
    assert score.bits_per_byte < 1e-3
    assert (score.context_bits is None) == prefill


@pytest.mark.parametrize("prefill", [False, True])
def test_a_model_that_never_knows_the_answer_scores_zero(tasks, prefill):
    oracle = OracleModel(np.stack([t.tokens for t in tasks]), shift=1)
    score = fl.retrieval_accuracy(oracle, tasks, "bf16", backend="xla", chunk=100, batch_size=len(tasks),
                                  prefill=prefill)
    assert score.accuracy == 0.0 and (score.byte_correct == 0.0).all()
    assert score.bits_per_byte > 10


def test_score_answers_counts_exact_and_per_byte_matches():
    logprobs = np.log(np.full((3, 4), 0.1))
    logprobs[np.arange(3), [1, 2, 0]] = np.log(0.7)
    score = fl.score_answers([logprobs, logprobs], [np.array([1, 2, 0]), np.array([1, 2, 3])])
    assert score.correct.tolist() == [True, False]
    assert score.byte_correct.tolist() == pytest.approx([1.0, 2 / 3])
    assert score.answer_bits[0] == pytest.approx(-np.log2(0.7))


def test_paired_difference_counts_discordant_tasks_and_the_mean_bits_difference():
    rng = np.random.default_rng()
    n = int(rng.integers(5, 40))
    ref = fl.RetrievalScore(rng.random(n) < 0.6, rng.random(n), rng.random(n) * 3)
    other = fl.RetrievalScore(rng.random(n) < 0.6, rng.random(n), rng.random(n) * 3)
    d = fl.paired_difference(other, ref)
    # The discordant counts alone give the accuracy difference.
    assert (d["only_this_correct"] - d["only_reference_correct"]) / n == pytest.approx(other.accuracy - ref.accuracy)
    assert d["only_this_correct"] == sum(o and not r for o, r in zip(other.correct, ref.correct))
    diff = other.answer_bits.astype(np.float64) - ref.answer_bits
    assert d["answer_bits_per_byte_diff"] == pytest.approx(other.bits_per_byte - ref.bits_per_byte)
    assert d["answer_bits_per_byte_diff_stderr"] == pytest.approx(diff.std(ddof=1) / np.sqrt(n))
    same = fl.paired_difference(ref, ref)
    assert same == {"only_this_correct": 0, "only_reference_correct": 0, "answer_bits_per_byte_diff": 0.0,
                    "answer_bits_per_byte_diff_stderr": 0.0}
    with_context = fl.paired_difference(dataclasses.replace(other, context_bits=np.arange(n, dtype=float)),
                                        dataclasses.replace(ref, context_bits=np.zeros(n)))
    assert with_context["context_bits_per_byte_diff"] == pytest.approx((n - 1) / 2)
    assert with_context["context_bits_per_byte_diff_stderr"] == pytest.approx(np.arange(n).std(ddof=1) / np.sqrt(n))


def test_accuracy_difference_and_its_standard_error_come_from_the_discordant_tasks():
    rng = np.random.default_rng()
    n = int(rng.integers(20, 200))
    ref, this = rng.random(n) < 0.7, rng.random(n) < 0.7
    row = {"tasks": n, "vs_reference": fl.paired_difference(fl.RetrievalScore(this, this * 1.0, np.zeros(n)),
                                                            fl.RetrievalScore(ref, ref * 1.0, np.zeros(n)))}
    diff, err = fl.accuracy_difference(row)
    per_task = this.astype(float) - ref
    assert diff == pytest.approx(per_task.mean())
    # The standard error of a mean of per-task differences in {-1, 0, 1}, with the population variance.
    assert err == pytest.approx(per_task.std() / np.sqrt(n))


def test_evaluate_pairs_every_later_scheme_with_the_first(tasks, monkeypatch):
    # Scheme "fp8" answers every task, "bf16" only the even ones: the rows must say so task by task.
    n = len(tasks)
    fixed = {"bf16": fl.RetrievalScore(np.arange(n) % 2 == 0, np.ones(n), np.full(n, 2.0), np.full(n, 1.0)),
             "fp8": fl.RetrievalScore(np.ones(n, bool), np.ones(n), np.full(n, 1.5), np.full(n, 1.25))}
    monkeypatch.setattr(fl, "retrieval_scores", lambda model, ts, schemes, **kw: {s: fixed[s] for s in schemes})
    monkeypatch.setattr(fl.long_context_tasks, "make_tasks", lambda *a, **kw: tasks)
    rows = fl.evaluate(None, contexts=[tasks[0].context], depths=[0.5], kinds=sorted({t.kind for t in tasks}),
                       trials=1, schemes=["bf16", "fp8"], text=None, backend="xla", chunk=1, batch_size=1,
                       log=lambda *_: None)
    assert all("vs_reference" not in r for r in rows if r["scheme"] == "bf16")
    paired = [r for r in rows if r["scheme"] == "fp8"]
    odd = np.arange(n) % 2 == 1
    assert sum(r["vs_reference"]["only_this_correct"] for r in paired) == int(odd.sum())
    assert all(r["reference"] == "bf16" and r["vs_reference"]["only_reference_correct"] == 0 for r in paired)
    assert all(r["vs_reference"]["answer_bits_per_byte_diff"] == pytest.approx(-0.5) for r in paired)
    assert all(r["vs_reference"]["context_bits_per_byte_diff"] == pytest.approx(0.25) for r in paired)
    assert all(r["context_bits_per_byte"] == 1.25 for r in paired)
    table = fl.to_markdown({"trained_context_note": "", "backend": "xla", "trials": 1, "rows": paired})
    assert "| 1.2500 |" in table and "/ -0; answer -0.5000 +- 0.0000; context +0.25000 +- 0.00000 |" in table


def test_evaluate_pairs_the_third_scheme_on_with_the_one_before(tasks, monkeypatch):
    # A ladder bf16 -> emulated -> fp8 whose per-task bits step by -0.5 then +0.125 on even tasks only:
    # vs_previous must hold each step, vs_reference their sum.
    n = len(tasks)
    even = np.arange(n) % 2 == 0
    fixed = {"bf16": fl.RetrievalScore(np.zeros(n, bool), np.ones(n), np.full(n, 2.0), np.full(n, 1.0)),
             "emulated_rope_aware_token": fl.RetrievalScore(even, np.ones(n), np.where(even, 1.5, 2.0),
                                                            np.full(n, 1.0)),
             "fp8": fl.RetrievalScore(np.ones(n, bool), np.ones(n), np.where(even, 1.625, 2.0), np.full(n, 1.0))}
    monkeypatch.setattr(fl, "retrieval_scores", lambda model, ts, schemes, **kw: {s: fixed[s] for s in schemes})
    monkeypatch.setattr(fl.long_context_tasks, "make_tasks", lambda *a, **kw: tasks)
    kinds = sorted({t.kind for t in tasks})
    rows = fl.evaluate(None, contexts=[tasks[0].context], depths=[0.5], kinds=kinds, trials=1,
                       schemes=list(fixed), text=None, backend="xla", chunk=1, batch_size=1, log=lambda *_: None)
    by_scheme = {s: [r for r in rows if r["scheme"] == s] for s in fixed}
    assert all("vs_previous" not in r for r in by_scheme["bf16"] + by_scheme["emulated_rope_aware_token"])
    fp8 = by_scheme["fp8"]
    assert all(r["previous"] == "emulated_rope_aware_token" and r["reference"] == "bf16" for r in fp8)
    # Each kind holds one even and one odd task (tasks: two depths per kind).
    assert all(r["vs_previous"]["answer_bits_per_byte_diff"] == pytest.approx(0.0625) for r in fp8)
    assert all(r["vs_reference"]["answer_bits_per_byte_diff"] == pytest.approx(-0.1875) for r in fp8)
    assert sum(r["vs_previous"]["only_this_correct"] for r in fp8) == int((~even).sum())
    table = fl.to_markdown({"trained_context_note": "", "backend": "xla", "trials": 1, "rows": fp8})
    assert "answer +0.0625 +- 0.0625" in table and "answer -0.1875 +- 0.1875" in table


def test_fp8_xla_reads_the_fp8_cache_through_the_xla_path_whatever_the_backend(tiny_model, tasks, monkeypatch):
    tokens, starts = np.stack([t.tokens for t in tasks]), [t.answer_start for t in tasks]
    fp8 = fl.teacher_forced(tiny_model, tokens, starts, "fp8", backend="xla", chunk=100)
    decode_chunk, backends = fl._decode_chunk, []

    def recording(model, input_ids, targets, caches, block_table, seq_lens, backend, *rest):
        backends.append(backend)
        return decode_chunk(model, input_ids, targets, caches, block_table, seq_lens, backend, *rest)

    monkeypatch.setattr(fl, "_decode_chunk", recording)
    # "pallas" here would run the kernels in the interpreter; the scheme must override it.
    via_xla = fl.teacher_forced(tiny_model, tokens, starts, "fp8_xla", backend="pallas", chunk=100)
    assert backends and set(backends) == {"xla"}
    np.testing.assert_array_equal(np.concatenate(via_xla.answer_logprobs), np.concatenate(fp8.answer_logprobs))
    np.testing.assert_array_equal(via_xla.context_bits, fp8.context_bits)


@pytest.mark.parametrize("prefill", [False, True])
def test_the_two_term_query_scheme_decodes_the_fp8_cache_with_two_query_terms(tiny_model, tasks, monkeypatch, prefill):
    """fp8_two_term_query: the same FP8 cache as fp8, every decode call with ``query_terms=2``,
    which moves the answers' log-probabilities by the query's rounding alone (~2^-4 of a score
    before, ~2^-8 after: small, and not zero)."""
    tokens, starts = np.stack([t.tokens for t in tasks]), [t.answer_start for t in tasks]
    fp8 = fl.teacher_forced(tiny_model, tokens, starts, "fp8", backend="xla", chunk=100, prefill=prefill)
    decode_chunk, terms = fl._decode_chunk, []

    def recording(*args):
        terms.append(args[9:])  # (query_terms, qk_promotion)
        return decode_chunk(*args)

    monkeypatch.setattr(fl, "_decode_chunk", recording)
    two = fl.teacher_forced(tiny_model, tokens, starts, "fp8_two_term_query", backend="xla", chunk=100,
                            prefill=prefill)
    assert terms and set(terms) == {(2, None)}
    diff = np.abs(np.concatenate(two.answer_logprobs) - np.concatenate(fp8.answer_logprobs))
    assert 0 < diff.max() < 0.5


def test_the_qk_sums_scheme_decodes_the_fp8_cache_with_qk_promotion_128(tiny_model, tasks, monkeypatch):
    """fp8_qk_sums_128: the same FP8 cache as fp8, every decode call with ``qk_promotion=128``. The
    XLA path sums its products in float32 whatever the chains, so there its answers are fp8's,
    bit for bit (the kernels' chains show only compiled)."""
    tokens, starts = np.stack([t.tokens for t in tasks]), [t.answer_start for t in tasks]
    fp8 = fl.teacher_forced(tiny_model, tokens, starts, "fp8", backend="xla", chunk=100)
    decode_chunk, asked = fl._decode_chunk, []

    def recording(*args):
        asked.append(args[9:])  # (query_terms, qk_promotion)
        return decode_chunk(*args)

    monkeypatch.setattr(fl, "_decode_chunk", recording)
    sums = fl.teacher_forced(tiny_model, tokens, starts, "fp8_qk_sums_128", backend="xla", chunk=100)
    assert asked and set(asked) == {(1, 128)}
    np.testing.assert_array_equal(np.concatenate(sums.answer_logprobs), np.concatenate(fp8.answer_logprobs))


def test_bf16_cache_answer_logprobs_match_the_full_forward(tiny_model, tasks):
    tokens = np.stack([t.tokens for t in tasks])
    starts = [t.answer_start for t in tasks]
    got = fl.teacher_forced(tiny_model, tokens, starts, "bf16", backend="xla", chunk=100)
    full = np.asarray(jax.nn.log_softmax(tiny_model(jnp.asarray(tokens)), axis=-1), np.float64)
    for row, (lp, start) in enumerate(zip(got.answer_logprobs, starts)):
        want = full[row, start - 1:-1]
        # bf16 rounding of the cached latents and queries (see test_fidelity); a position off by one
        # would move every log-probability by far more.
        assert lp.shape == want.shape and np.abs(lp - want).mean() < 1e-2 and np.abs(lp - want).max() < 0.1
        # The context's bits: every position before the answer predicting the next token. An untrained
        # model's log-probabilities differ from one token to the next by ~1e-2, a mean over ~150 of them
        # by far less than a position off by one would move it.
        context = -full[row, np.arange(start - 1), tokens[row, 1:start]].mean() / np.log(2)
        assert got.context_bits[row] == pytest.approx(context, abs=2e-3)


def test_prefilled_answers_match_the_full_forward_and_their_first_byte_reads_no_cache(tiny_model, tasks):
    tokens = np.stack([t.tokens for t in tasks])
    starts = [t.answer_start for t in tasks]
    assert len({len(t.answer) for t in tasks}) > 1  # answers of several lengths in one batch
    full = np.asarray(jax.nn.log_softmax(tiny_model(jnp.asarray(tokens)), axis=-1), np.float64)
    bf16 = fl.teacher_forced(tiny_model, tokens, starts, "bf16", backend="xla", chunk=4, prefill=True)
    fp8 = fl.teacher_forced(tiny_model, tokens, starts, "fp8", backend="xla", chunk=4, prefill=True)
    assert bf16.context_bits is None
    for row, start in enumerate(starts):
        want = full[row, start - 1:-1]
        got = bf16.answer_logprobs[row]
        assert got.shape == want.shape
        # The first answer byte comes from the prefill: the same float32 full attention as the forward,
        # in query blocks, so only summation order differs (float32, 2**-24 relative).
        np.testing.assert_allclose(got[0], want[0], atol=1e-4)
        # The rest read the bf16 cache through decode (bf16 rounding of the latents and queries, as in
        # test_bf16_cache_answer_logprobs_match_the_full_forward).
        assert np.abs(got - want).mean() < 1e-2 and np.abs(got - want).max() < 0.1
        # The FP8 cache changes only what reads it: not the prefill's prediction of the first byte.
        np.testing.assert_array_equal(fp8.answer_logprobs[row][0], got[0])
        assert np.abs(fp8.answer_logprobs[row][1:] - got[1:]).max() > 0


def test_a_prefilled_emulated_scheme_rounds_what_the_prefill_writes(tiny_model, tasks):
    tokens, starts = np.stack([t.tokens for t in tasks]), [t.answer_start for t in tasks]
    bf16 = fl.teacher_forced(tiny_model, tokens, starts, "bf16", backend="xla", chunk=100, prefill=True)
    emulated = fl.teacher_forced(tiny_model, tokens, starts, "emulated_per_token_576", backend="xla", chunk=100,
                                 prefill=True)
    for got, want in zip(emulated.answer_logprobs, bf16.answer_logprobs):
        np.testing.assert_array_equal(got[0], want[0])  # the prefill's own attention reads no cache
        assert 0 < np.abs(got[1:] - want[1:]).max() < 0.5  # the decoded bytes read the rounded context


@pytest.mark.parametrize("scheme", list(fl.CACHE_SCHEMES))
def test_every_scheme_scores_a_tiny_model_near_its_bf16_bits(tiny_model, tasks, scheme):
    bf16 = fl.retrieval_accuracy(tiny_model, tasks, "bf16", backend="xla", chunk=100)
    score = fl.retrieval_accuracy(tiny_model, tasks, scheme, backend="xla", chunk=100)
    assert score.correct.shape == (len(tasks),) and 0.0 <= score.accuracy <= 1.0
    # An untrained model is ~uniform over 264 tokens; FP8's per-element error (~2**-4) barely moves that.
    assert abs(score.bits_per_byte / bf16.bits_per_byte - 1) < 0.01


def test_an_emulated_scheme_changes_what_the_cache_holds(tiny_model, tasks):
    tokens, starts = np.stack([t.tokens for t in tasks]), [t.answer_start for t in tasks]
    bf16 = fl.teacher_forced(tiny_model, tokens, starts, "bf16", backend="xla", chunk=100).answer_logprobs
    emulated = fl.teacher_forced(tiny_model, tokens, starts, "emulated_per_token_576", backend="xla",
                                 chunk=100).answer_logprobs
    # Same BF16 cache, so any difference is the FP8 round trip applied before the write.
    diff = np.abs(np.concatenate(bf16) - np.concatenate(emulated))
    assert 0 < diff.max() < 0.5


def test_unknown_scheme_and_bad_answer_starts_are_value_errors(tiny_model, tasks):
    tokens = np.stack([t.tokens for t in tasks])
    with pytest.raises(ValueError, match="scheme: expected one of"):
        fl.teacher_forced(tiny_model, tokens, [10] * len(tasks), "int4", backend="xla")
    with pytest.raises(ValueError, match="answer_starts"):
        fl.teacher_forced(tiny_model, tokens, [0] * len(tasks), "bf16", backend="xla")
    with pytest.raises(ValueError, match="one context length"):
        fl.retrieval_accuracy(tiny_model, [tasks[0], lct.make_task("kv", 300, 0.5, 0)], "bf16", backend="xla")


def test_emulated_schemes_reproduce_quant_report_errors():
    rng = np.random.default_rng(0)
    latent = rng.standard_normal((64, 512)).astype(np.float32)
    rope = (30 * rng.standard_normal((64, 64))).astype(np.float32)
    report = quant_error_report(latent, rope)
    for scheme, fn in (("per_token_576", fl.per_token_576_round_trip),
                       ("per_token_block128", fl.per_token_block128_round_trip),
                       ("rope_aware_token", fl.rope_aware_token_round_trip)):
        lat_hat, rope_hat = (np.asarray(a, np.float64) for a in fn(jnp.asarray(latent), jnp.asarray(rope)))
        rel = np.linalg.norm(lat_hat - latent) / np.linalg.norm(latent)
        assert rel == pytest.approx(report[scheme].latent_rel_error, rel=1e-5)
        rope_rel = np.linalg.norm(rope_hat - rope) / np.linalg.norm(rope)
        assert rope_rel == pytest.approx(report[scheme].rope_rel_error if scheme == "per_token_576" else 0.0,
                                         rel=1e-5, abs=1e-12)


def test_yarn_extension_keeps_the_weights_and_stretches_only_rope(tiny_model):
    tokens = jnp.asarray(np.random.default_rng().integers(0, bc.NUM_BYTES, (2, 300)), jnp.int32)
    base = np.asarray(tiny_model(tokens), np.float64)
    same = fl.yarn_extended(tiny_model, 1.0)  # YaRN at factor 1 is the default RoPE, mscale 1
    assert same.cfg.rope_type == "yarn" and same.cfg.max_position_embeddings == tiny_model.cfg.max_position_embeddings
    np.testing.assert_allclose(np.asarray(same(tokens), np.float64), base, rtol=1e-5, atol=1e-5)
    stretched = fl.yarn_extended(tiny_model, 4.0)
    cfg = stretched.cfg
    assert (cfg.rope_factor, cfg.rope_original_max_position, cfg.max_position_embeddings) == (
        4.0, tiny_model.cfg.max_position_embeddings, 4 * tiny_model.cfg.max_position_embeddings)
    assert stretched.embed_tokens.embedding[...] is tiny_model.embed_tokens.embedding[...]
    # Stretched RoPE moves every position past the first (and YaRN's cos/sin factor all of them).
    assert np.abs(np.asarray(stretched(tokens), np.float64) - base).max() > 1e-3
    assert tiny_model.cfg.rope_type == "default"  # the original is untouched
    with pytest.raises(ValueError, match="yarn_factor: the model's RoPE is already 'yarn'"):
        fl.yarn_extended(stretched, 2.0)
    with pytest.raises(ValueError, match="yarn_factor: expected a factor >= 1"):
        fl.yarn_extended(tiny_model, 0.5)


def test_trained_context_note_says_when_contexts_pass_it():
    assert "beyond" not in fl.trained_context_note(512, [256, 512])
    note = fl.trained_context_note(512, [256, 4096])
    assert "512 tokens" in note and "[4096] are beyond it" in note and "chance" in note
    stretched = fl.trained_context_note(512, [256, 2048], yarn_factor=4)
    assert "stretched 4x by YaRN" in stretched and "2048 positions" in stretched and "chance" not in stretched
    assert "[2048] are beyond the trained windows" in stretched


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model):
    path = tmp_path_factory.mktemp("long") / "model"
    save_checkpoint(tiny_model, path)
    bc.write_file_list(path / "heldout_files.json", bc.split_files().heldout_files[:20], heldout_fraction=0.05)
    return path


def test_cli_writes_json_markdown_and_png_and_states_the_trained_context(model_dir, tmp_path, capsys):
    out = {"json": tmp_path / "r.json", "markdown": tmp_path / "r.md", "plot": tmp_path / "r.png"}
    assert fl.main(["--model", str(model_dir), "--contexts", "200", "300", "--depths", "0", "1", "--trials", "1",
                    "--tasks", "passkey", "kv", "--schemes", "bf16", "fp8", "--chunk", "256", "--backend", "xla",
                    *[f"--{k}={v}" for k, v in out.items()]]) == 0
    stdout = capsys.readouterr().out
    results = json.loads(out["json"].read_text())
    assert results["trained_context"] == 256 and "[300] are beyond it" in stdout
    assert len(results["rows"]) == 2 * 2 * 2 * 2  # contexts x depths x schemes x kinds
    assert {(r["context"], r["scheme"]) for r in results["rows"]} == {(c, s) for c in (200, 300)
                                                                       for s in ("bf16", "fp8")}
    assert all(0 <= r["accuracy"] <= 1 and r["tasks"] == 1 for r in results["rows"])
    assert "| passkey | 200 | 0 | bf16 |" in out["markdown"].read_text()
    assert out["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all("context_bits_per_byte" in r for r in results["rows"])

    # --from-json: a second run's rows join the first's; a cell both hold is kept once, from the first of
    # the runs of most trials.
    moved = [dict(r, context=r["context"] + 200) for r in results["rows"]]
    other = dict(results, trials=2, command="second", rows=moved)
    (tmp_path / "runs.json").write_text(json.dumps({"runs": [results, other, results]}))
    combined = {"json": tmp_path / "c.json", "markdown": tmp_path / "c.md", "plot": tmp_path / "c.png"}
    assert fl.main(["--from-json", str(tmp_path / "runs.json"), *[f"--{k}={v}" for k, v in combined.items()]]) == 0
    both = json.loads(combined["json"].read_text())
    assert len(both["rows"]) == 2 * len(results["rows"]) and both["commands"][1] == "second"
    assert {r["context"] for r in both["rows"]} == {200, 300, 400, 500} and "[300, 400, 500] are beyond it" in both[
        "trained_context_note"]
    assert combined["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A later run of more trials holding one of the cells replaces that cell.
    larger = dict(results, trials=3, command="larger", rows=[dict(results["rows"][0], accuracy=0.5)])
    (tmp_path / "larger.json").write_text(json.dumps({"runs": [results, larger]}))
    assert fl.main(["--from-json", str(tmp_path / "larger.json"), "--json", str(combined["json"])]) == 0
    kept = json.loads(combined["json"].read_text())["rows"]
    cell = lambda r: (r["kind"], r["context"], r["depth"], r["scheme"])
    assert len(kept) == len(results["rows"]) and [r["accuracy"] for r in kept if cell(r) == cell(larger["rows"][0])] == [0.5]
    assert fl.main(["--from-json", str(out["json"]), str(tmp_path / "runs.json"), "--trials", "2",
                    "--json", str(combined["json"])]) == 0
    assert {r["context"] for r in json.loads(combined["json"].read_text())["rows"]} == {400, 500}

    # --yarn-factor: the same tasks through the stretched model; the JSON and note say so.
    assert fl.main(["--model", str(model_dir), "--contexts", "300", "--depths", "1", "--trials", "1", "--tasks",
                    "passkey", "--schemes", "bf16", "--chunk", "256", "--backend", "xla", "--yarn-factor", "2",
                    "--json", str(out["json"])]) == 0
    yarn = json.loads(out["json"].read_text())
    assert yarn["yarn_factor"] == 2 and "stretched 2x by YaRN" in yarn["trained_context_note"]
    base_row = next(r for r in results["rows"] if (r["kind"], r["context"], r["depth"], r["scheme"]) ==
                    ("passkey", 300, 1.0, "bf16"))
    assert yarn["rows"][0]["answer_bits_per_byte"] != base_row["answer_bits_per_byte"]
    (tmp_path / "mixed.json").write_text(json.dumps({"runs": [results, yarn]}))
    assert fl.main(["--from-json", str(tmp_path / "mixed.json")]) == 2
    assert "runs of different RoPE stretches at context 300" in capsys.readouterr().err
    # A stretched run at a context of its own joins the unstretched ones; its rows and the note say so.
    far = dict(yarn, trials=2, rows=[dict(r, context=600) for r in yarn["rows"]])
    (tmp_path / "mixed.json").write_text(json.dumps({"runs": [results, far]}))
    assert fl.main(["--from-json", str(tmp_path / "mixed.json"), "--trials", "1", "2", "--json",
                    str(combined["json"]), "--plot", str(combined["plot"])]) == 0
    joined = json.loads(combined["json"].read_text())
    assert {r["context"] for r in joined["rows"]} == {200, 300, 600}
    assert {r.get("yarn_factor") for r in joined["rows"] if r["context"] == 600} == {2}
    assert all("yarn_factor" not in r for r in joined["rows"] if r["context"] != 600)
    assert "[300, 600] are beyond it" not in joined["trained_context_note"]
    assert "[300] are beyond it" in joined["trained_context_note"] and (
        "Contexts [600]: RoPE stretched 2x by YaRN" in joined["trained_context_note"])

    # --prefill: contexts prefilled as generate serves them; their bits are not measured, and such a
    # run does not combine with decoded ones.
    assert fl.main(["--model", str(model_dir), "--contexts", "200", "--depths", "0", "--trials", "1", "--tasks",
                    "passkey", "copy", "--schemes", "bf16", "fp8", "--chunk", "8", "--backend", "xla", "--prefill",
                    "--json", str(out["json"]), "--markdown", str(out["markdown"])]) == 0
    prefilled = json.loads(out["json"].read_text())
    assert prefilled["prefill"] is True and len(prefilled["rows"]) == 4
    assert all("context_bits_per_byte" not in r for r in prefilled["rows"])
    assert "Contexts prefilled" in out["markdown"].read_text()
    (tmp_path / "fills.json").write_text(json.dumps({"runs": [results, prefilled]}))
    assert fl.main(["--from-json", str(tmp_path / "fills.json")]) == 2
    assert "filled differently" in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--contexts", "many"], "--contexts: expected an int, got 'many'"),
    (["--contexts", "20"], "--contexts: context: 20 tokens are too short"),
    (["--depths", "2"], "--depths: expected fractions in [0, 1], got 2.0"),
    (["--trials", "0"], "--trials: expected an int >= 1"),
    (["--chunk", "0"], "--chunk: expected an int >= 1"),
    (["--schemes", "int4"], "--schemes: expected one of"),
    (["--tasks", "sudoku"], "--tasks: expected one of"),
    (["--backend", "bogus"], "--backend: expected one of"),
    (["--model", "/nope"], "--model: /nope is not a directory"),
    (["--model", "."], "--model: expected a train_demo directory"),
    (["--json", "."], "--json: . is a directory"),
    (["--plot", "nowhere/f.png"], "--plot: the directory nowhere does not exist"),
    (["--yarn-factor", "0.5"], "--yarn-factor: expected a factor >= 1, got 0.5"),
    (["--from-json", "none.json"], "--from-json: cannot read none.json as JSON"),
    (["--from-json", "list.json"], "--from-json: list.json is not a fidelity_long --json output"),
    (["--from-json", "run.json", "--trials", "3"], "--from-json: expected at least one run of 3 trials"),
    (["--from-json", "run.json", "--trials", "3", "2"], "--from-json: expected at least one run of 2 or 3 trials"),
    (["--trials", "3", "2"], "--trials: expected one count when measuring"),
    (["--from-json", "run.json", "--trials", "3", "0"], "--trials: expected an int >= 1, got 0"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fl, "evaluate", lambda *_, **__: pytest.fail("evaluation started on bad input"))
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "run.json").write_text(json.dumps({"rows": [], "trials": 1, "trained_context": 256, "backend": "xla",
                                                   "command": "c"}))
    before = tree_snapshot(tmp_path)
    code = fl.main(argv)
    _, err = capsys.readouterr()
    assert_usage_error(code, err, needle)
    assert err.startswith("snapmla_jax.fidelity_long: error: "), err
    assert tree_snapshot(tmp_path) == before


def test_help_exits_0(capsys):
    assert fl.main(["--help"]) == 0
    assert "--contexts" in capsys.readouterr().out


def test_the_shipped_long_model_retrieves_a_passkey_on_cpu(tmp_path):
    """The default --model is the shipped model trained to retrieve at 16k (not the demo model):
    its config says so, and it finds a passkey in a 2k context through the FP8 cache. A model
    that never learned the task scores 0 (chance 1e-5 per answer); the shipped one found 100 of
    100 passkeys at 16k, depth 0.5, and 39 of 48 at depth 0 on an H200, so 3 of 4 at 2k asks
    for the model it is, not for luck."""
    out = tmp_path / "r.json"
    assert fl.main(["--contexts", "2048", "--depths", "0.5", "--trials", "4", "--tasks", "passkey",
                    "--schemes", "fp8", "--chunk", "1024", "--backend", "xla", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["trained_context"] == 16384
    (row,) = results["rows"]
    assert row["accuracy"] >= 0.75, row


@pytest.mark.parametrize("scheme", [s for s in fl.CACHE_SCHEMES if s.startswith("emulated_")])
def test_emulated_schemes_hold_no_float8_conversion_a_gpu_compiler_could_fold(scheme):
    """XLA's GPU compiler folds float32 -> float8 -> float32 into nothing, which made the emulated
    schemes score exactly as the BF16 cache on an H200; their transforms round in arithmetic."""
    spec = fl.CACHE_SCHEMES[scheme]
    text = jax.jit(spec.kv_transform).lower(jnp.ones((2, 3, 512)), jnp.ones((2, 3, 64))).as_text()
    assert "f8E4M3" not in text
    if spec.q_transform is not None:
        assert "f8E4M3" not in jax.jit(spec.q_transform).lower(jnp.ones((2, 3, 4, 512))).as_text()


def test_the_query_scheme_rounds_each_latent_query_row_as_the_fp8_kernels_do(tiny_model, monkeypatch):
    # The first layer's latent query reaching mla_decode, with and without the scheme's q_transform: the
    # second must be the first in FP8 under one scale per (token, head) row over its R features, as
    # mla_decode_reference quantizes it (and the kernels), read back in the query's dtype.
    from snapmla_jax.models import attention
    from snapmla_jax.paging import allocate_pages
    seen, mla_decode = [], attention.mla_decode
    monkeypatch.setattr(attention, "mla_decode", lambda q, *a, **kw: seen.append(q) or mla_decode(q, *a, **kw))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, bc.NUM_BYTES, (3, 40)), jnp.int32)
    pages = allocate_pages([40] * 3, 0, page_size=fl.PAGE_SIZE)
    for q_transform in (None, fl.CACHE_SCHEMES["emulated_rope_aware_token_query"].q_transform):
        caches = tiny_model.init_cache(pages.num_pages, fl.PAGE_SIZE, kv_cache="bf16")
        tiny_model.decode(ids, caches, jnp.asarray(pages.block_table), jnp.full((3,), 40, jnp.int32),
                          backend="xla", q_transform=q_transform)
    layers = tiny_model.cfg.num_hidden_layers
    assert len(seen) == 2 * layers and seen[0].shape[-1] == tiny_model.cfg.kv_lora_rank
    plain, rounded = np.asarray(seen[0], np.float64), np.asarray(seen[layers], np.float64)
    scale = np.abs(plain).max(-1, keepdims=True) / 448
    values = rounded / scale
    # Every value an e4m3 value (4 significant bits) once divided by its row's scale, up to the
    # query dtype's rounding of value * scale (float32 here: 2**-23 relative).
    mantissa, _ = np.frexp(values)
    assert np.abs(mantissa * 16 - np.round(mantissa * 16)).max() < 1e-4
    np.testing.assert_allclose(np.abs(values).max(-1), 448, rtol=1e-6)
    # Round to nearest: within half an e4m3 spacing of the unrounded query (2**-4 of the value, 2**-10
    # among the subnormals), and not the query itself.
    assert (np.abs(values - plain / scale) <= np.maximum(np.abs(values) * 2.0 ** -4, 2.0 ** -10) + 1e-4).all()
    assert np.abs(values - plain / scale).max() > 0.1

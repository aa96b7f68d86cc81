"""The long-context task generators: exact lengths, needles where asked, answers that the context determines."""

import re

import numpy as np
import pytest

from snapmla_jax import byte_corpus as bc
from snapmla_jax import long_context_tasks as lct

KINDS = lct.TASK_KINDS


def text_of(tokens) -> bytes:
    return bytes(int(t) for t in tokens if t < bc.NUM_BYTES)


@pytest.fixture(scope="module")
def corpus():
    return lct.pseudo_text(50_000, np.random.default_rng(7))


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_task_other_seed_other_task(kind):
    a, b, c = (lct.make_task(kind, 700, 0.4, s) for s in (3, 3, 4))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("context", [300, 1000, 4096])
def test_context_length_is_exact_and_tokens_are_bos_then_bytes(kind, context, corpus):
    task = lct.make_task(kind, context, 0.5, 1, text=corpus)
    assert task.tokens.shape == (context,) and task.tokens.dtype == np.int32 and task.context == context
    assert task.tokens[0] == bc.BOS_ID
    assert ((task.tokens[1:] >= 0) & (task.tokens[1:] < bc.NUM_BYTES)).all()


@pytest.mark.parametrize("kind", KINDS)
def test_answer_positions_end_the_sequence_and_hold_the_answer(kind):
    task = lct.make_task(kind, 800, 0.3, 2)
    np.testing.assert_array_equal(task.tokens[task.answer_start:], task.answer)
    assert task.answer_start + len(task.answer) == task.context and len(task.answer) > 0


@pytest.mark.parametrize("kind", ["passkey", "multi_hop", "copy"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_lands_at_the_requested_depth(kind, depth):
    task = lct.make_task(kind, 2000, depth, 5)
    answer_needle = text_of(task.tokens[task.needle_start:]).split(b"\n")[1]
    needle_len = len(answer_needle) + 2  # its newline on either side
    question_start = int(np.flatnonzero(task.tokens[:task.answer_start] == ord("\n"))[-1])
    body_len = question_start - 1
    expected = 1 + depth * (body_len - needle_len)
    assert abs(task.needle_start - expected) <= 0.5
    # The needle holds the answer (after the cue, for copy).
    assert text_of(task.answer) in answer_needle


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_kv_asked_line_sits_at_the_depth_to_within_a_line(depth):
    task = lct.make_task("kv", 3000, depth, 1)
    line_width = len(b'table["000000"] = "000000"\n')
    body_len = task.context - 1 - len(b'\nassert table["000000"] == "') - 6
    assert abs(task.needle_start - 1 - depth * (body_len - line_width)) < line_width
    line = text_of(task.tokens[task.needle_start:task.needle_start + line_width])
    asked = text_of(task.tokens).rsplit(b"\n", 1)[1]
    assert line.startswith(asked[len(b"assert "):len(b'assert table["000000"]')])


def test_kv_keys_are_distinct_and_the_asked_key_gives_the_answer():
    task = lct.make_task("kv", 4000, 0.7, 9)
    pairs = re.findall(rb'^table\["([0-9a-f]{6})"\] = "([0-9a-f]{6})"$', text_of(task.tokens), re.M)
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)) > 100
    asked = re.search(rb'assert table\["([0-9a-f]{6})"\] == "', text_of(task.tokens)).group(1)
    assert dict(pairs)[asked] == text_of(task.answer)


@pytest.mark.parametrize("seed", range(5))
def test_multi_hop_chain_resolves_to_the_answer(seed, corpus):
    task = lct.make_task("multi_hop", 3000, 0.5, seed, text=corpus, num_hops=4)
    text = text_of(task.tokens)
    links = dict(re.findall(rb"^(v_[0-9a-f]{6}) = (v_[0-9a-f]{6})$", text, re.M))
    values = dict(re.findall(rb"^(v_[0-9a-f]{6}) = '(\d+)'$", text, re.M))
    name = re.search(rb"assert (v_[0-9a-f]{6}) == '", text).group(1)
    hops = 0
    while name in links:
        name, hops = links[name], hops + 1
    assert hops == 3 and values[name] == text_of(task.answer)


def test_copy_cue_appears_once_before_the_question_followed_by_the_answer():
    task = lct.make_task("copy", 2000, 0.2, 4, copy_cue=16, copy_span=24)
    text = text_of(task.tokens)
    cue = text[-(16 + 24):-24]
    assert text.count(cue) == 2 and text.index(cue) + 16 < len(text) - 40
    assert text[text.index(cue) + 16:][:24] == text_of(task.answer)


def test_filler_comes_from_the_given_text():
    source = np.frombuffer(b"0123456789" * 500, np.uint8).astype(np.int32)
    task = lct.make_task("passkey", 600, 1.0, 0, text=source)
    assert set(text_of(task.tokens[1:200])) <= set(b"0123456789")


def test_chance_is_the_alphabet_to_the_answer_length():
    assert lct.make_task("passkey", 500, 0.5, 0, key_digits=3).chance == pytest.approx(1e-3)


def test_make_tasks_gives_trials_per_kind_with_consecutive_seeds():
    tasks = lct.make_tasks(["passkey", "copy"], 500, 0.5, 3, seed=10)
    assert [(t.kind, t.seed) for t in tasks] == [("passkey", 10), ("passkey", 11), ("passkey", 12),
                                                  ("copy", 10), ("copy", 11), ("copy", 12)]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(kind="needle"), "kind: expected one of"),
    (dict(depth=1.5), "depth: expected a fraction in [0, 1], got 1.5"),
    (dict(depth=-0.1), "depth: expected a fraction"),
    (dict(context=0), "context: expected a positive int"),
    (dict(context=30), "context: 30 tokens are too short for a passkey task"),
    (dict(seed=-1), "seed: expected a non-negative int"),
    (dict(key_digits=0), "key_digits: expected an int >= 1"),
    (dict(kind="multi_hop", num_hops=1), "num_hops: expected an int >= 2"),
    (dict(kind="kv", context=60), "context: 60 tokens are too short for a kv task"),
    (dict(text=np.zeros((2, 2), np.int32)), "text: expected 1-D integer token ids"),
    (dict(text=np.arange(100, dtype=np.int32)), "text: 100 bytes of filler text cannot fill"),
])
def test_bad_parameters_raise_value_error_naming_them(kwargs, needle):
    args = dict(kind="passkey", context=500, depth=0.5, seed=0) | kwargs
    with pytest.raises(ValueError, match=re.escape(needle)):
        lct.make_task(**args)


def test_mixed_windows_mix_tasks_and_corpus_deterministically(corpus):
    a = lct.mixed_windows(corpus, 16, 512, seed=1, task_fraction=0.5)
    b = lct.mixed_windows(corpus, 16, 512, seed=1, task_fraction=0.5)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.answer_starts, b.answer_starts)
    assert a.tokens.shape == (16, 512) and a.tokens.dtype == np.int32
    assert a.answer_starts.shape == (16,) and a.answer_starts.dtype == np.int32
    is_task = a.tokens[:, 0] == bc.BOS_ID
    assert 0 < is_task.sum() < 16
    # A task row's answer ends it; a text row has none (its start is the window's length).
    assert ((a.answer_starts < 512) == is_task).all()
    assert (a.answer_starts[is_task] > 1).all()
    assert (lct.mixed_windows(corpus, 4, 512, seed=2, task_fraction=0.0).tokens[:, 0] != bc.BOS_ID).all()


def test_mixed_windows_answer_starts_are_the_tasks_answers(corpus):
    """Every task row's answer_start is where make_task put the answer: the same row rebuilt from
    the same draws gives the same tokens, and its answer is the row's tail."""
    batch = lct.mixed_windows(corpus, 8, 600, seed=3, task_fraction=1.0)
    rng = np.random.default_rng(3)
    for row, start in zip(batch.tokens, batch.answer_starts):
        rng.random()
        kind = lct.TASK_KINDS[int(rng.integers(len(lct.TASK_KINDS)))]
        task = lct.make_task(kind, 600, float(rng.random()), int(rng.integers(2**31)), text=corpus)
        np.testing.assert_array_equal(row, task.tokens)
        assert start == task.answer_start
        np.testing.assert_array_equal(row[start:], task.answer)


def test_mixed_windows_refuse_bad_fraction_and_short_text(corpus):
    with pytest.raises(ValueError, match="task_fraction"):
        lct.mixed_windows(corpus, 2, 512, seed=0, task_fraction=2.0)
    with pytest.raises(ValueError, match="text"):
        lct.mixed_windows(corpus[:100], 2, 512, seed=0)

"""A teacher cache of k stratified draws (distill.inputs.teacher_samples): the shares average to the teacher's full
distribution (where the renormalised top k does not), every piece of probability p is drawn within 2 of k p
times, the draws of a row do not depend on the batch or on which rows are cached, and a run trains from such a
cache only whole and renormalised."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_surgery.distill import TokenBatches
from nnx_surgery.distill.inputs.cache_format import CacheError
from nnx_surgery.distill.inputs.teacher_samples import counted, mixed_logprobs, sampled_logprobs
from nnx_surgery.distill.inputs import topk_cache
from nnx_surgery.distill.inputs.topk_cache import CacheSettings, TeacherCache, repeated_slots, write_cache
from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, Stage
from nnx_surgery.distill.loop.trainer import run
from distill_fixtures import FAST_COMPILE, VOCAB, student_from, tiny_teacher

K = 8


@pytest.fixture(scope="module")
def teacher():
    return tiny_teacher(seed=1)


def _data(batch_size: int = 4) -> TokenBatches:
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, VOCAB, size=int(n)) for n in rng.integers(5, 40, size=24)]
    return TokenBatches.from_arrays(docs, eos_id=1, bos_id=2, seq_len=16, batch_size=batch_size, seed=3)


def _batch():
    return {key: jnp.asarray(value) for key, value in next(iter(_data())).items() if key != "loss_mask"}


def _dense(ids: np.ndarray, logprobs: np.ndarray) -> np.ndarray:
    """(..., k) ids and log shares -> (..., VOCAB) probabilities (a repeated id's shares added)."""
    dense = np.zeros(ids.shape[:-1] + (VOCAB,))
    np.add.at(dense.reshape(-1, VOCAB), (np.arange(dense.size // VOCAB)[:, None], ids.reshape(-1, ids.shape[-1])),
              np.exp(logprobs.reshape(-1, ids.shape[-1])))
    return dense


def test_counted_merges_repeated_draws_most_drawn_first():
    ids, logprobs = counted(jnp.array([[5, 3, 1, 3], [2, 2, 2, 2], [9, 4, 7, 0]], jnp.int32))
    np.testing.assert_array_equal(ids, [[3, 1, 5, 3], [2, 2, 2, 2], [0, 4, 7, 9]])
    np.testing.assert_allclose(np.exp(logprobs), [[0.5, 0.25, 0.25, 0], [1, 0, 0, 0], [0.25] * 4])


def test_draws_average_to_the_teacher_and_the_top_k_does_not(teacher):
    """Over 300 draws of every position the mean share of each piece is its probability within 4.5 standard
    errors of independent draws (stratified ones vary less); the renormalised top k misses some piece by more."""
    batch = _batch()
    p = np.asarray(jax.nn.softmax(teacher(batch["input_ids"], positions=batch["positions"],
                                          segment_ids=batch["segment_ids"]).logits.astype(jnp.float32), -1))
    graph, state = nnx.split(teacher)
    draw = jax.jit(lambda s, rows: sampled_logprobs(nnx.merge(graph, s), batch, rows, K, seed=7, vocab_chunk=40,
                                                    block_rows=24)[:2])
    rounds = 300
    mean = sum(_dense(*map(np.asarray, draw(state, jnp.arange(4) + 4 * r))) for r in range(rounds)) / rounds
    bound = 4.5 * np.sqrt(p * (1 - p) / (K * rounds)) + 1e-6
    assert np.all(np.abs(mean - p) <= bound), np.max(np.abs(mean - p) - bound)
    values, ids = jax.lax.top_k(jnp.asarray(np.log(p)), K)
    top = _dense(np.asarray(ids), np.asarray(jax.nn.log_softmax(values, -1)))
    assert np.any(np.abs(top - p) > bound)


def _slot_functions(model, batch):
    graph, state = nnx.split(model)
    return state, {name: jax.jit(lambda s, rows, f=f: f(nnx.merge(graph, s), batch, rows, K, seed=7, vocab_chunk=40,
                                                         block_rows=24)[:2])
                   for name, f in (("mixed", mixed_logprobs), ("sampled", sampled_logprobs))}


def _probabilities(model, batch) -> np.ndarray:
    return np.asarray(jax.nn.softmax(model(batch["input_ids"], positions=batch["positions"],
                                           segment_ids=batch["segment_ids"]).logits.astype(jnp.float32), -1))


def test_mixed_slots_hold_the_exact_top_half_and_average_to_the_teacher(teacher):
    """selection "mixed": the first k // 2 slots are the teacher's top k // 2 at their exact log-probabilities, the
    drawn slots never repeat them, the shares sum to 1, and their mean over 300 rounds is the teacher's
    distribution within 4.5 standard errors of the rest's draws."""
    batch = _batch()
    p = _probabilities(teacher, batch)
    state, slots = _slot_functions(teacher, batch)
    ids, logprobs = map(np.asarray, slots["mixed"](state, jnp.arange(4)))
    values, top = jax.lax.top_k(jnp.asarray(np.log(p)), K // 2)
    np.testing.assert_array_equal(ids[..., :K // 2], np.asarray(top))
    np.testing.assert_allclose(logprobs[..., :K // 2], np.asarray(values), rtol=1e-5, atol=1e-5)
    in_top = (ids[..., K // 2:, None] == np.asarray(top)[..., None, :]).any(-1)  # per position
    assert not np.any(in_top & np.isfinite(logprobs[..., K // 2:]))
    np.testing.assert_allclose(np.exp(logprobs).sum(-1), 1.0, rtol=1e-5)
    rounds = 300
    mean = sum(_dense(*map(np.asarray, slots["mixed"](state, jnp.arange(4) + 4 * r))) for r in range(rounds)) / rounds
    bound = 4.5 * np.sqrt(p * (1 - p) / ((K - K // 2) * rounds)) + 2e-5  # + the exact slots' float error
    assert np.all(np.abs(mean - p) <= bound), np.max(np.abs(mean - p) - bound)


def test_mixed_slots_are_nearer_a_peaked_teacher_than_draws_and_not_a_flat_one(teacher):
    """Squared error to the teacher's distribution (summed over the vocabulary, averaged over positions and 30
    rounds): on a teacher as peaked as a trained LM (its logits 8x sharper: the top k // 2 hold three quarters of the mass)
    the mixed slots are at most half as far as k pure draws; on the fixture's flat teacher, where the rest holds
    most of the mass and only k - k // 2 draws share it, they are not nearer (`mixed` pays where teachers are
    peaked)."""
    batch = _batch()
    peaked = nnx.clone(teacher)
    peaked.norm.scale[...] = (1.0 + peaked.norm.scale[...]) * 8.0 - 1.0
    errors = {}
    for label, model in (("flat", teacher), ("peaked", peaked)):
        p = _probabilities(model, batch)
        top_mass = np.sort(p, -1)[..., -(K // 2):].sum(-1).mean()
        state, slots = _slot_functions(model, batch)
        for name, draw in slots.items():
            errors[label, name] = np.mean([np.mean(np.sum((_dense(*map(np.asarray, draw(state, jnp.arange(4) + 4 * r)))
                                                            - p) ** 2, -1)) for r in range(30)])
        errors[label, "top mass"] = top_mass
    assert errors["peaked", "top mass"] > 0.7 > 0.5 > errors["flat", "top mass"], errors
    assert errors["peaked", "mixed"] < 0.5 * errors["peaked", "sampled"], errors
    assert errors["flat", "mixed"] > 0.7 * errors["flat", "sampled"], errors


def test_every_piece_of_probability_p_is_drawn_within_2_of_k_p_times(teacher):
    batch = _batch()
    p = np.asarray(jax.nn.softmax(teacher(batch["input_ids"], positions=batch["positions"],
                                          segment_ids=batch["segment_ids"]).logits.astype(jnp.float32), -1))
    graph, state = nnx.split(teacher)
    ids, logprobs, residual = jax.jit(lambda s: sampled_logprobs(nnx.merge(graph, s), batch, jnp.arange(4), K,
                                                                 seed=0))(state)
    shares = _dense(np.asarray(ids), np.asarray(logprobs))
    np.testing.assert_allclose(shares.sum(-1), 1.0, rtol=1e-6)
    counts = np.rint(shares * K)
    assert np.all(np.abs(counts - K * p) < 2 + 1e-4)
    assert np.any(np.abs(counts - K * p) > 0.5)  # random, not rounded
    assert np.all(np.asarray(residual) == -np.inf)


def _settings(**extra) -> CacheSettings:
    return CacheSettings(**{**dict(top_k=K, encoding="exact", rows_per_shard=5, vocab_chunk=40, block_rows=24,
                                   selection="sampled", sample_seed=11), **extra})


def test_a_rows_draws_do_not_depend_on_the_batch_or_the_rows_cached(teacher, tmp_path):
    data = _data()
    write_cache(teacher, data, str(tmp_path / "a"), _settings(batch_rows=4), identity={})
    write_cache(teacher, data, str(tmp_path / "b"), _settings(batch_rows=3), identity={})
    write_cache(teacher, data, str(tmp_path / "c"), _settings(batch_rows=2), identity={}, row_ids=[6, 2, 9])
    a, b, c = (TeacherCache.open(str(tmp_path / name)) for name in "abc")
    assert a.selection == "sampled" and a.manifest["sample_seed"] == 11
    index = np.arange(a.num_rows)
    for key, value in a.rows(index).items():
        np.testing.assert_array_equal(b.rows(index)[key], value, err_msg=key)
        np.testing.assert_array_equal(c.rows(np.array([2, 6, 9]))[key], value[[2, 6, 9]], err_msg=key)
    other = write_cache(teacher, data, str(tmp_path / "d"), _settings(batch_rows=4).__class__(
        **{**_settings(batch_rows=4).__dict__, "sample_seed": 12}), identity={})
    assert other["sample_seed"] == 12
    assert not np.array_equal(TeacherCache.open(str(tmp_path / "d")).rows(index)["topk_ids"],
                              a.rows(index)["topk_ids"])


def test_a_top_k_cache_manifest_names_no_selection(teacher, tmp_path):
    manifest = write_cache(teacher, _data(), str(tmp_path / "top"), CacheSettings(top_k=K, encoding="exact"),
                           identity={})
    assert "selection" not in manifest and TeacherCache.open(str(tmp_path / "top")).selection == "top"
    with pytest.raises(CacheError, match="selection 'random'"):
        CacheSettings(top_k=K, selection="random")
    with pytest.raises(CacheError, match="give top_k >= 2"):
        CacheSettings(top_k=1, selection="mixed")


def _config(**changes) -> DistillConfig:
    base = dict(stages=(Stage(steps=3, learning_rate=5e-3, weights=LossWeights.mixed(0.8)),), batch_size=4,
                seq_len=16, progress=False, plots=False, logit_chunk=16, compiler_options=FAST_COMPILE)
    return DistillConfig(**{**base, **changes})


@pytest.mark.parametrize("selection, held", [("sampled", "8 draws"), ("mixed", "top 4 and 4 draws of the rest")])
def test_a_run_trains_from_draws_whole_and_renormalised(teacher, tmp_path, selection, held):
    folder = str(tmp_path / selection)
    write_cache(teacher, _data(), folder, _settings(batch_rows=4, selection=selection), identity={})
    result = run(None, student_from(teacher), _data(), _config(teacher_cache=folder))
    assert result.steps == 3 and all(np.isfinite(r["loss"]) for r in result.history)
    for changes, message in ((dict(top_k=4), f"holds {held} of the teacher's distribution"),
                             (dict(top_k_mode="residual"), "has no residual to read")):
        with pytest.raises(CacheError, match=message) as error:
            run(None, student_from(teacher), _data(), _config(teacher_cache=folder, **changes))
        assert "\n" not in str(error.value)


def _tied_teacher(seed: int):
    """`tiny_teacher(seed)` whose output embedding repeats rows: ids 40-47 score exactly as ids 30-37 (and 50-57 as
    ids 3-10), so every position has pieces whose logits tie exactly, among them near the top k // 2's edge."""
    model = tiny_teacher(seed=seed)
    table = model.embed_tokens[...]
    model.embed_tokens[...] = table.at[40:48].set(table[30:38]).at[50:58].set(table[3:11])
    return model


def repeated_drawn_slots(seeds=(1, 2, 3), rounds: int = 4) -> int:
    """How many positions' mixed slots give some id a share twice (over `seeds`' teachers, plain and tied, and
    `rounds` draws each): the count that must be 0. Module-level, so a subprocess can run it under other XLA flags."""
    repeats = 0
    batch = _batch()
    for seed in seeds:
        for model in (tiny_teacher(seed=seed), _tied_teacher(seed)):
            state, slots = _slot_functions(model, batch)
            for r in range(rounds):
                for name in ("mixed", "sampled"):
                    repeats += repeated_slots(*map(np.asarray, slots[name](state, jnp.arange(4) + 4 * r)))
    return repeats


@pytest.mark.parametrize("optimised", [False, True], ids=["suite-O0", "xla-default"])
def test_no_id_gets_two_shares_at_any_xla_optimisation_level(optimised):
    """No position's slots give an id a share twice, in `mixed` (the drawn half excludes the exact half by id, not
    by comparing recomputed logits) or `sampled`, on several seeds, with exact ties in the vocabulary, under the
    suite's `--xla_backend_optimization_level=0` (in process) and XLA's normal level (a subprocess)."""
    if not optimised:
        assert repeated_drawn_slots() == 0
        return
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "optimization_level" not in f)
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.dirname(os.path.dirname(here))
    code = (f"import sys; sys.path[:0] = [{tests!r}, {here!r}]; import test_teacher_samples as t; "
            "print(t.repeated_drawn_slots())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "XLA_FLAGS": flags})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "0", done.stdout


def test_a_mixed_cache_written_before_the_fix_is_checked_for_repeated_ids(teacher, tmp_path, monkeypatch):
    """A mixed manifest says its slots are distinct; one without that mark (an earlier version's) is read through
    on open: refused in one line where some position gives an id two shares, opened where none does."""
    good = str(tmp_path / "good")
    assert write_cache(teacher, _data(), good, _settings(batch_rows=4, selection="mixed"), identity={})["slots"] \
        == topk_cache.DISTINCT_SLOTS
    sampled = write_cache(teacher, _data(), str(tmp_path / "s"), _settings(batch_rows=4), identity={})
    assert "slots" not in sampled

    def unmark(folder):
        path = os.path.join(folder, "manifest.json")
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
        del manifest["slots"]
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(manifest, handle)

    unmark(good)
    assert TeacherCache.open(good).selection == "mixed"  # read through, no repeat found
    written = topk_cache._teacher_function

    def repeating(model, settings):  # the old bug: a drawn slot repeats the last exact slot's id
        slots = written(model, settings)

        def bad(batch, rows):
            ids, logprobs, residual = slots(batch, rows)
            ids = ids.copy()
            ids[0, 0, K // 2] = ids[0, 0, K // 2 - 1]
            return ids, logprobs, residual
        return bad
    monkeypatch.setattr(topk_cache, "_teacher_function", repeating)
    bad = str(tmp_path / "bad")
    write_cache(teacher, _data(), bad, _settings(batch_rows=4, selection="mixed"), identity={})
    unmark(bad)
    with pytest.raises(CacheError, match="give one id two shares") as error:
        TeacherCache.open(bad)
    assert "\n" not in str(error.value) and "cache-teacher" in str(error.value)

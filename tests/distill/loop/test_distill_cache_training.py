"""Training from a teacher cache (issue 42, distill.loop.cache_replay): with the cache stored exactly, the per-step
losses and the trained student equal the online top-k run's at the same k; with the default q8 encoding they stay
within the stated tolerance; resume continues at the cache's row; every mismatch and every term that needs the
teacher's hidden states is refused in one line before training."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nnx_surgery.distill import TokenBatches
from nnx_surgery.distill.inputs.cache_format import CacheError
from nnx_surgery.distill.loop.run_config import CheckpointConfig, DistillConfig, LossWeights, Stage
from nnx_surgery.distill.inputs.topk_cache import CacheSettings, write_cache
from nnx_surgery.distill.loop.trainer import run
from distill_fixtures import FAST_COMPILE, VOCAB, params_numpy, student_from, tiny_teacher

K = 8
STEPS = 4
LR = 5e-3
# q8 against the online top-k run over these steps: the largest relative difference of a step's loss, and how far
# the trained student lies from the online one relative to how far training moved it (`_update_difference`);
# measured 3.0e-4 and 0.046 (the exact cache: within 1e-5 and 1.4e-4)
Q8_LOSS_TOLERANCE, Q8_PARAM_TOLERANCE = 1e-3, 0.1


def _data() -> TokenBatches:
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, VOCAB, size=int(n)) for n in rng.integers(5, 40, size=24)]
    return TokenBatches.from_arrays(docs, eos_id=1, bos_id=2, seq_len=16, batch_size=4, seed=3)


def _config(**changes) -> DistillConfig:
    base = dict(stages=(Stage(steps=STEPS, learning_rate=LR, weights=LossWeights.mixed(0.8)),), batch_size=4,
                seq_len=16, top_k=K, progress=False, plots=False, logit_chunk=16, compiler_options=FAST_COMPILE)
    return DistillConfig(**{**base, **changes})


def _cache(folder: str, encoding: str) -> str:
    write_cache(tiny_teacher(), _data(), folder, CacheSettings(top_k=K, encoding=encoding, rows_per_shard=5),
                identity={"teacher": {"config_sha256": "c"}})
    return folder


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("caches")
    return {encoding: _cache(str(root / encoding), encoding) for encoding in ("exact", "q8", "q8z")}


@pytest.fixture(scope="module")
def online():
    student = student_from(tiny_teacher())
    result = run(tiny_teacher(), student, _data(), _config())
    return result.history, params_numpy(student)


def _from_cache(folder: str, **changes):
    student = student_from(tiny_teacher())
    result = run(None, student, _data(), _config(teacher_cache=folder, **changes))
    return result, params_numpy(student)


def test_an_exact_cache_trains_as_the_online_top_k_run(caches, online):
    """Losses and gradient norms to float32 rounding; parameters within a tenth of one step's update (lr): Adam
    divides by sqrt(v), so an entry whose gradient is near 0 turns the rounding of the teacher's log-probabilities
    (computed in vocabulary chunks in the cache, from full logits online) into a visible part of its update."""
    history, params = online
    result, got = _from_cache(caches["exact"])
    for key in ("loss", "grad_norm", "kl", "student_ce"):
        if key in history[0]:
            np.testing.assert_allclose([r[key] for r in result.history], [r[key] for r in history], rtol=1e-5,
                                       err_msg=key)
    for name, value in params.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=0.1 * LR, err_msg=name)
    assert _update_difference(got, params) < 1e-3


def _update_difference(got: dict, want: dict) -> float:
    """||got - want|| / ||want - initial|| over all parameters: how far the trained student moved from the online
    one, relative to how far training moved it."""
    initial = params_numpy(student_from(tiny_teacher()))
    apart = sum(float(np.sum((got[n] - want[n]) ** 2)) for n in want)
    moved = sum(float(np.sum((want[n] - initial[n]) ** 2)) for n in want)
    return (apart / moved) ** 0.5


def test_the_q8_cache_stays_within_its_tolerance(caches, online):
    history, params = online
    losses = [r["loss"] for r in history]
    result, got = _from_cache(caches["q8"])
    loss_error = max(abs(a - b) / abs(b) for a, b in zip([r["loss"] for r in result.history], losses))
    param_error = _update_difference(got, params)
    assert 0 < loss_error < Q8_LOSS_TOLERANCE and param_error < Q8_PARAM_TOLERANCE, (loss_error, param_error)


def test_the_q8z_cache_trains_as_the_q8_cache(caches):
    """q8z stores q8's values (compressed): the same losses, to float32 rounding (two ids of one quantised value
    may come back in either order, which only reorders a sum)."""
    q8, _ = _from_cache(caches["q8"])
    q8z, _ = _from_cache(caches["q8z"])
    for key in ("loss", "grad_norm", "student_ce"):
        np.testing.assert_allclose([r[key] for r in q8z.history], [r[key] for r in q8.history], rtol=1e-6,
                                   err_msg=key)


def test_resume_continues_at_the_cache_row(caches, tmp_path):
    full, full_params = _from_cache(caches["exact"], checkpoint=CheckpointConfig(str(tmp_path / "a"), every=2))
    halted, _ = _from_cache(caches["exact"], checkpoint=CheckpointConfig(str(tmp_path / "b"), every=2),
                            halt_after=2)
    assert halted.steps == 2
    resumed, params = _from_cache(caches["exact"], checkpoint=CheckpointConfig(str(tmp_path / "b"), every=2))
    assert resumed.events[0]["event"] == "resume" and resumed.steps == STEPS
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in full.history[2:]]
    assert all(np.array_equal(full_params[k], params[k]) for k in full_params)


@pytest.mark.parametrize("changes, message", [
    (dict(top_k=K + 1), "holds the top 8, the run asks top_k=9"),
    (dict(seq_len=32, batch_size=4), "made for seq_len 16, not 32"),
    (dict(stages=(Stage(steps=1, weights=LossWeights(kl=1.0, feature=1.0)),)), "hidden states or attention maps"),
    (dict(train_diagnostics=True), "train_diagnostics needs the teacher's full logits"),
])
def test_a_mismatch_or_a_term_needing_the_teacher_is_one_line(caches, changes, message):
    with pytest.raises(CacheError, match=message) as error:
        run(None, student_from(tiny_teacher()), None, _config(teacher_cache=caches["exact"], **changes))
    assert "\n" not in str(error.value)


def test_other_packing_or_a_teacher_beside_the_cache_is_refused(caches):
    other = TokenBatches.from_arrays([np.arange(3, 60)] * 6, eos_id=1, bos_id=2, seq_len=16, batch_size=4, seed=3)
    with pytest.raises(CacheError, match="made for (rows|fingerprint)"):
        run(None, student_from(tiny_teacher()), other, _config(teacher_cache=caches["exact"]))
    with pytest.raises(ValueError, match="pass teacher=None"):
        run(tiny_teacher(), student_from(tiny_teacher()), _data(), _config(teacher_cache=caches["exact"]))


def test_a_smaller_top_k_reads_the_first_of_the_cached(caches):
    config = dataclasses.replace(_config(top_k=4), stages=(Stage(steps=1, learning_rate=5e-3,
                                                                 weights=LossWeights.mixed(0.8)),))
    online = run(tiny_teacher(), student_from(tiny_teacher()), _data(), config)
    cached = run(None, student_from(tiny_teacher()), _data(),
                 dataclasses.replace(config, teacher_cache=caches["exact"]))
    np.testing.assert_allclose(cached.history[0]["loss"], online.history[0]["loss"], rtol=1e-5)


# ------------------------------------------------------------------------------------------------ the command
@pytest.fixture(scope="module")
def w(tmp_path_factory):
    from cache_workspace import teacher_workspace
    return teacher_workspace(tmp_path_factory.mktemp("cache-distill"))


def test_distill_command_trains_from_the_cache_as_online_top_k(w):
    import json
    import os

    from refusal_env import assert_refused, run as command

    data = ("--data", w["data"], "--seq-len", "32", "--batch-size", "4")
    cache = str(w["base"] / "cache")
    assert command("cache-teacher", w["teacher"], *data, "--top-k", "8", "--encoding", "exact", "--output",
                   cache)[0] == 0
    losses = {}
    for name, extra in (("online", ("--top-k", "8")), ("cached", ("--teacher-cache-folder", cache))):
        out = str(w["base"] / name)
        code, printed, err = command("distill", w["teacher"], w["teacher"], *data, "--steps", "2", "--output", out,
                                     *extra)
        assert code == 0, err
        with open(os.path.join(out, "history.json")) as handle:
            losses[name] = [record["loss"] for record in json.load(handle)["train"]]
    assert "teacher from the cache" in printed
    np.testing.assert_allclose(losses["cached"], losses["online"], rtol=1e-5)
    assert_refused(*command("distill", w["teacher"], w["teacher"], "--data", w["data"], "--seq-len", "16",
                            "--batch-size", "4", "--steps", "1", "--output", str(w["base"] / "n1"),
                            "--teacher-cache-folder", cache), "seq_len 32, not 16", started=True)


def test_a_trimmed_student_trains_from_a_cache_in_its_own_vocabulary(w):
    """`cache-teacher --student-folder` writes the teacher's top k over a trimmed student's pieces, in its tokens; the
    student trains from it as online top-k distillation through the teacher in its vocabulary does, and a cache
    in another vocabulary is refused in one line."""
    import json
    import os

    from nnx_surgery import surgery
    from nnx_surgery.distill.loop.cache_replay import prepare_cached_run
    from nnx_surgery.distill.inputs.topk_cache import TeacherCache
    from refusal_env import assert_refused, run as command

    data = ("--data", w["data"], "--seq-len", "32", "--batch-size", "4")
    plan, student = str(w["base"] / "trim-plan.json"), str(w["base"] / "trimmed")
    assert command("plan", w["teacher"], "--student", "layers=1,vocab=300", *data[:4], "--calibration-samples",
                   "8", "--output", plan)[0] == 0
    assert command("prune", w["teacher"], plan, student)[0] == 0
    cache = str(w["base"] / "trimmed-cache")
    code, printed, err = command("cache-teacher", w["teacher"], "--student-folder", student, *data, "--top-k", "8",
                                 "--encoding", "exact", "--output", cache)
    assert code == 0, err
    assert "top 8 of 300 " in printed and TeacherCache.open(cache).vocab_size == 300
    losses = {}
    for name, extra in (("trimmed-online", ("--top-k", "8")),
                        ("trimmed-cached", ("--teacher-cache-folder", cache))):
        out = str(w["base"] / name)
        code, _, err = command("distill", w["teacher"], student, *data, "--steps", "2", "--output", out, *extra)
        assert code == 0, err
        with open(os.path.join(out, "history.json")) as handle:
            losses[name] = [record["loss"] for record in json.load(handle)["train"]]
    np.testing.assert_allclose(losses["trimmed-cached"], losses["trimmed-online"], rtol=1e-5)
    # the teacher's own vocabulary against this cache: refused (its tokenizer is not the one the rows were read with)
    assert_refused(*command("distill", w["teacher"], w["teacher"], *data, "--steps", "1", "--output",
                            str(w["base"] / "n-trim"), "--teacher-cache-folder", cache), "--teacher-cache-folder")
    # the run's map against the cache's, through the API: another trimmed map, or none
    model = surgery.load_pretrained(student, dtype="float32")
    kept = surgery.Plan.load(plan).kept_vocab
    config = DistillConfig(teacher_cache=cache, batch_size=4, seq_len=32,
                           stages=(Stage(steps=1, weights=LossWeights(kl=1.0)),))
    with pytest.raises(CacheError, match="another trimmed vocabulary"):
        prepare_cached_run(dataclasses.replace(config, vocab_map=tuple(reversed(kept))), model)
    with pytest.raises(CacheError, match="made in a trimmed student's vocabulary, but the run's student"):
        prepare_cached_run(config, model)
    assert prepare_cached_run(dataclasses.replace(config, vocab_map=tuple(kept)), model)[0].top_k == 8


def test_a_cache_of_the_rows_ahead_trains_from_where_the_data_stands(tmp_path, online):
    """A cache of only the rows a run will read (`rows_ahead`, what the recipe's --teacher-cache auto writes),
    taken after the data was moved on, trains as the online top-k run from the same position does; the data left
    where it stood; a run reading further than the cache holds is refused in one line."""
    from nnx_surgery.distill.inputs.topk_cache import TeacherCache, rows_ahead

    data = _data()
    for _ in range(3):
        data.next_batch()  # an earlier phase read these
    start = data.state()
    rows = rows_ahead(data, (STEPS + 1) * 4)
    assert data.state() == start and len(rows) == (STEPS + 1) * 4 < data.num_rows
    folder = str(tmp_path / "ahead")
    write_cache(tiny_teacher(), data, folder, CacheSettings(top_k=K, encoding="exact", rows_per_shard=5),
                identity={"teacher": {"config_sha256": "c"}}, row_ids=rows)
    assert TeacherCache.open(folder).row_ids.tolist() == sorted(rows.tolist())
    want = run(tiny_teacher(), student_from(tiny_teacher()), data, _config())
    data.restore(start)
    got = run(None, student_from(tiny_teacher()), data, _config(teacher_cache=folder))
    assert data.state() == start  # the cache's own stream read the rows
    assert got.data_state == want.data_state
    for key in ("loss", "grad_norm", "student_ce"):
        np.testing.assert_allclose([r[key] for r in got.history], [r[key] for r in want.history], rtol=1e-5)
    assert [r["batch_digest"] for r in got.history] == [r["batch_digest"] for r in want.history]
    with pytest.raises(CacheError, match=r"holds 20 of the .* packed rows .* not row") as caught:
        run(None, student_from(tiny_teacher()), data, _config(teacher_cache=folder, stages=(
            Stage(steps=STEPS + 3, learning_rate=LR, weights=LossWeights.mixed(0.8)),)))
    assert "\n" not in str(caught.value)

"""evaluation.search: every candidate sees the same batches, is scored at each point against an independent
computation, is ranked by its curve, and a search stopped midway resumes to the same result."""
import json
import os

import numpy as np
import pytest

from nnx_surgery import distill
from nnx_surgery import evaluation
from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, Stage
from nnx_surgery.evaluation.heldout_sets import HeldoutSet, score_heldout, summarise
from nnx_surgery.evaluation.shape_ranking import SearchCandidate, rank_curves, search
from distill_fixtures import BATCH, FAST_COMPILE, LENGTH, ArrayBatches, student_from, teacher_samples, tiny_teacher

STEPS = 4


class RecordingBatches(ArrayBatches):
    """ArrayBatches that notes a fingerprint of every batch it hands out in a shared log."""

    def __init__(self, batches, log):
        super().__init__(batches)
        self.log = log

    def next_batch(self):
        batch = super().next_batch()
        self.log.append(int(np.asarray(batch["input_ids"]).sum()) * 1000 + self.position)
        return batch


@pytest.fixture(scope="module")
def setup():
    teacher = tiny_teacher()
    batches = teacher_samples(teacher, 12, seed=3)
    rows = np.concatenate([b["input_ids"] for b in batches[8:]])
    held = HeldoutSet("samples", rows, np.ones_like(rows, np.float32), np.arange(len(rows)) // 2,
                      np.full(len(rows), LENGTH, np.int64))
    return teacher, batches[:8], held


def config():
    return DistillConfig(stages=(Stage(steps=STEPS, learning_rate=5e-3, weights=LossWeights(kl=1.0)),),
                         batch_size=BATCH, seq_len=LENGTH, progress=False, logit_chunk=16,
                         compiler_options=FAST_COMPILE)


def candidates(teacher, built=None):
    def build(kept):
        if built is not None:
            built.append(kept)
        return student_from(teacher, kept)
    return [SearchCandidate(name, build=lambda kept=kept: build(kept), parameters=len(kept))
            for name, kept in (("first+last", (0, 3)), ("middle", (1, 2)), ("one", (3,)))]


@pytest.fixture(scope="module")
def searched(setup, tmp_path_factory):
    """One search of the three candidates, each candidate's batches noted: (result, batch log, its folder). Shared:
    the stopped-and-resumed search compares with its first two candidates (each candidate trains alone on fresh
    data, so they are what a search of those two gives)."""
    teacher, train, held = setup
    seen: list = []
    folder = tmp_path_factory.mktemp("search")
    result = search(teacher, candidates(teacher), lambda: RecordingBatches(train, seen), config(), sets=[held],
                    directory=str(folder), eval_at=(2,), log=lambda line: None)
    return result, seen, folder


@pytest.mark.slow
def test_every_candidate_sees_the_same_batches_and_is_scored_like_a_direct_run(setup, searched):
    teacher, train, held = setup
    result, seen, tmp_path = searched
    per_candidate = [seen[i * STEPS:(i + 1) * STEPS] for i in range(3)]
    assert len(seen) == 3 * STEPS and per_candidate[0] == per_candidate[1] == per_candidate[2]
    # an independent run of one candidate with the same settings gives the same scores
    student = student_from(teacher, (1, 2))
    distill.run(teacher, student, ArrayBatches(train), config())
    direct = summarise(score_heldout({"teacher": teacher, "s": student}, held, reference="teacher",
                                     log=lambda line: None)["s"], held)
    row = next(r for r in result.rows if r["name"] == "middle")
    final = next(p for p in row["curve"] if p["step"] == STEPS)
    assert final["samples"]["ce"] == pytest.approx(direct["ce"], abs=1e-5)
    assert final["samples"]["kl"] == pytest.approx(direct["kl"], abs=1e-5)
    assert [p["step"] for p in row["curve"]] == [2, STEPS]
    assert result.ranking() == [r["name"] for r in result.rows]
    assert result.ranking() == sorted(result.ranking(), key=lambda n: next(
        p for p in next(r for r in result.rows if r["name"] == n)["curve"] if p["step"] == STEPS)["samples"]["ce"])
    saved = json.load(open(tmp_path / "search.json"))
    assert saved["rankings"][str(STEPS)] == result.ranking() and saved["teacher"]["samples"]["kl"] == 0
    table = (tmp_path / "search.md").read_text()
    assert table.index(result.rows[0]["name"]) < table.index(result.rows[-1]["name"])
    assert os.path.getsize(tmp_path / "search.png") > 1000


@pytest.mark.slow
def test_a_search_stopped_midway_resumes_without_redoing_finished_candidates(setup, searched, tmp_path):
    teacher, train, held = setup
    # the uninterrupted search of the first two candidates: theirs in the shared search of three, in its order
    two = {candidate.name for candidate in candidates(teacher)[:2]}
    whole_rows = [row for row in searched[0].rows if row["name"] in two]

    class Stop(Exception):
        pass

    def stop_in_second(line):
        if "step 2" in line and stops["armed"] and stops["candidates"] == 2:
            stops["armed"] = False
            raise Stop()
        if line.startswith("[search] ") and "/2 " in line:
            stops["candidates"] += 1

    stops = {"armed": True, "candidates": 0}
    with pytest.raises(Stop):  # stopped after the second candidate's first point
        search(teacher, candidates(teacher)[:2], ArrayBatches(train), config(), sets=[held],
               directory=str(tmp_path / "cut"), eval_at=(2,), log=stop_in_second)
    built: list = []
    lines: list = []
    resumed = search(teacher, candidates(teacher, built)[:2], ArrayBatches(train), config(), sets=[held],
                     directory=str(tmp_path / "cut"), eval_at=(2,), log=lines.append)
    assert built == [(1, 2)]  # the finished first candidate was not rebuilt
    assert any("finished earlier" in line for line in lines)
    assert [(r["name"], [(p["step"], p["samples"]) for p in r["curve"]]) for r in resumed.rows] == \
           [(r["name"], [(p["step"], p["samples"]) for p in r["curve"]]) for r in whole_rows]
    assert not os.path.exists(tmp_path / "cut" / "middle" / "checkpoints")  # only the curve is kept


def test_ranking_from_known_curves():
    def row(name, ce_by_step, kl=0.1):
        return {"name": name, "curve": [{"step": s, "set": {"ce": ce, "kl": kl, "top1_agreement": 1 - ce / 10}}
                                        for s, ce in ce_by_step.items()]}
    rows = [row("a", {10: 3.0, 20: 2.5}), row("b", {10: 2.9, 20: 2.6}), row("c", {10: 3.5, 20: 2.4})]
    assert rank_curves(rows, 10, "set", "ce") == ["b", "a", "c"]
    assert rank_curves(rows, 20, "set", "ce") == ["c", "a", "b"]
    assert rank_curves(rows, 20, "set", "top1_agreement") == ["c", "a", "b"]  # higher agreement is better


def test_bad_searches_are_refused(setup, tmp_path):
    teacher, train, held = setup
    with pytest.raises(ValueError, match="distinct names"):
        search(teacher, candidates(teacher)[:1] * 2, train, config(), sets=[held], directory=str(tmp_path))
    with pytest.raises(ValueError, match="eval_at"):
        search(teacher, candidates(teacher), train, config(), sets=[held], directory=str(tmp_path), eval_at=(9,))
    with pytest.raises(ValueError, match="rank_by"):
        search(teacher, candidates(teacher), train, config(), sets=[held], directory=str(tmp_path),
               rank_by=("general", "ce"))
    with pytest.raises(ValueError, match="held-out set"):
        search(teacher, candidates(teacher), train, config(), sets=[], directory=str(tmp_path))

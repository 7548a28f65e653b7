"""The recipe's --teacher-cache (nnx_surgery/recipes/compress/teacher_caching.py) at tiny scale: a shape search whose
candidates train from one cache written by the run gives the search (every candidate's scores at every point) and
the student of the same run with the teacher running; a cache from `nnx-surgery cache-teacher` serves every
distillation phase; the CE control pairs with cached phases; results.json and results.md say which phases read a
cache; bad settings are one line, exit 2."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from recipe_env import TINY_TEACHER, recipe_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "gemma_7b_to_2b.py")

TINY = [*TINY_TEACHER, "--calibration-samples", "8", "--steps", "3", "--kv-warmup", "0", "--control", "none",
        "--eval-prompts", "0", "--choice-items", "0", "--eval-batches", "1", "--eval-every", "3", "--eval-tokens",
        "1024", "--set", 'compiler_options={"xla_backend_optimization_level": 0}', "--feature-weight", "0",
        "--student", "params=0.5", "--search-candidates", "2", "--search-steps", "2", "--top-k", "16",
        "--control", "pruned-ce"]  # the control trains with plain CE beside a --top-k distillation
SEARCH_ROWS = 2 * 4  # search steps x batch


def run_recipe(cache, *flags, timeout=600):
    return subprocess.run([sys.executable, RECIPE, *TINY, "--cache-dir", str(cache), *flags], capture_output=True,
                          text=True, env=recipe_env(cache.parent), timeout=timeout)


def teacher_folder(cache) -> str:
    return str(next(cache.glob("tiny-teacher-*")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_teacher_cache):
    """The same run with the teacher running, with --teacher-cache auto, and with a cache-teacher cache."""
    root = tmp_path_factory.mktemp("teacher-cache-runs")
    outs = {}
    for name, flags in (("online", []), ("auto", ["--teacher-cache", "auto"])):
        outs[name] = root / name
        done = run_recipe(tiny_teacher_cache, *flags, "--output", str(outs[name]))
        assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    given = root / "given-cache"
    made = subprocess.run([sys.executable, "-m", "nnx_surgery.cli", "cache-teacher", teacher_folder(tiny_teacher_cache),
                           "--corpus-bytes", "150000", "--seq-len", "32", "--batch-size", "4", "--top-k", "16",
                           "--encoding", "exact", "--output", str(given)], capture_output=True, text=True,
                          env=recipe_env(tiny_teacher_cache.parent, PYTHONPATH=ROOT), timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    outs["folder"] = root / "folder"
    done = run_recipe(tiny_teacher_cache, "--teacher-cache", str(given), "--output", str(outs["folder"]))
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return outs, given


def _json(path):
    return json.loads(path.read_text())


@pytest.mark.slow
def test_the_search_from_the_cache_scores_every_candidate_as_with_the_teacher(runs):
    outs, _ = runs
    online, cached = _json(outs["online"] / "search" / "search.json"), _json(outs["auto"] / "search" / "search.json")
    assert [r["name"] for r in cached["candidates"]] == [r["name"] for r in online["candidates"]]
    for got, want in zip(cached["candidates"], online["candidates"]):
        for point_got, point_want in zip(got["curve"], want["curve"], strict=True):
            for held in ("in-domain", "general"):
                for metric in ("ce", "kl"):
                    assert point_got[held][metric] == pytest.approx(point_want[held][metric], rel=1e-4), \
                        (got["name"], point_got["step"], held, metric)
    assert _json(outs["auto"] / "results.json")["search"]["winner"] == _json(outs["online"] / "results.json")[
        "search"]["winner"]
    manifest = _json(outs["auto"] / "teacher_cache" / "search" / "manifest.json")
    assert len(manifest["row_ids"]) == SEARCH_ROWS and manifest["encoding"] == "exact" and manifest["top_k"] == 16


@pytest.mark.slow
def test_results_say_which_phases_read_a_cache(runs):
    outs, given = runs
    assert _json(outs["online"] / "results.json")["teacher_cache"] == {}
    assert "Teacher cache: none; the teacher ran in every distillation step." in (
        outs["online"] / "results.md").read_text()
    auto = _json(outs["auto"] / "results.json")["teacher_cache"]
    assert set(auto) == {"search"}  # stages A and B read each row once: the teacher ran there
    assert auto["search"]["written_by_run"] and auto["search"]["rows"] == SEARCH_ROWS
    line = next(l for l in (outs["auto"] / "results.md").read_text().splitlines() if l.startswith("Teacher cache"))
    assert "search read teacher_cache/search (top 16, exact, 8 rows" in line and "written by this run" in line
    folder = _json(outs["folder"] / "results.json")["teacher_cache"]
    assert set(folder) == {"search", "stage_a", "stage_b"}
    assert {use["folder"] for use in folder.values()} == {str(given)}
    assert "search, stage_a, stage_b read " + str(given) in (outs["folder"] / "results.md").read_text()
    for name in ("auto", "folder"):  # the control read the cached phases' batches, in their order
        assert _json(outs[name] / "results.json")["pairing"]["batches"]["same"], name


@pytest.mark.slow
def test_every_phase_from_a_given_cache_trains_the_student_of_the_teacher_run(runs):
    outs, _ = runs
    want = _json(outs["online"] / "results.json")
    for name in ("auto", "folder"):
        got = _json(outs[name] / "results.json")
        assert got["final_losses"] == pytest.approx(want["final_losses"], rel=1e-4), name
        for row_got, row_want in zip(got["rows"], want["rows"], strict=True):
            assert row_got["loss"] == pytest.approx(row_want["loss"], rel=1e-4), (name, row_got["model"])


@pytest.mark.slow
def test_a_cache_of_another_teacher_is_refused_in_one_line(runs, tiny_teacher_cache, tmp_path):
    _, given = runs
    other = tmp_path / "other-teacher-cache"
    shutil.copytree(given, other)
    manifest = _json(other / "manifest.json")
    manifest["identity"]["teacher"]["weights_sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    done = run_recipe(tiny_teacher_cache, "--teacher-cache", str(other), "--output", str(tmp_path / "run"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(lines) == 1 and "teacher_weights_hash" in lines[0] and str(other) in lines[0], done.stderr[-2000:]


@pytest.mark.slow
def test_a_cache_of_draws_serves_every_distillation_phase(tiny_teacher_cache, tmp_path):
    """--cache-selection sampled with auto: every distillation phase (not only the search) trains from draws the
    run wrote, and results.json / results.md say so."""
    out = tmp_path / "sampled"
    done = run_recipe(tiny_teacher_cache, "--teacher-cache", "auto", "--cache-selection", "sampled", "--output",
                      str(out))
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    uses = _json(out / "results.json")["teacher_cache"]
    assert set(uses) == {"search", "stage_a", "stage_b"}
    assert all(use["selection"] == "sampled" and use["written_by_run"] for use in uses.values())
    assert _json(out / "teacher_cache" / "stage_a" / "manifest.json")["selection"] == "sampled"
    assert "search read teacher_cache/search (16 draws, exact" in (out / "results.md").read_text()


REFUSALS = [
    (["--teacher-cache", "auto", "--set", "distill.top_k=null"], "give --top-k K"),
    (["--teacher-cache", "auto", "--feature-weight", "0.5"], "--feature-weight"),
    (["--teacher-cache", "no/such/cache"], "no finished teacher cache there"),
    (["--teacher-cache", "auto", "--set", "distill.teacher_cache=x"], "give --teacher-cache"),
    (["--teacher-cache", "auto", "--set", "distill.train_diagnostics=true"], "need the teacher itself"),
    (["--cache-selection", "sampled"], "give --teacher-cache auto or always"),
]


@pytest.mark.parametrize("flags, culprit", REFUSALS)
def test_bad_teacher_cache_settings_are_one_line_and_exit_2(tmp_path, flags, culprit):
    cache = tmp_path / "no-teacher-needed"
    done = subprocess.run([sys.executable, RECIPE, *TINY, "--cache-dir", str(cache), *flags, "--output",
                           str(tmp_path / "run")], capture_output=True, text=True, env=recipe_env(tmp_path),
                          timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.strip().splitlines() if line.startswith("error")]
    assert len(lines) == 1 and culprit in lines[0] and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "run").exists()

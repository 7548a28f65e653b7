"""The recipe's shape search (`--student params=0.5`) at tiny scale: the candidates searched (the uniform guess
among them, marked), the winner distilled as the main student, results.json / results.md recording the search, the
plan after it made from the search's teacher scores, a resumed run reading finished candidates back, the dry run's
candidates and cost, and bad budgets refused in one line with exit 2 before any model loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recipe_env import TINY_TEACHER, recipe_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "recipes", "gemma_7b_to_2b.py")
sys.path.insert(0, ROOT)

from nnx_surgery import surgery  # noqa: E402
from nnx_surgery.recipes.compress import phase_configs, shape_search  # noqa: E402
from nnx_surgery.recipes.compress import resolution  # noqa: E402
from nnx_surgery.refusals import RecipeError# noqa: E402
from nnx_surgery.recipes.inputs.tiny_teacher import TEACHER_CONFIG  # noqa: E402

# the tiny teacher of test_recipe.py / test_config_surface.py (same teacher settings: one cached teacher)
TINY = [*TINY_TEACHER, "--calibration-samples", "8", "--steps", "3", "--kv-warmup", "0", "--control", "none",
        "--eval-prompts", "0", "--choice-items", "0", "--eval-batches", "1", "--eval-every", "3", "--eval-tokens",
        "1024", "--set", 'compiler_options={"xla_backend_optimization_level": 0}']
SEARCH = ["--student", "params=0.5", "--search-candidates", "2", "--search-steps", "2"]
TEACHER = surgery.ModelConfig.from_hf_dict(TEACHER_CONFIG)
SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")


def run_recipe(cache, *flags):
    return subprocess.run([sys.executable, RECIPE, *TINY, "--cache-dir", str(cache), *flags], capture_output=True,
                          text=True, env=recipe_env(cache.parent), timeout=600)


@pytest.fixture(scope="module")
def searched(tmp_path_factory, tiny_teacher_cache):
    """A search run stopped in stage B (after the search and stage A), its finished candidates' result.json
    modification times, then the same run resumed to the end."""
    cache = tiny_teacher_cache
    out = tmp_path_factory.mktemp("search-run") / "run"
    halted = run_recipe(cache, *SEARCH, "--output", str(out), "--halt-after", "stage_b:1")
    assert halted.returncode == 3, f"{halted.stdout[-3000:]}\n{halted.stderr[-3000:]}"
    finished = {path: os.path.getmtime(path) for path in result_files(out)}
    resumed = run_recipe(cache, *SEARCH, "--output", str(out), "--resume")
    assert resumed.returncode == 0, f"{resumed.stdout[-3000:]}\n{resumed.stderr[-3000:]}"
    return out, halted, resumed, finished


def result_files(out) -> list[str]:
    folder = out / "search"
    return sorted(str(folder / name / "result.json") for name in os.listdir(folder)
                  if os.path.exists(folder / name / "result.json"))


def shape_text(config: dict) -> str:
    return "layers={},hidden={},mlp={},heads={},kv_heads={}".format(*(config[key] for key in SHAPE_KEYS))


@pytest.mark.slow
def test_the_search_tries_the_uniform_guess_and_a_spread_shape_and_marks_the_guess(searched):
    out = searched[0]
    report = json.loads((out / "search" / "search.json").read_text())
    guess = surgery.uniform_spec(TEACHER, params=0.5).text
    fitting = [c.text for c in surgery.candidate_specs(TEACHER, params=0.5)]
    others = [text for text in fitting if text != guess]
    names = {row["name"]: row for row in report["candidates"]}
    assert set(names) == {guess, others[len(others) // 2]}  # the guess, and the middle of the one slice
    assert names[guess]["note"] == "uniform guess" and "note" not in names[others[len(others) // 2]]
    assert report["eval_at"] == [1, 2] and set(report["teacher"]) == {"in-domain", "general"}
    for row in report["candidates"]:
        assert [point["step"] for point in row["curve"]] == [1, 2]
        assert all(0 < point[name]["ce"] < 10 for point in row["curve"] for name in ("in-domain", "general"))
    table = (out / "search" / "search.md").read_text()
    assert f"`{guess}` (uniform guess)" in table and f"`{others[len(others) // 2]}` |" in table
    assert os.path.getsize(out / "search" / "search.png") > 1000


@pytest.mark.slow
def test_the_winner_is_the_main_student_and_the_results_record_the_search(searched):
    out = searched[0]
    report = json.loads((out / "search" / "search.json").read_text())
    final_ce = {row["name"]: row["curve"][-1]["in-domain"]["ce"] for row in report["candidates"]}
    winner = min(final_ce, key=final_ce.get)
    assert report["rankings"]["2"][0] == winner
    assert shape_text(json.loads((out / "student" / "config.json").read_text())) == winner
    assert (out / "student" / "plan_stage_a.json").exists()  # the main run still stages the winner
    results = json.loads((out / "results.json").read_text())
    search = results["search"]
    assert search["winner"] == winner and search["student"] == "params=0.5" and search["steps"] == 2
    assert search["uniform_guess"] == surgery.uniform_spec(TEACHER, params=0.5).text
    assert search["guess_rank"] == report["rankings"]["2"].index(search["uniform_guess"]) + 1
    assert search["rankings"] == report["rankings"] and len(search["candidates"]) == 2
    assert [c["uniform_guess"] for c in search["candidates"]].count(True) == 1
    assert (out / search["report"]).exists() and "shape search" in results["phase_times_s"]
    text = (out / "results.md").read_text()
    assert "Shape search (params=0.5" in text and f"Winner, the student above: `{winner}`" in text
    assert f"ranked {search['guess_rank']} of 2" in text and "(search/search.md)" in text


@pytest.mark.slow
def test_a_resumed_run_reads_finished_candidates_back(searched):
    out, halted, resumed, finished = searched
    assert len(finished) == 2 and halted.stdout.count("[search]   step ") == 4  # 2 candidates x 2 points
    assert resumed.stdout.count("[search]   finished earlier") == 2
    assert "[search]   step " not in resumed.stdout
    assert {path: os.path.getmtime(path) for path in result_files(out)} == finished


@pytest.mark.slow
def test_the_plan_after_the_search_reuses_the_teachers_calibration_scores(searched):
    out, halted, resumed, _ = searched
    reuse = "[surgery] planned from the teacher's calibration scores the search measured"
    assert halted.stdout.count(reuse) == 1  # stage A's plan; the final cut plans from the stage-A student
    assert reuse not in resumed.stdout  # the resumed search read its plans back and measured nothing
    winner = json.loads((out / "results.json").read_text())["search"]["winner"]
    candidate = json.loads((out / "search" / "plans" / (winner.replace(",", "_") + ".json")).read_text())
    stage_a = json.loads((out / "student" / "plan_stage_a.json").read_text())
    assert candidate["scores"] and {key: stage_a["scores"][key] for key in candidate["scores"]} == candidate["scores"]


@pytest.mark.slow
def test_the_dry_run_lists_the_candidates_and_the_cost_without_training(tmp_path_factory, tiny_teacher_cache):
    cache = tiny_teacher_cache
    out = tmp_path_factory.mktemp("search-dry") / "run"
    proc = run_recipe(cache, "--student", "params=0.5", "--search-candidates", "3", "--search-steps", "4",
                      "--dry-run", "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    guess = surgery.uniform_spec(TEACHER, params=0.5)
    chosen = shape_search.student_choice(resolution.resolve([*TINY, "--student", "params=0.5", "--search-candidates",
                                                           "3"]), TEACHER).candidates
    lines = proc.stdout.splitlines()
    for candidate in chosen:
        line = next(line for line in lines if line.strip().startswith(candidate.text + " "))
        assert f"{candidate.parameters / 1e6:.2f}M" in line and f"{candidate.non_embedding / 1e6:.2f}M" in line
        assert ("uniform guess" in line) == (candidate.text == guess.text)
    # 3 candidates x 4 steps x (4 x 32) tokens, against the main run's 3 steps
    assert "3 candidates x 4 steps x 128 tokens per step = 12 steps, 1,536 tokens: 4.00x the main " \
           "distillation's 3 steps (384 tokens)" in proc.stdout
    assert "[search]" not in proc.stdout and not (out / "search").exists()
    assert not (out / "run_args.json").exists()


def test_candidates_spread_over_the_list_after_the_guess():
    fitting = surgery.candidate_specs(TEACHER, params=0.5)
    guess = surgery.uniform_spec(TEACHER, params=0.5)
    chosen = shape_search.spread(fitting, guess, 4)
    others = [c for c in fitting if c.text != guess.text]
    n = len(others)
    assert chosen[0] is guess and [c.text for c in chosen[1:]] == [others[n // 6].text, others[n // 2].text,
                                                                    others[5 * n // 6].text]
    assert len({c.text for c in shape_search.spread(fitting, guess, 100)}) == n + 1  # every shape, once
    assert shape_search.spread(fitting, guess, 1) == [guess]
    assert shape_search.eval_points(2) == (1, 2) and shape_search.eval_points(24) == (8, 16, 24)


# The real Gemma 3 270M's sizes (its config.json without the fields that do not change a count): 18 layers, hidden
# 640, MLP 2048, 4 heads, 1 KV head of 256; 262k vocabulary, tied.
GEMMA3_270M = surgery.ModelConfig.from_hf_dict({
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3})


def test_from_three_candidates_the_shape_nearest_the_heads_kept_cut_comes_second():
    budget = shape_search.Budget("params=0.5", "0.5")
    fitting = surgery.candidate_specs(GEMMA3_270M, params=0.5)
    guess = surgery.uniform_spec(GEMMA3_270M, params=0.5)
    assert guess.spec.num_attention_heads == 3  # the uniform guess cuts heads too
    near = shape_search.heads_kept_shape(GEMMA3_270M, budget, fitting)
    # the uniform cut of depth, hidden and MLP alone is layers=14,hidden=492,mlp=1573 (off the grid): the
    # nearest shape within the budget with all 4 heads
    assert near.text == "layers=14,hidden=512,mlp=1536,heads=4,kv_heads=1" and near in fitting
    kept = surgery.uniform_spec(GEMMA3_270M, params=0.5, axes=("depth", "hidden", "mlp"))
    assert (kept.spec.num_layers, kept.spec.num_attention_heads) == (14, 4)
    chosen = shape_search.spread(fitting, guess, 4, near=near)
    others = [c for c in fitting if c.text not in {guess.text, near.text}]
    assert [c.text for c in chosen] == [guess.text, near.text, others[len(others) // 4].text,
                                        others[3 * len(others) // 4].text]
    assert shape_search.spread(fitting, guess, 2, near=near) == shape_search.spread(fitting, guess, 2)
    assert shape_search.spread(fitting, guess, 3, near=guess) == shape_search.spread(fitting, guess, 3)
    # what the recipe tries for --student params=0.5 --search-candidates 3 on this teacher
    flags = resolution.resolve(["--preset", "gemma3-270m", "--student", "params=0.5", "--search-candidates", "3"])
    choice = shape_search.student_choice(flags, GEMMA3_270M)
    assert [c.text for c in choice.candidates][:2] == [guess.text, near.text]
    # search.md and the dry run say why the first two are tried; a spread shape has no note
    assert [choice.note(c) for c in choice.candidates] == [shape_search.GUESS, shape_search.HEADS_KEPT, None]
    two = shape_search.student_choice(resolution.resolve(["--preset", "gemma3-270m", "--student", "params=0.5",
                                                        "--search-candidates", "2"]), GEMMA3_270M)
    assert two.heads_kept is None and [two.note(c) for c in two.candidates] == [shape_search.GUESS, None]


def test_search_shapes_are_tried_after_the_guess_in_their_order_and_must_fit_the_budget():
    fitting = surgery.candidate_specs(TEACHER, params=0.5)
    guess = surgery.uniform_spec(TEACHER, params=0.5)
    others = [c.text for c in fitting if c.text != guess.text]
    given = f" {others[-1]} ;{others[0]};{guess.text};{others[-1]};"  # spaces, the guess and a repeat dropped
    args = resolution.resolve([*TINY, "--student", "params=0.5", "--search-shapes", given])
    choice = shape_search.student_choice(args, TEACHER, tokenizer=None)
    assert [c.text for c in choice.candidates] == [guess.text, others[-1], others[0]]
    assert choice.candidates[1] == next(c for c in fitting if c.text == others[-1])  # with its parameter counts
    assert choice.guess.text == guess.text and choice.fitting == len(fitting)
    outside = "layers=2,hidden=8,mlp=16,heads=1,kv_heads=1"
    assert outside not in {c.text for c in fitting}
    with pytest.raises(RecipeError, match="not within params=0.5 \\+-5%"):
        shape_search.student_choice(resolution.resolve([*TINY, "--student", "params=0.5", "--search-shapes",
                                                      f"{others[0]};{outside}"]), TEACHER, tokenizer=None)
    with pytest.raises(RecipeError, match="give --student params="):  # no budget, no search
        shape_search.student_choice(resolution.resolve([*TINY, "--student", "layers=0.5", "--search-shapes",
                                                      others[0]]), TEACHER, tokenizer=None)


def test_the_search_distils_with_the_recipes_settings():
    args = resolution.resolve([*TINY, "--student", "params=0.5", "--search-steps", "5", "--alpha", "0.75",
                             "--temperature", "2", "--frozen", "embed_tokens", "--stop-when-met"])
    config = shape_search.search_config(args, "/unused", None)
    (stage,) = config.stages
    assert config.total_steps == 5 and (config.batch_size, config.seq_len) == (4, 32)
    assert stage.weights == phase_configs.loss_weights(args, args.training.term_weights["feature"])
    assert stage.learning_rate == 2e-3
    assert stage.weights.ce == 0.25 and stage.temperature.start == 2.0 and stage.frozen == ("embed_tokens",)
    assert config.targets.stop_when_met is False  # every candidate trains every step
    assert resolution.resolve([*TINY]).search.steps == 3  # the default: a tenth of --steps, at least 3
    assert resolution.resolve([*TINY, "--steps", "240"]).search.steps == 24


@pytest.mark.parametrize("student, error, culprit", [
    ("params=1", surgery.SpecError, "not below the teacher's"),           # the budget is the whole teacher
    ("params=3M", surgery.SpecError, "not below the teacher's"),
    ("params=2", surgery.SpecError, "no student shape"),                  # nothing fits two parameters
    ("params=0.5,layers=3", surgery.SpecError, "'layers=3'"),             # sizes beside a budget
    ("gemma-2b,params=0.5", surgery.SpecError, "'gemma-2b'"),             # a named shape beside a budget
    ("params=0.5,counting=all", surgery.SpecError, "counting='all'"),
    ("params=half", RecipeError, "'half'"),                               # refused with the flags
    ("params=0.5,vocab=128", RecipeError, "vocab="),
])
def test_bad_budgets_are_refused_against_the_teacher_config(student, error, culprit):
    with pytest.raises(error) as raised:  # an unreadable budget already when the flags resolve
        args = resolution.resolve([*TINY, "--student", student])
        shape_search.student_choice(args, TEACHER, tokenizer=None)
    assert culprit in str(raised.value) and f"--student {student!r}" in str(raised.value)


@pytest.mark.parametrize("flags, culprit", [
    (["--student", "params=1", "--dry-run"], "SpecError: --student 'params=1'"),
    (["--student", "params=0.5", "--search-candidates", "0"], "RecipeError: --search-candidates 0"),
    (["--student", "params=0.5", "--search-steps", "0"], "RecipeError: --search-steps 0"),
])
def test_bad_search_input_is_one_line_and_exit_2(tmp_path_factory, tiny_teacher_cache, flags, culprit):
    cache = tiny_teacher_cache
    proc = run_recipe(cache, *flags, "--output", str(tmp_path_factory.mktemp("bad") / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: {culprit}") and len(proc.stderr.strip().splitlines()) == 2

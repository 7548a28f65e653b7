"""The shape search as a phase of the compress run (`--student params=`): the candidates shape_search.py chose,
planned from one calibration pass of the teacher, each distilled for --search-steps on the same batches and scored
on the held-out sets; the winner is the main run's student (shape_search.py's docstring says how and why)."""
from __future__ import annotations

import functools
import os

from nnx_surgery import evaluation, model_inputs, surgery
from nnx_surgery.evaluation import final_eval
from nnx_surgery.recipes.compress import student_refit, teacher_caching
from nnx_surgery.recipes.compress.run_settings import RunSettings
from nnx_surgery.recipes.compress.shape_search import FOLDER, GUESS, StudentChoice, eval_points, search_config
from nnx_surgery.recipes.config.sections import RecipeConfig


def candidate_plan(run: RunSettings, teacher, candidate: surgery.ShapeCandidate, calibration, directory: str,
                   scored=None) -> surgery.Plan:
    """The one-shot plan of `candidate` from the teacher, read back when an earlier run of this search made it.
    `scored`: a callable giving the teacher's `surgery.TeacherScores` on `calibration` (measured once for every
    candidate)."""
    path = os.path.join(directory, "plans", candidate.text.replace(",", "_") + ".json")
    if os.path.exists(path):
        return surgery.Plan.load(path)
    plan = surgery.plan_student(teacher, candidate.spec, calibration=calibration, source=run.teacher.source,
                                revision=run.config.teacher.revision, seed=run.config.run.seed,
                                scored=None if scored is None else scored())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    plan.save(path)
    return plan


def refitted(run: RunSettings, teacher, plan: surgery.Plan, data):
    """A candidate cut from the teacher as the main run cuts its student (--refit-rows included)."""
    student = surgery.apply_plan(teacher, plan)
    student_refit.refit_student(run, teacher, plan, student, data)
    return student


def search_candidates(run: RunSettings, choice: StudentChoice, teacher, calibration, directory: str,
                      data, scored) -> list:
    """`evaluation.SearchCandidate`s of the chosen shapes: planned now from one calibration pass of the teacher
    (`scored()`: its scores do not depend on the shape), each student built when it trains."""
    found = []
    for candidate in choice.candidates:
        plan = candidate_plan(run, teacher, candidate, calibration, directory, scored)
        found.append(evaluation.SearchCandidate(
            candidate.text, build=lambda plan=plan: refitted(run, teacher, plan, data), plan=plan,
            parameters=candidate.parameters, non_embedding=candidate.non_embedding,
            note=choice.note(candidate)))
    return found


def choose_student_spec(run: RunSettings, teacher, data, calibration, mesh=None):
    """(the main run's student spec, the search's summary for results.json or None, the teacher's
    `surgery.TeacherScores` on `calibration` or None): the explicit student as it is, or the winner of the search
    (module docstring), parsed as an explicit `--student WINNER` would be. The scores are returned when the search
    measured them (it planned a candidate; a resumed search reads its plans back), so that the plans the run makes
    from the same teacher afterwards need no second calibration pass. `run`: the run's settings
    (run_settings.RunSettings)."""
    config, choice = run.config, run.student.choice
    if choice.budget is None:
        return choice.spec, None, None
    directory = os.path.join(run.folder, FOLDER)
    scored = functools.cache(lambda: surgery.score_teacher(teacher, calibration=calibration,
                                                            seed=run.config.run.seed,
                                                            revision=run.config.teacher.revision))
    candidates = search_candidates(run, choice, teacher, calibration, directory, data, scored)
    phase = search_config(config, run.folder, data)
    steps = phase.total_steps
    print(f"[search] {len(candidates)} of the {choice.fitting} shapes within {choice.budget.text} "
          f"({choice.target:,} {choice.budget.counting.replace('_', '-')} parameters "
          f"+-{config.search.tolerance:.0%}), {steps} steps each on the same batches; results in {directory}",
          flush=True)
    cache = teacher_caching.for_phase(run, FOLDER, teacher, data, phase, mesh, readers=len(candidates))
    sets = final_eval.heldout_sets(run.evaluation, data, far=False)  # the far-domain set judges the run's students
    result = evaluation.search(teacher, candidates, data, phase, sets=sets,
                            directory=directory, eval_at=eval_points(steps), rank_by=(final_eval.IN_DOMAIN, "ce"),
                            sampler=surgery.make_sampler() if phase.on_policy.fraction else None,
                            teacher_cache=cache)
    measured = scored() if scored.cache_info().currsize else None
    return model_inputs.student_spec(result.winner, run.teacher.config), search_record(config, choice, result), measured


def search_record(config: RecipeConfig, choice: StudentChoice, result: evaluation.SearchResult) -> dict:
    """What results.json records of the search: the budget, the candidates (ranked), the winner, the uniform
    guess's rank, the ranking at every scored step, and where search.md is (relative to the run folder)."""
    last, steps = result.eval_at[-1], config.search.steps or 1
    assert choice.budget is not None  # a search ran
    ranked = []
    for row in result.rows:
        point = next(p for p in row["curve"] if p["step"] == last)
        ranked.append({"student": row["name"], "parameters": row["parameters"],
                       "non_embedding": row["non_embedding"], "uniform_guess": row.get("note") == GUESS,
                       "scores": {name: {metric: point[name][metric] for metric in ("ce", "ce_per_byte", "kl")}
                                  for name in result.teacher}})
    return {"student": choice.budget.text, "counting": choice.budget.counting, "target_parameters": choice.target,
            "tolerance": config.search.tolerance, "shapes_within_budget": choice.fitting, "steps": steps,
            "tokens_per_candidate": steps * config.tokens_per_step, "eval_at": list(result.eval_at),
            "rank_by": list(result.rank_by), "candidates": ranked, "winner": result.winner,
            "uniform_guess": choice.guess.text, "guess_rank": result.ranking().index(choice.guess.text) + 1,
            "rankings": {str(step): result.ranking(step) for step in result.eval_at},
            "report": os.path.join(FOLDER, "search.md")}


__all__ = ["choose_student_spec", "candidate_plan", "search_candidates", "search_record"]

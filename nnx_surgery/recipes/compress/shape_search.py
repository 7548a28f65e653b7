"""The recipe's shape search: `--student params=0.5` (half the teacher's non-embedding parameters), `params=120M`,
or `params=0.5,counting=total` (the whole checkpoint) chooses the student among the shapes within that budget before
the main run, Minitron's way (nnx_surgery/evaluation/shape_ranking.py), and the main run distils the winner.

    choice = student_choice(flags, teacher_config, tokenizer)   # an explicit --student, or a budget and shapes to try
    spec, summary, scores = search_phase.choose_student_spec(run, teacher, data, calibration)   # the winner

This module decides what the search tries from the settings alone (run_settings.py reads it); search_phase.py runs
the search as a phase of the run.

* The shapes tried (`--search-candidates N`): the uniform guess (`surgery.uniform_spec`: every axis cut by the same
  ratio, what one would pick by hand), so the search shows whether it beats the guess; from N = 3 on, the shape
  within the budget nearest the same uniform cut of depth, hidden and MLP with every head kept (`heads_kept_shape`);
  and the rest of the N from the shapes within `--search-tolerance` of the budget (`surgery.candidate_specs`,
  largest non-embedding count first): the middle one of each of that many equal slices of the list (deterministic,
  and spread over the whole list, not its largest few, so different mixes of depth and width are tried). Or the
  shapes of `--search-shapes 'A;B'` after the guess (each within the budget): Minitron's second step, the top few
  of a short search trained longer to see whether their order holds.
* Each candidate is planned from the teacher in one shot on the calibration rows the main plan uses, all from one
  calibration pass (`surgery.score_teacher`; plans cached in OUT/search/plans/), built from its plan only when it
  trains, and distilled for `--search-steps` with the main stage's settings (loss weights, learning rate, warm-up
  scaled to the search's length, temperature, trainable and frozen patterns, batch, sequence, precision, mesh) on
  identical batches: copies of the run's batches as they stand before the main distillation, which therefore sees
  the batches a run with `--student WINNER` would. With
  --schedule or the config file's stages the search still trains that one stage (a schedule is sized for the main
  run); students are built in memory (`apply_plan`), --from-disk or not.
* Scored at a third, two thirds and the end on the recipe's held-out sets (`final_eval.heldout_sets`: in-domain and,
  unless --no-general-eval, general prose) and ranked by in-domain CE per token: every candidate keeps the teacher's
  tokenizer, so per-token CE compares (a `vocab=` beside `params=` is refused: candidates with a trimmed vocabulary
  would each need the trimmed tokenizer's corpus and held-out sets; search first, then give the winner with vocab=).
* Staged compression (`--compression staged`, the tiny and 7b presets): the search compares one-shot cuts; the main
  run then stages the winner exactly as it stages an explicit --student.
* With `--teacher-cache auto` (and --top-k) the teacher's top k over the search's rows is written once
  (OUT/teacher_cache/search) and every candidate trains from it: the teacher's forward is paid once, not once per
  candidate, and the candidates train on the loss they would with the teacher running (recipes/compress/teacher_caching.py).
* Results in OUT/search/ (search.md, search.json, search.png, a folder per candidate); with --resume a finished
  candidate is read back, not trained again, and an interrupted one continues from its checkpoint.
"""
from __future__ import annotations

import dataclasses
import math

from nnx_surgery import distill
from nnx_surgery import surgery
from nnx_surgery import model_inputs
from nnx_surgery.recipes.compress import phase_configs
from nnx_surgery import refusals
from nnx_surgery.recipes.config.sections import RecipeConfig
from nnx_surgery.surgery.plans.search_space import COUNTINGS, budget_target

FOLDER = "search"
GUESS = "uniform guess"
HEADS_KEPT = "every head kept, the other axes cut alike"


@dataclasses.dataclass(frozen=True)
class Budget:
    """A `--student params=...` budget: the flag's text, the fraction or count, and what it counts."""

    text: str
    params: str
    counting: str = "non_embedding"


@dataclasses.dataclass(frozen=True)
class StudentChoice:
    """An explicit student (`budget` None), or a search: the budget, the shapes to try (the uniform guess first),
    how many shapes fit it, and its target count. `spec` is the explicit student, or the uniform guess (what a dry
    run shows) until the search picks the winner. `heads_kept`: the heads-kept shape's text when the search tries
    it (`heads_kept_shape`)."""

    spec: surgery.StudentSpec
    budget: Budget | None = None
    candidates: tuple[surgery.ShapeCandidate, ...] = ()
    fitting: int = 0
    target: int = 0
    heads_kept: str | None = None

    @property
    def guess(self) -> surgery.ShapeCandidate:
        return self.candidates[0]

    def note(self, candidate: surgery.ShapeCandidate) -> str | None:
        """What search.md and the dry run say beside `candidate`'s name: why the search tries it, if not spread."""
        if candidate.text == self.guess.text:
            return GUESS
        return HEADS_KEPT if candidate.text == self.heads_kept else None


def parse_budget_text(text: str | None) -> Budget | None:
    """The budget of a `--student` value with `params=`, else None. Refuses sizes or a named shape beside it and
    `vocab=` (module docstring) with a one-line error."""
    items = [item.strip() for item in (text or "").split(",")]
    if text is None or not any(item.partition("=")[0].strip() == "params" for item in items):
        return None
    given: dict[str, str] = {}
    for item in items:
        key, _, value = (part.strip() for part in item.partition("="))
        if key == "vocab":
            raise refusals.RecipeError(f"--student {text!r}: the shape search compares candidates in the teacher's "
                                  "tokens, so it does not take vocab=; search without it, then run the winner "
                                  "as --student WINNER,vocab=N.")
        if key not in ("params", "counting"):
            raise surgery.SpecError(f"--student {text!r}: params= lets the search choose the shape, so {item!r} "
                                    "(a size or a named shape) cannot join it; give a budget "
                                    "(params=0.5 or params=120M, optionally ,counting=total) or a shape.")
        given[key] = value
    counting = given.get("counting", "non_embedding").replace("-", "_")
    if counting not in COUNTINGS:
        raise surgery.SpecError(f"--student {text!r}: counting={given['counting']!r}; choose non_embedding (the "
                                "default: the layers alone) or total (the whole checkpoint).")
    return Budget(text, given["params"], counting)


def student_choice(config: RecipeConfig, teacher: surgery.ModelConfig, tokenizer: str | None = None) -> StudentChoice:
    """The student `--student` asks for, checked against the teacher's config (and a `vocab=` against its
    `tokenizer` folder) before any model loads: an explicit shape (`model_inputs.student_spec`), or the budget and the shapes
    the search will try."""
    budget = parse_budget_text(config.student.shape)
    if budget is None and config.search.shapes:
        raise refusals.RecipeError(f"--search-shapes is for a shape search: give --student params=... (a budget) "
                                 f"with it, not --student {config.student.shape!r}.")
    if budget is None:
        return StudentChoice(model_inputs.student_spec(config.student.shape, teacher, tokenizer=tokenizer))
    try:
        target = budget_target(teacher, budget.params, budget.counting)
        fitting = surgery.candidate_specs(teacher, params=budget.params, counting=budget.counting,
                                          tolerance=config.search.tolerance)
        guess = surgery.uniform_spec(teacher, params=budget.params, counting=budget.counting)
        guess.spec.check_against(teacher)
    except surgery.SpecError as error:
        raise surgery.SpecError(f"--student {budget.text!r}: {error}") from None
    near = heads_kept_shape(teacher, budget, fitting)
    chosen = (given_shapes(config.search.shapes, fitting, guess, teacher, budget, config.search.tolerance)
              if config.search.shapes else spread(fitting, guess, config.search.candidates, near=near))
    heads_kept = near.text if near is not None and near.text in {c.text for c in chosen[1:]} else None
    return StudentChoice(model_inputs.student_spec(guess.text, teacher), budget, tuple(chosen), len(fitting), target,
                         heads_kept)


def spread(fitting: list[surgery.ShapeCandidate], guess: surgery.ShapeCandidate, count: int,
           near: surgery.ShapeCandidate | None = None) -> list[surgery.ShapeCandidate]:
    """The uniform guess; from 3 candidates on, `near` second (when given and not the guess); then the middle shape
    of each of the remaining slots' equal slices of `fitting` (all of them when fewer fit)."""
    first = [guess] + ([near] if near is not None and count >= 3 and near.text != guess.text else [])
    taken = {c.text for c in first}
    others = [c for c in fitting if c.text not in taken]
    slots = min(count - len(first), len(others))
    return first + [others[(2 * i + 1) * len(others) // (2 * slots)] for i in range(slots)]


def _sizes(spec: surgery.StudentSpec) -> tuple[int, ...]:
    return (spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.num_attention_heads,
            spec.num_key_value_heads)


def heads_kept_shape(teacher: surgery.ModelConfig, budget: Budget,
                     fitting: list[surgery.ShapeCandidate]) -> surgery.ShapeCandidate | None:
    """The shape of `fitting` nearest (summed |log ratio| over the axes) to the uniform cut of depth, hidden and MLP
    that keeps every attention and KV head: on the real Gemma 3 270M at half its non-embedding parameters that
    shape beat the uniform guess, which also cuts heads, on both held-out sets (BENCHMARKS.md). None when no such
    cut fits the budget."""
    try:
        kept = surgery.uniform_spec(teacher, params=budget.params, counting=budget.counting,
                                    axes=("depth", "hidden", "mlp"))
    except surgery.SpecError:
        return None
    same_heads = [c for c in fitting if _sizes(c.spec)[3:] == _sizes(kept.spec)[3:]]
    if not same_heads:
        return None
    target = _sizes(kept.spec)
    return min(same_heads, key=lambda c: sum(abs(math.log(a / b)) for a, b in zip(_sizes(c.spec), target)))


def given_shapes(text: str, fitting: list[surgery.ShapeCandidate], guess: surgery.ShapeCandidate,
                 teacher: surgery.ModelConfig, budget: Budget, tolerance: float) -> list[surgery.ShapeCandidate]:
    """The uniform guess, then each shape of `--search-shapes` ('SHAPE;SHAPE', in the order given, the guess and
    repeats dropped). A shape outside the budget is refused: the search compares shapes of one size."""
    within = {c.text: c for c in fitting}
    chosen = [guess]
    for shape in (part.strip() for part in text.split(";")):
        if not shape:
            continue
        try:
            spec = model_inputs.student_spec(shape, teacher)
        except surgery.SpecError as error:
            raise surgery.SpecError(f"--search-shapes {shape!r}: {error}") from None
        candidate = surgery.ShapeCandidate(spec, *surgery.parameter_counts(teacher, spec))
        if candidate.text not in within and candidate.text != guess.text:
            counted = (candidate.non_embedding if budget.counting == "non_embedding" else candidate.parameters)
            raise refusals.RecipeError(f"--search-shapes {shape!r}: {counted:,} {budget.counting.replace('_', '-')} "
                                  f"parameters, not within {budget.text} +-{tolerance:.0%} on the teacher's grid; "
                                  "the search compares shapes of one budget (--dry-run lists them).")
        if candidate.text not in {c.text for c in chosen}:
            chosen.append(within.get(candidate.text, candidate))
    return chosen


def eval_points(steps: int) -> tuple[int, ...]:
    """A third, two thirds and the end of the search (fewer when the search is shorter than 3 steps)."""
    return tuple(sorted({max(1, round(steps * k / 3)) for k in (1, 2, 3)}))


def search_config(config: RecipeConfig, out: str, data) -> distill.DistillConfig:
    """One stage of `--search-steps` with the main stage's settings (module docstring); held-out batches only at
    the start and the end (the held-out sets score the candidates), and every candidate trains every step
    (--stop-when-met is the main run's)."""
    steps = config.search.steps or 1
    warmup = min(steps - 1, round((config.training.warmup_steps or 0) * steps / config.training.steps))
    stage = dataclasses.replace(phase_configs.flag_stage(config, "search", steps), warmup_steps=max(0, warmup))
    phase = phase_configs.phase_config(config, FOLDER, [stage], None, out, data)
    return dataclasses.replace(phase, eval_every=steps, targets=dataclasses.replace(phase.targets, stop_when_met=False))


__all__ = ["Budget", "StudentChoice", "parse_budget_text", "student_choice", "spread", "eval_points",
           "search_config", "FOLDER", "GUESS", "HEADS_KEPT"]

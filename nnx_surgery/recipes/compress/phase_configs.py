"""The recipe's training phases as DistillConfigs, built from the resolved settings without touching a model, so
every flag can be checked against the config it produces.

    stage_a_stage   staged compression only: one stage after the depth + MLP cut
    stage_b   after the final cut: a K/V warm-up when KV heads were merged, then the main stages (one stage from
              the loss flags, a named --schedule, or the config file's distill.stages)
    control   the baseline on the same number of optimizer steps: plain CE (pruned-ce) or from scratch
    teacher_correction   --teacher-correction only, before any surgery: the teacher fine-tuned with plain CE

Each takes the run's `RecipeConfig`; `run_settings.for_config` builds the stages once, for the student's real depth,
and a phase's DistillConfig is `dataclasses.replace` of the run's (`phase_config`). `check_stage_settings` checks
what they are built from before any teacher is read.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any, Callable

from nnx_surgery import distill
from nnx_surgery.distill import schedules, terms
from nnx_surgery.recipes.config.layering import thaw
from nnx_surgery.recipes.config.sections import RecipeConfig
from nnx_surgery.refusals import RecipeError

# progressive returns its stages, sft_then_distil its one stage
SCHEDULE_FUNCTIONS: dict[str, Callable[..., Any]] = {"progressive": schedules.progressive,
                                                     "sft-then-distil": schedules.sft_then_distil}


def term_weights(config: RecipeConfig) -> dict[str, float]:
    """Every flagged loss term's weight (0 for those the settings do not name)."""
    given = config.training.term_weights
    return {term.name: float(given.get(term.name, 0.0)) for term in terms.flagged()}


def loss_weights(config: RecipeConfig, feature: float = 0.0) -> distill.LossWeights:
    """alpha * (--loss divergence) + (1 - alpha) * CE, plus the terms with a weight flag (`feature` for the
    feature term's, as the phase says)."""
    training = config.training
    return distill.LossWeights.mixed(training.alpha, training.loss, **{**term_weights(config), "feature": feature})


def stage_a_stage(config: RecipeConfig) -> distill.Stage:
    return flag_stage(config, "A: depth+MLP",
                      max(1, round(config.training.steps * config.surgery.stage_a_fraction)))


def flag_stage(config: RecipeConfig, name: str, steps: int) -> distill.Stage:
    """One stage of `steps` from the flags: learning rate and warm-up, trainable and frozen patterns, the loss
    flags' weights, the temperature."""
    training = config.training
    return distill.Stage(steps=steps, name=name, trainable=training.trainable, frozen=training.frozen,
                         learning_rate=training.learning_rate, warmup_steps=training.warmup_steps or 0,
                         weights=loss_weights(config, term_weights(config)["feature"]),
                         temperature=training.temperature)


def kv_warmup(config: RecipeConfig, steps: int) -> distill.Stage:
    """Only the merged K/V projections and the norms train, on the divergence alone."""
    training = config.training
    return distill.Stage(steps=steps, name="B1: merged K/V + norms",
                         trainable=["*.self_attn.k_proj", "*.self_attn.v_proj", "*norm*"],
                         learning_rate=training.learning_rate, warmup_steps=max(1, steps // 10),
                         weights=distill.LossWeights({"kl": 0.0, training.loss: 1.0}),
                         temperature=training.temperature)


def main_stages(config: RecipeConfig, num_layers: int, steps: int) -> list[distill.Stage]:
    """The stages after the final cut: the config file's, a named schedule's over `steps`, or one stage."""
    given = config.training.stages
    if given:
        return [_given_stage(thaw(stage), steps, i) for i, stage in enumerate(given)]
    if config.training.schedule in SCHEDULE_FUNCTIONS:
        return list(scheduled(config, num_layers, steps))
    return [flag_stage(config, "B2: everything", steps)]


def _given_stage(stage: dict, steps: int, index: int) -> distill.Stage:
    """A stage of the config file: DistillConfig's Stage fields, and (recipe only) `fraction` of the main steps
    instead of steps or epochs, so one file works at any --steps."""
    if "fraction" in stage:
        fraction = stage.pop("fraction")
        if "steps" in stage or "epochs" in stage or not 0 < fraction <= 1:
            raise RecipeError(f"training.stages[{index}]: fraction={fraction} must lie in (0, 1] and replace "
                              "steps and epochs, not join them.")
        stage["steps"] = max(1, round(fraction * steps))
    return distill.DistillConfig.from_dict({"stages": [stage]}).stages[0]


def scheduled(config: RecipeConfig, num_layers: int, steps: int) -> tuple[distill.Stage, ...]:
    """The named schedule with the recipe's loss settings and `schedule_options` (any of its parameters; give
    "epochs" there to size it in epochs of the data instead of steps)."""
    training = config.training
    function: Any = SCHEDULE_FUNCTIONS[training.schedule]
    options = schedule_options(config)
    length = {"epochs": options.pop("epochs")} if "epochs" in options else {"total_steps": steps}
    common = dict(alpha=training.alpha, divergence=training.loss, temperature=training.temperature, **length)
    if training.schedule == "progressive":
        extra = {name: weight for name, weight in term_weights(config).items() if weight}
        return function(num_layers, extra_weights=extra, extra_frozen=training.frozen or (), **common, **options)
    options.setdefault("learning_rate", training.learning_rate)
    options.setdefault("warmup_steps", training.warmup_steps)
    options.setdefault("frozen", training.frozen)
    options.setdefault("trainable", training.trainable)
    return (function(**common, **options),)


def schedule_options(config: RecipeConfig) -> dict:
    """The named schedule's `schedule_options` (a copy), refused when one is not a parameter it takes."""
    training = config.training
    options = thaw(training.schedule_options or {})
    allowed = set(inspect.signature(SCHEDULE_FUNCTIONS[training.schedule]).parameters) - {
        "num_layers", "total_steps", "alpha", "divergence", "temperature", "extra_weights", "extra_frozen"}
    if training.schedule == "sft-then-distil":
        allowed |= {"trainable", "frozen", "min_lr_ratio", "weight_decay"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise RecipeError(f"schedule_options {unknown} unknown for --schedule {training.schedule}; it takes "
                          f"{', '.join(sorted(allowed))}.")
    return options


def check_stage_settings(config: RecipeConfig) -> None:
    """What the stages will be built from, checked before any teacher is read (their depth is not known yet): the
    config file's stages and the schedule's options (the flags' own stage was built with the distill section)."""
    for index, stage in enumerate(config.training.stages or ()):
        _given_stage(thaw(stage), config.training.steps, index)
    if config.training.schedule in SCHEDULE_FUNCTIONS:
        schedule_options(config)


def control_stage(config: RecipeConfig, steps: int) -> distill.Stage:
    training, student = config.training, config.student
    learning_rate = training.learning_rate if student.control == "pruned-ce" else student.scratch_learning_rate
    if learning_rate is None:  # resolution.derive writes it from --learning-rate
        raise RecipeError(f"the {student.control} control has no learning rate; set student.scratch_learning_rate.")
    return distill.Stage(steps=steps, name=student.control, learning_rate=learning_rate,
                         trainable=training.trainable, frozen=training.frozen,
                         warmup_steps=training.warmup_steps or 0, weights=distill.LossWeights(kl=0.0, ce=1.0))


def teacher_correction_stage(config: RecipeConfig) -> distill.Stage:
    """Plain CE on the distillation corpus for the teacher itself (what the user froze stays frozen)."""
    teacher, training = config.teacher, config.training
    if teacher.correction_lr is None:  # resolution.derive writes it from --learning-rate
        raise RecipeError("the teacher correction has no learning rate; set teacher.correction_lr.")
    return distill.Stage(steps=teacher.correction, name="teacher correction",
                         learning_rate=teacher.correction_lr, trainable=training.trainable, frozen=training.frozen,
                         warmup_steps=min(2, teacher.correction - 1), weights=distill.LossWeights(kl=0.0, ce=1.0))


def phase_config(config: RecipeConfig, phase: str, stages, plan: Any, out: str, data: Any = None,
                 halt_after: int | None = None) -> distill.DistillConfig:
    """One phase's DistillConfig: the run's, with these stages, the plan, checkpoints and logs under `out`, and
    `halt_after` (--halt-after). With `data`, stages given in epochs are resolved to steps
    (`distill.loop.schedules.resolve_epochs`)."""
    run = config.distill
    checkpoint = dataclasses.replace(run.checkpoint, directory=os.path.join(out, "checkpoints", phase), resume=True)
    on_policy, top_k = run.on_policy, run.top_k
    if phase in ("control", "teacher_correction"):  # plain CE: no teacher to score samples or give a top k
        on_policy, top_k = dataclasses.replace(on_policy, fraction=0.0), None
    phase_run = dataclasses.replace(run, stages=tuple(stages), plan=plan, checkpoint=checkpoint, on_policy=on_policy,
                                    top_k=top_k, run_dir=os.path.join(out, "logs", phase), halt_after=halt_after)
    return schedules.resolve_epochs(phase_run, data) if data is not None else phase_run


__all__ = ["loss_weights", "term_weights", "check_stage_settings", "schedule_options", "stage_a_stage", "flag_stage",
           "kv_warmup", "main_stages", "scheduled", "control_stage", "teacher_correction_stage", "phase_config"]

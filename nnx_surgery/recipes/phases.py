"""The recipe's training phases as DistillConfigs, built from the resolved settings without touching a model, so
every flag can be checked against the config it produces.

    stage_a   staged compression only: one stage after the depth + MLP cut
    stage_b   after the final cut: a K/V warm-up when KV heads were merged, then the main stages (one stage from
              the loss flags, a named --schedule, or the config file's distill.stages)
    control   the baseline on the same number of optimizer steps: plain CE (pruned-ce) or from scratch
    teacher_correction   --teacher-correction only, before any surgery: the teacher fine-tuned with plain CE

Each takes the resolved flags (`settings.Flags`); `run_settings.resolve` builds the stages once, for the student's
real depth. `check_stage_settings` checks what they are built from before any teacher is read.
"""
from __future__ import annotations

import inspect
import os
from typing import Any

from nnx_surgery import distill
from nnx_surgery.distill import schedules
from nnx_surgery.recipes.cli import RecipeError
from nnx_surgery.recipes.frozen import thaw
from nnx_surgery.recipes.knobs import term_weights

SCHEDULE_FUNCTIONS = {"progressive": schedules.progressive, "sft-then-distil": schedules.sft_then_distil}


def loss_weights(args: Any, feature: float = 0.0) -> distill.LossWeights:
    """alpha * (--loss divergence) + (1 - alpha) * CE, plus the terms with a weight flag (`feature` for the
    feature term's, as the phase says)."""
    return distill.LossWeights.mixed(args.alpha, args.loss, **{**term_weights(args), "feature": feature})


def stage_a(args: Any) -> distill.Stage:
    return flag_stage(args, "A: depth+MLP", max(1, round(args.steps * args.stage_a_fraction)))


def flag_stage(args: Any, name: str, steps: int) -> distill.Stage:
    """One stage of `steps` from the flags: learning rate and warm-up, trainable and frozen patterns, the loss
    flags' weights, the temperature."""
    return distill.Stage(steps=steps, name=name, trainable=args.trainable, frozen=args.frozen,
                         learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
                         weights=loss_weights(args, args.feature_weight), temperature=args.temperature)


def kv_warmup(args: Any, steps: int) -> distill.Stage:
    """Only the merged K/V projections and the norms train, on the divergence alone."""
    return distill.Stage(steps=steps, name="B1: merged K/V + norms",
                         trainable=["*.self_attn.k_proj", "*.self_attn.v_proj", "*norm*"],
                         learning_rate=args.learning_rate, warmup_steps=max(1, steps // 10),
                         weights=distill.LossWeights({"kl": 0.0, args.loss: 1.0}), temperature=args.temperature)


def main_stages(args: Any, num_layers: int, steps: int) -> list[distill.Stage]:
    """The stages after the final cut: the config file's, a named schedule's over `steps`, or one stage."""
    given = args.distill.get("stages")
    if given:
        return [_given_stage(thaw(stage), steps, i) for i, stage in enumerate(given)]
    if args.schedule in SCHEDULE_FUNCTIONS:
        return list(scheduled(args, num_layers, steps))
    return [flag_stage(args, "B2: everything", steps)]


def _given_stage(stage: dict, steps: int, index: int) -> distill.Stage:
    """A stage of the config file: DistillConfig's Stage fields, and (recipe only) `fraction` of the main steps
    instead of steps or epochs, so one file works at any --steps."""
    if "fraction" in stage:
        fraction = stage.pop("fraction")
        if "steps" in stage or "epochs" in stage or not 0 < fraction <= 1:
            raise RecipeError(f"distill.stages[{index}]: fraction={fraction} must lie in (0, 1] and replace "
                              "steps and epochs, not join them.")
        stage["steps"] = max(1, round(fraction * steps))
    return distill.DistillConfig.from_dict({"stages": [stage]}).stages[0]


def scheduled(args: Any, num_layers: int, steps: int) -> tuple[distill.Stage, ...]:
    """The named schedule with the recipe's loss settings and `schedule_options` (any of its parameters; give
    "epochs" there to size it in epochs of the data instead of steps)."""
    function = SCHEDULE_FUNCTIONS[args.schedule]
    options = schedule_options(args)
    length = {"epochs": options.pop("epochs")} if "epochs" in options else {"total_steps": steps}
    common = dict(alpha=args.alpha, divergence=args.loss, temperature=args.temperature, **length)
    if args.schedule == "progressive":
        extra = {name: weight for name, weight in term_weights(args).items() if weight}
        return function(num_layers, extra_weights=extra, extra_frozen=args.frozen or (), **common, **options)
    options.setdefault("learning_rate", args.learning_rate)
    options.setdefault("warmup_steps", args.warmup_steps)
    options.setdefault("frozen", args.frozen)
    options.setdefault("trainable", args.trainable)
    return (function(**common, **options),)


def schedule_options(args: Any) -> dict:
    """The named schedule's `schedule_options` (a copy), refused when one is not a parameter it takes."""
    options = thaw(args.schedule_options or {})
    allowed = set(inspect.signature(SCHEDULE_FUNCTIONS[args.schedule]).parameters) - {
        "num_layers", "total_steps", "alpha", "divergence", "temperature", "extra_weights", "extra_frozen"}
    if args.schedule == "sft-then-distil":
        allowed |= {"trainable", "frozen", "min_lr_ratio", "weight_decay"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise RecipeError(f"schedule_options {unknown} unknown for --schedule {args.schedule}; it takes "
                          f"{', '.join(sorted(allowed))}.")
    return options


def check_stage_settings(args: Any) -> None:
    """What the stages will be built from, checked before any teacher is read (their depth is not known yet): the
    config file's stages, the schedule's options, and the distill section with the stage the loss flags make."""
    for index, stage in enumerate(args.distill.get("stages") or ()):
        _given_stage(thaw(stage), args.steps, index)
    if args.schedule in SCHEDULE_FUNCTIONS:
        schedule_options(args)
    distill.DistillConfig.from_dict({**thaw(args.distill), "stages": [flag_stage(args, "check", args.steps)]})


def control_stage(args: Any, steps: int) -> distill.Stage:
    learning_rate = args.learning_rate if args.control == "pruned-ce" else args.scratch_learning_rate
    return distill.Stage(steps=steps, name=args.control, learning_rate=learning_rate, trainable=args.trainable,
                         frozen=args.frozen, warmup_steps=args.warmup_steps,
                         weights=distill.LossWeights(kl=0.0, ce=1.0))


def teacher_correction_stage(args: Any) -> distill.Stage:
    """Plain CE on the distillation corpus for the teacher itself (what the user froze stays frozen)."""
    return distill.Stage(steps=args.teacher_correction, name="teacher correction",
                         learning_rate=args.teacher_correction_lr, trainable=args.trainable, frozen=args.frozen,
                         warmup_steps=min(2, args.teacher_correction - 1), weights=distill.LossWeights(kl=0.0, ce=1.0))


def phase_config(args: Any, phase: str, stages, plan: Any, out: str, data: Any = None, halt_after: int | None = None
                 ) -> distill.DistillConfig:
    """One phase's DistillConfig: the resolved distill section, these stages, and what the recipe manages
    (sizes, precision, mesh, seed, checkpoints and logs under `out`, `halt_after` from --halt-after). With `data`,
    stages given in epochs are resolved to steps (`distill.schedules.resolve_epochs`)."""
    section = {key: value for key, value in thaw(args.distill).items() if key != "stages"}
    section["checkpoint"] = {**section["checkpoint"], "directory": os.path.join(out, "checkpoints", phase),
                             "resume": True}
    if phase in ("control", "teacher_correction"):  # plain CE: no teacher to score the model's samples
        section["on_policy"] = {**section.get("on_policy", {}), "fraction": 0.0}
    config = distill.DistillConfig.from_dict({
        **section, "stages": tuple(stages), "batch_size": args.batch_size, "seq_len": args.seq_len, "plan": plan,
        "compute_dtype": args.compute_dtype, "mesh": args.mesh,
        "mesh_devices": args.mesh_devices, "run_dir": os.path.join(out, "logs", phase),
        "eval_batches": args.eval_batches, "halt_after": halt_after,
        "seed": args.seed, "plots": False})
    return schedules.resolve_epochs(config, data) if data is not None else config


__all__ = ["loss_weights", "check_stage_settings", "schedule_options", "stage_a", "flag_stage", "kv_warmup",
           "main_stages", "scheduled", "control_stage",
           "teacher_correction_stage", "phase_config"]

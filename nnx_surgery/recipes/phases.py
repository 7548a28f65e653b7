"""The recipe's training phases as DistillConfigs, built from the resolved settings without touching a model, so
every flag can be checked against the config it produces.

    stage_a   staged compression only: one stage after the depth + MLP cut
    stage_b   after the final cut: a K/V warm-up when KV heads were merged, then the main stages (one stage from
              the loss flags, a named --schedule, or the config file's distill.stages)
    control   the baseline on the same number of optimizer steps: plain CE (pruned-ce) or from scratch
    teacher_correction   --teacher-correction only, before any surgery: the teacher fine-tuned with plain CE
"""
from __future__ import annotations

import argparse
import inspect
import os
from typing import Any

from nnx_surgery import distill
from nnx_surgery.distill import schedules
from nnx_surgery.recipes.cli import RecipeError
from nnx_surgery.recipes.knobs import term_weights

SCHEDULE_FUNCTIONS = {"progressive": schedules.progressive, "sft-then-distil": schedules.sft_then_distil}


def loss_weights(args: argparse.Namespace, feature: float = 0.0) -> distill.LossWeights:
    """alpha * (--loss divergence) + (1 - alpha) * CE, plus the terms with a weight flag (`feature` for the
    feature term's, as the phase says)."""
    return distill.LossWeights.mixed(args.alpha, args.loss, **{**term_weights(args), "feature": feature})


def warmup_steps(args: argparse.Namespace) -> int:
    return args.warmup_steps if args.warmup_steps is not None else args.steps // 50


def stage_a(args: argparse.Namespace) -> distill.Stage:
    return distill.Stage(steps=max(1, round(args.steps * args.stage_a_fraction)), name="A: depth+MLP",
                         learning_rate=args.learning_rate, warmup_steps=warmup_steps(args),
                         trainable=args.trainable, frozen=args.frozen, weights=loss_weights(args, args.feature_weight),
                         temperature=args.temperature)


def kv_warmup(args: argparse.Namespace, steps: int) -> distill.Stage:
    """Only the merged K/V projections and the norms train, on the divergence alone."""
    return distill.Stage(steps=steps, name="B1: merged K/V + norms",
                         trainable=["*.self_attn.k_proj", "*.self_attn.v_proj", "*norm*"],
                         learning_rate=args.learning_rate, warmup_steps=max(1, steps // 10),
                         weights=distill.LossWeights({"kl": 0.0, args.loss: 1.0}), temperature=args.temperature)


def main_stages(args: argparse.Namespace, num_layers: int, steps: int) -> list[distill.Stage]:
    """The stages after the final cut: the config file's, a named schedule's over `steps`, or one stage."""
    given = args.distill.get("stages")
    if given:
        return [_given_stage(dict(stage), steps, i) for i, stage in enumerate(given)]
    if args.schedule in SCHEDULE_FUNCTIONS:
        return list(scheduled(args, num_layers, steps))
    return [distill.Stage(steps=steps, name="B2: everything", trainable=args.trainable, frozen=args.frozen,
                          learning_rate=args.learning_rate, warmup_steps=warmup_steps(args),
                          weights=loss_weights(args, args.feature_weight), temperature=args.temperature)]


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


def scheduled(args: argparse.Namespace, num_layers: int, steps: int) -> tuple[distill.Stage, ...]:
    """The named schedule with the recipe's loss settings and `schedule_options` (any of its parameters; give
    "epochs" there to size it in epochs of the data instead of steps)."""
    function = SCHEDULE_FUNCTIONS[args.schedule]
    options = dict(args.schedule_options or {})
    allowed = set(inspect.signature(function).parameters) - {"num_layers", "total_steps", "alpha", "divergence",
                                                             "temperature", "extra_weights", "extra_frozen"}
    if args.schedule == "sft-then-distil":
        allowed |= {"trainable", "frozen", "min_lr_ratio", "weight_decay"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise RecipeError(f"schedule_options {unknown} unknown for --schedule {args.schedule}; it takes "
                          f"{', '.join(sorted(allowed))}.")
    length = {"epochs": options.pop("epochs")} if "epochs" in options else {"total_steps": steps}
    common = dict(alpha=args.alpha, divergence=args.loss, temperature=args.temperature, **length)
    if args.schedule == "progressive":
        extra = {name: weight for name, weight in term_weights(args).items() if weight}
        return function(num_layers, extra_weights=extra, extra_frozen=args.frozen or (), **common, **options)
    options.setdefault("learning_rate", args.learning_rate)
    options.setdefault("warmup_steps", warmup_steps(args))
    options.setdefault("frozen", args.frozen)
    options.setdefault("trainable", args.trainable)
    return (function(**common, **options),)


def control_stage(args: argparse.Namespace, steps: int) -> distill.Stage:
    learning_rate = args.learning_rate if args.control == "pruned-ce" else args.scratch_learning_rate
    return distill.Stage(steps=steps, name=args.control, learning_rate=learning_rate, trainable=args.trainable,
                         frozen=args.frozen, warmup_steps=warmup_steps(args),
                         weights=distill.LossWeights(kl=0.0, ce=1.0))


def teacher_correction_stage(args: argparse.Namespace) -> distill.Stage:
    """Plain CE on the distillation corpus for the teacher itself (what the user froze stays frozen)."""
    return distill.Stage(steps=args.teacher_correction, name="teacher correction",
                         learning_rate=args.teacher_correction_lr, trainable=args.trainable, frozen=args.frozen,
                         warmup_steps=min(2, args.teacher_correction - 1), weights=distill.LossWeights(kl=0.0, ce=1.0))


def phase_config(args: argparse.Namespace, phase: str, stages, plan: Any, out: str, data: Any = None
                 ) -> distill.DistillConfig:
    """One phase's DistillConfig: the resolved distill section, these stages, and what the recipe manages
    (sizes, precision, mesh, seed, checkpoints and logs under `out`). With `data`, stages given in epochs are
    resolved to steps (`distill.schedules.resolve_epochs`)."""
    section = {key: value for key, value in args.distill.items() if key != "stages"}
    section["checkpoint"] = {**section["checkpoint"], "directory": os.path.join(out, "checkpoints", phase),
                             "resume": True}
    if phase in ("control", "teacher_correction"):  # plain CE: no teacher to score the model's samples
        section["on_policy"] = {**section.get("on_policy", {}), "fraction": 0.0}
    config = distill.DistillConfig.from_dict({
        **section, "stages": tuple(stages), "batch_size": args.batch_size, "seq_len": args.seq_len, "plan": plan,
        "compute_dtype": "bfloat16" if args.precision == "bf16" else "float32", "mesh": args.mesh,
        "mesh_devices": args.mesh_devices, "run_dir": os.path.join(out, "logs", phase),
        "eval_batches": args.eval_batches, "halt_after": getattr(args, "halt_steps", {}).get(phase),
        "seed": args.seed, "plots": False})
    return schedules.resolve_epochs(config, data) if data is not None else config


__all__ = ["loss_weights", "warmup_steps", "stage_a", "kv_warmup", "main_stages", "scheduled", "control_stage",
           "teacher_correction_stage", "phase_config"]

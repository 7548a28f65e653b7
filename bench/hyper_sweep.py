"""The distillation's hyper-parameters at one budget, on one cut (issue 61): the recipe's teacher, data and cut made
once, then the distillation trained once per variant (learning rate, alpha, temperature) and the pruned-CE
control once per learning rate, every one from the same pruned student on the same batches in the same order,
and all of them scored together on the recipe's three held-out sets: closure per byte, and each distillation
against each control per byte with its paired 95% interval, as results.md's verdicts say them.

    python bench/hyper_sweep.py --variants "lr=2e-5,alpha=0.5 lr=1e-4,alpha=0.5 lr=1e-4,alpha=0.5,t=2" \\
        --controls 2e-5,1e-4 --scale 100 -- --preset gemma3-270m-tpu --output runs/sweep

Everything after `--` is the recipe's command line (its preset, output folder, ...; the sweep adds --control none,
as it trains its own controls, and --resume); `--scale N` sets the batch, steps and warm-up of N x the CPU demo's
tokens as bench/demo_budget_curve.py does. The learning rate, temperature and loss weights are traced inputs of
the step, so the variants that turn on the same loss terms share one compiled program (alpha=1 turns CE off: a
program of its own). Each trained student is kept in
OUTPUT/phases/<name> and read back by a rerun (a device command's 10 minutes can stop the sweep; run the same
command again); the evaluation runs once all are trained, without generations or multiple choice, and writes
OUTPUT/sweep.json and OUTPUT/sweep.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from demo_budget_curve import scale_settings  # noqa: E402
from nnx_surgery import distill  # noqa: E402
from nnx_surgery.recipes import compress_command  # noqa: E402
from nnx_surgery.recipes.compress import (compile_cache, phase_configs, pipeline, run_phases,  # noqa: E402
                                          run_settings, student_refit, vocabulary)
from nnx_surgery.recipes.compress.reporting import gap_closed  # noqa: E402
from nnx_surgery.evaluation import final_eval  # noqa: E402

KEYS = {"lr": "learning_rate", "alpha": "alpha", "t": "temperature"}


@dataclasses.dataclass(frozen=True)
class Variant:
    learning_rate: float
    alpha: float  # the KL weight; CE weighs 1 - alpha
    temperature: float = 1.0

    @property
    def name(self) -> str:
        return f"distilled lr={self.learning_rate:g} alpha={self.alpha:g} t={self.temperature:g}"


def parse_variants(text: str) -> list[Variant]:
    """"lr=2e-5,alpha=0.5 lr=1e-4,alpha=1,t=2" -> Variants (alpha and t default to 0.5 and 1)."""
    variants = []
    for item in text.split():
        values: dict[str, float] = {"alpha": 0.5}
        for pair in item.split(","):
            key, _, value = pair.partition("=")
            if key not in KEYS:
                raise SystemExit(f"--variants: {key!r} in {item!r} is not one of {sorted(KEYS)} "
                                 "(e.g. lr=1e-4,alpha=0.5).")
            try:
                values[KEYS[key]] = float(value)
            except ValueError:
                raise SystemExit(f"--variants: {pair!r} in {item!r} needs a number after '='.") from None
        if "learning_rate" not in values or not 0 <= values["alpha"] <= 1:
            raise SystemExit(f"--variants: {item!r} needs lr=... and an alpha from 0 to 1.")
        variants.append(Variant(**values))
    return variants


def control_name(learning_rate: float) -> str:
    return f"control lr={learning_rate:g}"


def folder_name(name: str) -> str:
    return "sweep-" + name.replace(" ", "_").replace("=", "")


def one_stage(run) -> distill.Stage:
    """The recipe's one main stage (a one-shot cut's), whose loss the variants vary."""
    stages = run.stages.stage_b
    if len(stages) != 1 or set(stages[0].weights.active()) - {"kl", "ce"}:
        raise SystemExit("the sweep varies one stage of KL and CE: use --compression oneshot, a student without "
                         "merged KV heads, and no feature or attention term.")
    return stages[0]


def train_all(run, loaded, first, cut, variants: list[Variant], controls: list[float]) -> list[tuple[str, object]]:
    """Every control and variant from the pruned student's very weights on the same batches (phases kept). With
    --compile-ahead (auto: on an accelerator) the variants' step compiles while the controls train."""
    start, stage, trained = cut.data.state(), one_stage(run), []
    recipe = run.config
    jobs = [(control_name(lr), None, phase_configs.control_stage(dataclasses.replace(
        recipe, training=dataclasses.replace(recipe.training, learning_rate=lr),
        student=dataclasses.replace(recipe.student, control="pruned-ce")), stage.steps)) for lr in controls]
    jobs += [(v.name, loaded.teacher, dataclasses.replace(
        stage, name=v.name, learning_rate=v.learning_rate, temperature=v.temperature,
        weights=distill.LossWeights(kl=v.alpha, ce=1.0 - v.alpha))) for v in variants]
    configs = [run.phase_config(folder_name(name), [job_stage], cut.lineage, cut.data) if teacher is not None
               else run.phase_config(folder_name(name), [job_stage])  # as distil() and train_control() make them
               for name, teacher, job_stage in jobs]
    ahead = (distill.compile_ahead(loaded.teacher, cut.student, cut.data, configs[len(controls)])
             if controls and variants and compile_cache.compiles_ahead(run) else None)
    for (name, teacher, _), config in zip(jobs, configs):
        if teacher is not None and ahead is not None:
            print(f"[sweep] the variants' step compiled while the controls trained: {ahead.wait()}", flush=True)
            ahead = None
        student = run_phases.make_student(run, first.student, cut.plan, "stage_b", loaded.mesh)
        student_refit.restore(student, cut.refit)
        cut.data.restore(start)
        print(f"[sweep] {name}", flush=True)
        done = run_phases.train(run, folder_name(name), teacher, student, cut.data, config, loaded.mesh,
                                source=cut.tokenizer or run.teacher.folder)
        trained.append((name, done.model))
    return trained


def closure_table(results: dict, variants: list[str], controls: list[str]) -> tuple[dict, str]:
    """Per model and set: the share of the pruned-to-teacher gap per byte it closed; per (variant, control) and
    set: distilled - control per byte [95% interval]. Returned as a record and a markdown table."""
    closed = gap_closed(results, {name: name for name in [*variants, *controls]})
    versus: dict = {}
    for title, held in results["sets"].items():
        for comparison in held.get("comparisons", []):
            if comparison["a"] in variants and comparison["b"] in controls and comparison.get("ce_per_byte"):
                versus.setdefault(f"{comparison['a']} - {comparison['b']}", {})[title] = comparison["ce_per_byte"]
    titles = list(closed)
    lines = ["| model | " + " | ".join(f"{t} closed" for t in titles) + " |", "|---|" + "---|" * len(titles)]
    lines += [f"| {name} | " + " | ".join(f"{100 * closed[t][name]:.0f}%" for t in titles) + " |"
              for name in [*variants, *controls]]
    lines += ["", "| distilled - control (nats/byte) | " + " | ".join(titles) + " |", "|---|" + "---|" * len(titles)]
    for pair, sets in versus.items():
        cells = [f"{d['difference']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]" if d.get("low") is not None
                 else f"{d['difference']:+.4f}" for d in (sets.get(t, {"difference": float("nan")}) for t in titles)]
        lines.append(f"| {pair} | " + " | ".join(cells) + " |")
    return {"closed": closed, "versus": versus}, "\n".join(lines)


def sweep(recipe_argv: list[str], variants: list[Variant], controls: list[float]) -> dict:
    config = compress_command.parse_args(["--eval-prompts", "0", "--choice-items", "0", *recipe_argv])
    run = run_settings.for_config(config)
    os.makedirs(run.folder, exist_ok=True)
    loaded = run_phases.load_teacher_and_data(run)
    compile_cache.enable(run.folder)
    pipeline.record_settings(run)  # resolved_config.json and run_args.json: a rerun continues (--resume)
    chosen = run_phases.choose_student(run, loaded, loaded.teacher)
    run = chosen.run
    first = run_phases.stage_a(run, loaded, loaded.teacher, chosen.teacher_scores)
    if first.plan is not None:
        raise SystemExit("the sweep needs --compression oneshot (one cut, one stage).")
    cut = run_phases.final_cut(run, loaded, loaded.teacher, first, chosen.teacher_scores)
    trained = train_all(run, loaded, first, cut, variants, controls)
    rows = [("teacher", loaded.teacher, 0), ("pruned (before distillation)", cut.pruned, 0)]
    tokens = one_stage(run).steps * run.config.tokens_per_step
    rows += [(name, model, tokens) for name, model in trained]
    names = [v.name for v in variants]
    control_names = [control_name(lr) for lr in controls]
    pairs = [(v, c) for v in names for c in control_names]
    results = final_eval.evaluate_rows(run.evaluation, rows, cut.data, run.folder, pairs=pairs,
                                       vocabularies=vocabulary.vocabularies(rows, cut.plan, cut.tokenizer,
                                                                            run.teacher.config.vocab_size))
    record, table = closure_table(results, names, control_names)
    record.update(tokens=tokens, results=results)
    with open(os.path.join(run.folder, "sweep.json"), "w") as handle:
        json.dump(record, handle, indent=1)
    with open(os.path.join(run.folder, "sweep.md"), "w") as handle:
        handle.write(f"{tokens:,} training tokens each\n\n{table}\n")
    print(table, flush=True)
    return record


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, recipe = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", required=True, help="space-separated lr=..,alpha=..,t=.. (alpha 0.5, t 1)")
    parser.add_argument("--controls", default="", help="comma-separated learning rates of pruned-CE controls")
    parser.add_argument("--scale", type=int, default=None, help="N x the CPU demo's tokens (batch, steps, warm-up)")
    args = parser.parse_args(ours)
    if args.scale:
        settings = scale_settings(args.scale)
        recipe = ["--batch-size", str(settings["batch"]), "--steps", str(settings["steps"]),
                  "--warmup-steps", str(settings["warmup"]), *recipe]
    try:
        controls = [float(lr) for lr in args.controls.split(",") if lr.strip()]
    except ValueError:
        raise SystemExit(f"--controls {args.controls!r}: give comma-separated learning rates, e.g. "
                         "2e-5,1e-4.") from None
    sweep([*recipe, "--control", "none", "--resume"], parse_variants(args.variants), controls)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Gemma 7B -> a Gemma-2B-shaped student: load, plan, prune, distil in stages, evaluate, save, push.

    python recipes/gemma_7b_to_2b.py --teacher google/gemma-7b --data 'corpus/*.txt' --output runs/7b-to-2b
    python recipes/gemma_7b_to_2b.py --preset tiny --output runs/tiny      # offline, a few minutes on a CPU

Read it top to bottom: it is the documented example of the Python API (`surgery` then `distill`).

Why the defaults (shared/research/anchors.md §1.1 and §6):
* 7B -> 2B (28 -> 18 layers, hidden 3072 -> 2048, MLP 24576 -> 16384, 16 -> 8 query heads, 16 -> 1 KV heads)
  removes ~70% of the parameters, past the ~50% where one-shot pruning recovers poorly (ModelOpt's guidance), so
  compression is staged (`--compression staged`): stage A cuts depth and MLP width, a short distillation
  recovers, then stage B cuts hidden size and query heads and merges the KV heads.
* 16 KV heads -> 1 cannot be done by picking heads: they are mean-merged (GQA paper). Right after the merge only
  the merged K/V projections and the norms train (`--kv-warmup`), everything else frozen, so the new projections
  adapt before they disturb the rest; then everything trains.
* Importance is Minitron's: activation-based on calibration samples (MLP neurons, heads, hidden channels) and
  block influence (1 - cos) for depth. Embeddings are rescaled for the smaller sqrt(hidden) (plan docs).
* Loss: forward KL at temperature 1 as the base (Minitron: KL alone beats mixing in CE), plus a feature loss on
  mapped layers (teacher layer kept_layers[i] -> student layer i) because depth is cut by 36% (`--feature-weight`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import distill  # noqa: E402
import surgery  # noqa: E402
from distill.evaluate import heldout_loss  # noqa: E402
from recipes import tiny_teacher  # noqa: E402
from recipes.reporting import card_writer, dry_run_report, plot_curves, results_table, write_results  # noqa: E402

PRESETS = {
    # The real job: Gemma 7B -> the Gemma-2B shape on an accelerator mesh.
    "7b": dict(teacher="google/gemma-7b", student="gemma-2b", steps=20_000, batch_size=8, seq_len=2048,
               learning_rate=1e-4, scratch_learning_rate=3e-4, precision="bf16", calibration_samples=1024,
               eval_batches=64),
    # Offline and CPU-sized: a small Gemma teacher with the 7B:2B shape ratios, trained here on the Python
    # standard library's source (byte tokens), cached after the first run (recipes/tiny_teacher.py).
    "tiny": dict(teacher=None, student="scaled", steps=240, batch_size=8, seq_len=128, learning_rate=2e-3,
                 scratch_learning_rate=3e-3, precision="fp32", calibration_samples=128, eval_batches=16),
}
PHASES = ("stage_a", "stage_b", "scratch")


class Interrupted(SystemExit):
    """--halt-after reached: the run stops like an interrupted job; rerun with --resume."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="7b")
    p.add_argument("--teacher", help="Hub repo id or local HF folder (default: the preset's)")
    p.add_argument("--revision", help="teacher revision on the Hub")
    p.add_argument("--data", help="text files: a file, folder or glob (.txt/.py/.jsonl); or hf:NAME for a dataset")
    p.add_argument("--output", required=True, help="run folder: student, plans, results, checkpoints")
    p.add_argument("--steps", type=int, help="total distillation optimizer steps over all stages")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--mesh", help="mesh axis sizes, e.g. fsdp=8,tp=1 (default: one device)")
    p.add_argument("--precision", choices=("bf16", "fp32"),
                   help="bf16: bf16 teacher and bf16 student compute with float32 master weights")
    p.add_argument("--compression", choices=("staged", "oneshot"), default="staged",
                   help="staged: depth+MLP first, distil, then hidden/heads/KV merge (default, >50%% cut)")
    p.add_argument("--stage-a-fraction", type=float, default=0.3, help="share of --steps spent after stage A")
    p.add_argument("--kv-warmup", type=float, default=0.1,
                   help="share of --steps training only merged K/V projections and norms after stage B")
    p.add_argument("--feature-weight", type=float, default=0.1, help="feature loss on mapped layers (0: off)")
    p.add_argument("--calibration-samples", type=int, help="sequences for importance scoring (Minitron: 1024)")
    p.add_argument("--from-disk", action="store_true",
                   help="do the surgery with prune_checkpoint (reads only the kept slices of the teacher files)")
    p.add_argument("--no-scratch", action="store_true", help="skip the from-scratch control student")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue an interrupted run in --output")
    p.add_argument("--overwrite", action="store_true", help="start over, deleting an earlier run in --output")
    p.add_argument("--halt-after", metavar="PHASE:STEP",
                   help="stop after STEP of PHASE (stage_a, stage_b, scratch) as if interrupted")
    p.add_argument("--cache-dir", default=os.environ.get("NNX_SURGERY_CACHE",
                                                         os.path.expanduser("~/.cache/nnx-surgery")))
    p.add_argument("--corpus-bytes", type=int, default=3_000_000, help="tiny preset: bytes of stdlib source")
    p.add_argument("--teacher-steps", type=int, default=300, help="tiny preset: teacher training steps")
    p.add_argument("--push-to-hub", metavar="REPO_ID", help="publish the student (private unless --public)")
    p.add_argument("--public", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print shapes, parameters, memory and plan; no training")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def student_spec(args, teacher_config: surgery.GemmaConfig) -> surgery.StudentSpec:
    if args.student == "scaled":  # the 7B:2B ratios applied to whatever teacher we have
        return surgery.StudentSpec.scaled_like(teacher_config)
    return surgery.StudentSpec.named(args.student)


def stage_a_spec(teacher_config: surgery.GemmaConfig, final: surgery.StudentSpec) -> surgery.StudentSpec:
    """Depth and MLP width of the final student; hidden size and heads still the teacher's."""
    return surgery.StudentSpec(final.num_layers, teacher_config.hidden_size, final.intermediate_size,
                               teacher_config.num_attention_heads, teacher_config.num_key_value_heads)


def distill_config(args, phase: str, stages, plan, out: str) -> distill.DistillConfig:
    return distill.DistillConfig(
        stages=tuple(stages), batch_size=args.batch_size, seq_len=args.seq_len, plan=plan, mesh=args.mesh,
        compute_dtype="bfloat16" if args.precision == "bf16" else "float32",
        checkpoint=distill.CheckpointConfig(directory=os.path.join(out, "checkpoints", phase),
                                            every=args.checkpoint_every, resume=True),
        run_dir=os.path.join(out, "logs", phase), eval_every=max(1, args.steps // 4), eval_batches=4,
        halt_after=args.halt_steps.get(phase), seed=args.seed, plots=False)


def run_phase(args, phase, teacher, student, data, stages, plan, out):
    """Distil one phase, or reload it when an earlier run finished it. Returns (student, history)."""
    done = os.path.join(out, "phases", phase)
    if os.path.exists(os.path.join(done, "history.json")):
        print(f"[{phase}] finished in an earlier run: loading {done}")
        with open(os.path.join(done, "history.json")) as f:
            return surgery.load_pretrained(done, dtype="float32", mesh=mesh_of(args)), json.load(f)
    config = distill_config(args, phase, stages, plan, out)
    result = distill.run(teacher, student, data, config)
    if result.steps < config.total_steps:
        raise Interrupted(f"[{phase}] stopped after step {result.steps} as asked (--halt-after); "
                          "rerun with --resume to continue.")
    surgery.save_pretrained(result.student, done, source=args.teacher_folder,
                            extra_files={"history.json": result.history})
    return result.student, result.history


def mesh_of(args):
    if not args.mesh:
        return None
    if getattr(args, "_mesh", None) is None:
        args._mesh = distill.make_mesh(args.mesh)
    return args._mesh


def prepare_output(args) -> str:
    out = os.path.abspath(args.output)
    started = os.path.exists(os.path.join(out, "run_args.json"))
    if started and args.overwrite:
        shutil.rmtree(out)
    elif started and not args.resume and not args.dry_run:
        raise SystemExit(f"{out} holds an earlier run; pass --resume to continue it or --overwrite to start over.")
    os.makedirs(out, exist_ok=True)
    args.halt_steps = {}
    if args.halt_after:
        phase, _, step = args.halt_after.partition(":")
        if phase not in PHASES or not step.isdigit():
            raise SystemExit(f"--halt-after {args.halt_after!r}: use PHASE:STEP with PHASE in {PHASES}.")
        args.halt_steps[phase] = int(step)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = prepare_output(args)
    t_start = time.time()

    # 1. The teacher and the data. The tiny preset makes both offline (cached in --cache-dir).
    if args.preset == "tiny" and args.teacher is None:
        args.teacher, corpus = tiny_teacher.prepare(args)
        args.data_description = (f"{len(corpus)} files of the Python standard library's source, byte-level "
                                 "tokens (offline tiny preset)")
    else:
        corpus = None
        args.data_description = args.data or ""
    args.teacher_folder = surgery.checkpoint.resolve_source(args.teacher, args.revision)
    teacher_config = args.teacher_config = surgery.GemmaConfig.from_file(args.teacher_folder)
    spec = student_spec(args, teacher_config)
    if args.dry_run:
        print(dry_run_report(args, teacher_config, spec))
        return {}
    with open(os.path.join(out, "run_args.json"), "w") as f:
        json.dump({k: v for k, v in vars(args).items() if not k.startswith("_")}, f, indent=2, default=str)
    mesh = mesh_of(args)
    teacher_dtype = "bfloat16" if args.precision == "bf16" else "float32"
    teacher = surgery.load_pretrained(args.teacher_folder, dtype=teacher_dtype, mesh=mesh)
    data = tiny_teacher.batches(args, corpus) if corpus is not None else load_data(args)
    eval_batches = data.eval_batches()[: args.eval_batches]
    calibration = data.calibration_ids(args.calibration_samples, seed=args.seed)

    # 2. Surgery. Staged: depth + MLP (A), distil, then hidden + heads + KV merge (B). Plans are data (plan.json).
    if args.compression == "staged":
        plan_a = surgery.plan_student(teacher, stage_a_spec(teacher_config, spec), calibration=calibration,
                                      source=args.teacher, revision=args.revision, seed=args.seed)
        student = make_student(args, teacher, plan_a, out, "stage_a")
        print(surgery.format_report(plan_a))
        stages_a = [distill.Stage(steps=max(1, round(args.steps * args.stage_a_fraction)), name="A: depth+MLP",
                                  learning_rate=args.learning_rate, warmup_steps=args.steps // 50,
                                  weights=distill.LossWeights(kl=1.0, feature=args.feature_weight))]
        student, history_a = run_phase(args, "stage_a", teacher, student, data, stages_a, plan_a, out)
        steps_b = args.steps - stages_a[0].steps
    else:
        plan_a, history_a, student, steps_b = None, [], teacher, args.steps
    plan = surgery.plan_student(student, spec, calibration=calibration, seed=args.seed, measure_compensation=True,
                                source=f"stage-A student of {args.teacher}" if plan_a else args.teacher,
                                revision=None if plan_a else args.revision)
    # The pruned student before any distillation, for the results table: the same surgery on the raw teacher.
    pruned = surgery.apply_plan(surgery.apply_plan(teacher, plan_a), plan) if plan_a else \
        surgery.apply_plan(teacher, plan)
    student = make_student(args, student, plan, out, "stage_b")
    print(surgery.format_report(plan))
    lineage = composed_map(plan_a, plan)  # teacher layer -> student layer, teacher channels kept

    # 3. Distillation: K/V warm-up with the rest frozen, then everything.
    warmup = max(1, round(args.steps * args.kv_warmup)) if args.kv_warmup > 0 else 0
    stages_b = []
    if warmup:
        stages_b.append(distill.Stage(steps=warmup, name="B1: merged K/V + norms",
                                      trainable=["*.self_attn.k_proj", "*.self_attn.v_proj", "*norm*"],
                                      learning_rate=args.learning_rate, warmup_steps=max(1, warmup // 10),
                                      weights=distill.LossWeights(kl=1.0)))
    stages_b.append(distill.Stage(steps=max(1, steps_b - warmup), name="B2: everything",
                                  learning_rate=args.learning_rate, warmup_steps=args.steps // 50,
                                  weights=distill.LossWeights(kl=1.0, feature=args.feature_weight)))
    student, history_b = run_phase(args, "stage_b", teacher, student, data, stages_b, lineage, out)

    # 4. The control: the same shape from scratch, the same tokens, hard labels only.
    history_scratch, scratch = [], None
    if not args.no_scratch:
        scratch = surgery.create_model(pruned.config, seed=args.seed + 1, mesh=mesh)
        stages_s = [distill.Stage(steps=args.steps, name="scratch", learning_rate=args.scratch_learning_rate,
                                  warmup_steps=max(1, args.steps // 20), weights=distill.LossWeights(kl=0.0, ce=1.0))]
        scratch, history_scratch = run_phase(args, "scratch", None, scratch, data, stages_s, None, out)

    # 5. Evaluate on held-out data, save the student folder (HF + plan + results + card), publish.
    tokens = args.steps * args.batch_size * args.seq_len
    rows = [("teacher", teacher, 0), ("pruned (before distillation)", pruned, 0), ("distilled student", student, tokens)]
    if scratch is not None:
        rows.append(("scratch student (same shape)", scratch, tokens))
    results = {"rows": [], "wall_time_s": 0.0, "preset": args.preset, "compression": args.compression}
    for name, model, used in rows:
        scores = heldout_loss(model, eval_batches)
        results["rows"].append({"model": name, "parameters": model.config.num_parameters(), "tokens": used,
                                "loss": scores["loss"], "perplexity": scores["perplexity"],
                                "eval_tokens": scores["tokens"]})
    results["wall_time_s"] = round(time.time() - t_start, 1)
    results["final_losses"] = {k: round(v, 4) for k, v in (history_b[-1] if history_b else {}).items()
                               if k in ("loss", "kl", "feature", "student_ce") and isinstance(v, float)}
    table = results_table(results)
    print(table)
    final = os.path.join(out, "student")
    extra = {"results.json": results, "README.md": card_writer(args, plan, plan_a, results, tokens)}
    if plan_a is not None:
        extra["plan_stage_a.json"] = plan_a.to_dict()
    surgery.save_student(student, plan, final, source=args.teacher_folder, extra_files=extra)
    plot_curves(os.path.join(out, "training_curves.png"), history_a, history_b, history_scratch,
                args.batch_size * args.seq_len)
    surgery.plot_report(plan_a or plan, os.path.join(out, "layer_importance.png"))  # the depth cut
    if plan_a is not None:
        surgery.plot_report(plan, os.path.join(out, "width_importance_stage_b.png"))
    write_results(out, results, table)
    print(f"student: {final}  (results.md, training_curves.png, layer_importance.png in {out})")
    if args.push_to_hub:
        url = surgery.push_to_hub(final, args.push_to_hub, private=not args.public)
        print(f"pushed to {url}")
    return results


def make_student(args, source_model, plan, out, phase):
    """Apply `plan` in memory, or with --from-disk (when the source is the teacher itself) write the student with
    prune_checkpoint, which reads only the kept slices of the teacher's files, and load it."""
    if args.from_disk and source_model is not None and plan.teacher_config == args.teacher_config:
        folder = os.path.join(out, "surgery", phase)
        surgery.prune_checkpoint(args.teacher_folder, plan, folder)
        return surgery.load_pretrained(folder, dtype="float32", mesh=mesh_of(args))
    return surgery.apply_plan(source_model, plan)


def composed_map(plan_a, plan_b) -> dict:
    """Teacher -> final-student layer and channel correspondence through both stages (plans are data)."""
    if plan_a is None:
        return {"kept_layers": plan_b.kept_layers, "kept_hidden": plan_b.kept_hidden}
    return {"kept_layers": [plan_a.kept_layers[i] for i in plan_b.kept_layers],
            "kept_hidden": [plan_a.kept_hidden[i] for i in plan_b.kept_hidden]}


def load_data(args) -> distill.TokenBatches:
    if not args.data:
        raise SystemExit("--data is required with a real teacher (text files, a folder, a glob, or hf:NAME).")
    common = dict(batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                  eval_batch_size=args.batch_size)
    if args.data.startswith("hf:"):
        return distill.TokenBatches.from_hf_dataset(args.data[3:], args.teacher_folder, **common)
    return distill.TokenBatches.from_files(args.data, args.teacher_folder, **common)


if __name__ == "__main__":
    try:
        main()
    except Interrupted as stop:
        print(stop.code if isinstance(stop.code, str) else "interrupted", file=sys.stderr)
        sys.exit(3)

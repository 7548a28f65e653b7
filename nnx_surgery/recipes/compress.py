#!/usr/bin/env python
"""Compress a causal LM (Gemma 1/2/3, Llama, Mistral, Qwen2): load, plan, prune, distil, evaluate, save, push.
The flagship is Gemma 7B -> the 2B shape.

    python recipes/gemma_7b_to_2b.py --preset gemma3-270m --output runs/gemma3-270m   # the real Gemma 3 270M, offline
    python recipes/gemma_7b_to_2b.py --teacher google/gemma-7b --data 'corpus/*.txt' --output runs/7b-to-2b
    python recipes/gemma_7b_to_2b.py --teacher FOLDER_OR.gguf --student layers=12,mlp=0.5 --data ... --output ...
    python recipes/gemma_7b_to_2b.py --teacher LLAMA_OR_QWEN2_FOLDER --student layers=0.5,mlp=0.5 --data ... --output ...
    python recipes/gemma_7b_to_2b.py --preset tiny --output runs/tiny      # a self-trained toy teacher (tests)
    python recipes/gemma_7b_to_2b.py --config recipes/configs/progressive.json --output runs/progressive
    python recipes/gemma_7b_to_2b.py --config runs/tiny/resolved_config.json --output runs/again   # repeat a run

Every knob is a flag or a setting of a --config file (JSON/YAML), flags winning; --print-config shows the
resolved settings, and every run saves them in its folder (resolved_config.json). `--help` lists each knob with
its default and why.

Read it top to bottom: it is the documented example of the Python API (`surgery` then `distill`).

Why the defaults:
* 7B -> 2B (28 -> 18 layers, hidden 3072 -> 2048, MLP 24576 -> 16384, 16 -> 8 query heads, 16 -> 1 KV heads)
  removes ~70% of the parameters, past the ~50% where one-shot pruning recovers poorly (ModelOpt's guidance), so
  compression is staged (`--compression staged`): stage A cuts depth and MLP width, a short distillation
  recovers, then stage B cuts hidden size and query heads and merges the KV heads.
* 16 KV heads -> 1 cannot be done by picking heads: they are mean-merged (GQA paper). Right after the merge only
  the merged K/V projections and the norms train (`--kv-warmup`), everything else frozen, so the new projections
  adapt before they disturb the rest; then everything trains.
* Importance is Minitron's: activation-based on calibration samples (MLP neurons, heads, hidden channels) and
  block influence (1 - cos) for depth. Embeddings are rescaled for the smaller sqrt(hidden) (plan docs).
* Loss: `--alpha` mixes forward KL (alpha) with hard-label cross-entropy (1 - alpha) at `--temperature`, plus a
  feature loss on mapped layers (teacher layer kept_layers[i] -> student layer i) when depth is cut
  (`--feature-weight`), optionally with a cosine loss on the same layers (`--cosine-weight`). The gemma3-270m
  preset's values are the ones measured best at its budget (BENCHMARKS.md).
* Packed rows that continue a document start with BOS (`--restart-rows`): Gemma without BOS at position 0 is
  far worse (BENCHMARKS.md), teacher included, so those rows taught from its worst predictions.
* Judged on two held-out sets (`--eval-tokens` each): the corpus's held-out documents and English prose that no
  training corpus contains, with 95% intervals; `--general-mix` trains on general prose too, and
  `--teacher-correction` first fine-tunes the teacher on the corpus (Minitron).
* `--student ...,vocab=N` also trims the vocabulary (the embedding is most of a small Gemma): the final plan keeps
  N pieces, the student trains on the corpus in its own tokens, and is judged per byte (nnx_surgery/recipes/vocabulary.py).
* `--student params=0.5` (or params=120M) first searches the shapes within that parameter budget, Minitron's way,
  and distils the winner (nnx_surgery/recipes/shape_search.py).
* The control (`--control`): `pruned-ce` retrains the same pruned student with plain cross-entropy on the same
  tokens (Minitron's baseline: what distillation must beat); `scratch` trains the student's shape from random
  initialisation.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import time


import jax

from nnx_surgery import distill
from nnx_surgery import surgery
from nnx_surgery.recipes import cli, evaluation, phases, settings, shape_search, tiny_teacher, vocabulary
from nnx_surgery.recipes.reporting import card_writer, dry_run_report, plot_curves, results_table, write_results

PHASES = ("teacher_correction", "stage_a", "stage_b", "control")
ORIGINAL_TEACHER = "teacher before correction"
CONTROL_NAMES = {"scratch": "scratch student (same shape)", "pruned-ce": "CE-retrained pruned student (control)"}


class Interrupted(SystemExit):
    """--halt-after reached: the run stops like an interrupted job; rerun with --resume."""


def parse_args(argv=None, prog: str = "gemma_7b_to_2b.py") -> argparse.Namespace:
    """The resolved settings (nnx_surgery/recipes/settings.py): defaults < preset < schedule < --config < flags < --set."""
    return settings.resolve(argv, description=__doc__, prog=prog)


def stage_a_spec(teacher_config: surgery.ModelConfig, final: surgery.StudentSpec) -> surgery.StudentSpec:
    """Depth and MLP width of the final student; hidden size and heads still the teacher's."""
    return surgery.StudentSpec(final.num_layers, teacher_config.hidden_size, final.intermediate_size,
                               teacher_config.num_attention_heads, teacher_config.num_key_value_heads)


def run_phase(args, phase, teacher, student, data, config, out, dtype="float32"):
    """Distil one phase, or reload it when an earlier run finished it. Returns (student, history, evals); the
    student comes back in `dtype` when it was reloaded."""
    done = os.path.join(out, "phases", phase)
    if os.path.exists(os.path.join(done, "history.json")):
        print(f"[{phase}] finished in an earlier run: loading {done}")
        with open(os.path.join(done, "history.json")) as f:
            logged = json.load(f)
        history, evals = (logged["train"], logged["eval"]) if isinstance(logged, dict) else (logged, [])
        if isinstance(logged, dict) and logged.get("data_state") is not None:
            data.restore(logged["data_state"])  # the next phase continues where this one stopped
        return surgery.load_pretrained(done, dtype=dtype, mesh=mesh_of(args)), history, evals
    # on-policy distillation samples the student's continuations with generate's jitted KV-cache loop
    sampler = surgery.make_sampler() if teacher is not None and config.on_policy.fraction else None
    result = distill.run(teacher, student, data, config, sampler=sampler)
    if result.steps < config.total_steps:
        raise Interrupted(f"[{phase}] stopped after step {result.steps} as asked (--halt-after); "
                          "rerun with --resume to continue.")
    history, evals = result.full_history, result.full_evals  # across resumes
    surgery.save_pretrained(result.student, done, source=vocabulary.phase_source(args, phase), overwrite=True,
                            extra_files={"history.json": {"train": history, "eval": evals,
                                                          "data_state": result.data_state}})
    return result.student, history, evals


def mesh_of(args):
    if not args.mesh:
        return None
    if getattr(args, "_mesh", None) is None:
        args._mesh = distill.make_mesh(args.mesh, devices=args.mesh_devices)
    return args._mesh


def prepare_output(args) -> str:
    out, started = cli.output_folder(args.output, resume=args.resume, overwrite=args.overwrite,
                                     dry_run=args.dry_run)
    args.halt_steps = {}
    if args.halt_after:
        phase, _, step = args.halt_after.partition(":")
        if phase not in PHASES or not step.isdigit():
            raise cli.RecipeError(f"--halt-after {args.halt_after!r}: use PHASE:STEP with PHASE in {PHASES}.")
        args.halt_steps[phase] = int(step)
    if jax.process_index() == 0:  # multi-host: the run folder is shared storage, process 0 prepares it
        if args.overwrite and os.path.isdir(out) and os.listdir(out) and not args.dry_run:
            shutil.rmtree(out)
        os.makedirs(out, exist_ok=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(f"prepare_output {out}")
    return out


def main(argv=None, prog: str = "gemma_7b_to_2b.py") -> dict:
    cli.start_distributed(sys.argv[1:] if argv is None else argv)  # multi-host: before anything touches devices
    args = parse_args(argv, prog)
    if args.print_config:
        print(json.dumps(args.resolved, indent=2))
        return {}
    if not args.output:
        raise cli.RecipeError("--output is required: the run folder (student, plans, results, checkpoints).")
    if jax.process_count() > 1 and not args.mesh:
        raise cli.RecipeError(f"a multi-host run ({jax.process_count()} processes) needs --mesh over all "
                              f"{jax.device_count()} devices, e.g. --mesh fsdp={jax.device_count()}.")
    out = prepare_output(args)
    t_start = time.time()

    # 1. The teacher and the data. The tiny preset makes both offline (cached in --cache-dir); the gemma3-270m
    #    preset imports the real GGUF once (cached) and reads the standard library's source.
    corpus = None
    if args.preset == "tiny" and args.teacher is None:
        args.teacher, corpus = tiny_teacher.prepare(args)
        args.data_description = (f"{len(corpus)} files of the Python standard library's source, byte-level "
                                 "tokens (offline tiny preset)")
    elif args.data is None and args.preset == "gemma3-270m":
        corpus = tiny_teacher.corpus_files(args)
        args.data_description = f"{len(corpus)} modules of the Python standard library's source (held-out modules)"
    else:
        args.data_description = args.data or ""
    args.teacher_folder = cli.teacher_folder(args.teacher, args.revision)
    teacher_config = args.teacher_config = surgery.ModelConfig.from_file(args.teacher_folder)
    choice = shape_search.student_choice(args, teacher_config)  # a shape, or params=: the shapes to search
    spec = choice.spec
    if args.gguf:  # before hours of training: only Gemma students export (surgery.export_gguf says why)
        surgery.gguf_export.check_exportable(teacher_config, args.teacher_folder)
    if args.dry_run:
        print(dry_run_report(args, teacher_config, spec, search=choice if choice.budget else None))
        return {}
    settings.save_resolved(args, out)  # `--config OUT/resolved_config.json` repeats this run
    if jax.process_index() == 0:
        with open(os.path.join(out, "run_args.json"), "w") as f:
            json.dump({k: v for k, v in vars(args).items() if not k.startswith("_") and k != "resolved"}, f,
                      indent=2, default=str)
    mesh = mesh_of(args)
    teacher_dtype = "bfloat16" if args.precision == "bf16" else "float32"
    teacher = surgery.load_pretrained(args.teacher_folder, dtype=teacher_dtype, mesh=mesh)
    distill.data.check_vocabulary(args.teacher_folder, teacher_config.vocab_size)
    data = load_data(args, corpus)
    clock = PhaseClock(t_start)
    clock.lap("teacher and data")
    if args.teacher_correction:  # Minitron: the teacher first adapts to the corpus it will teach on
        teacher = correct_teacher(args, teacher, data, out, teacher_dtype)
        clock.lap("teacher correction")
    calibration = data.calibration_ids(args.calibration_samples, seed=args.seed)
    # 1b. With --student params=...: each shape within the budget distilled briefly; the winner is the student.
    spec, searched = shape_search.choose_student(args, choice, teacher, data, calibration, out)
    if searched:
        clock.lap("shape search")

    # 2. Surgery. Staged: depth + MLP (A), distil, then hidden + heads + KV merge (B). Plans are data (plan.json).
    if args.compression == "staged":
        plan_a = surgery.plan_student(teacher, stage_a_spec(teacher_config, spec), calibration=calibration,
                                      source=args.teacher, revision=args.revision, seed=args.seed)
        student = make_student(args, teacher, plan_a, out, "stage_a")
        print(surgery.format_report(plan_a))
        config_a = phases.phase_config(args, "stage_a", [phases.stage_a(args)], plan_a, out, data)
        student, history_a, _ = run_phase(args, "stage_a", teacher, student, data, config_a, out)
        steps_a = config_a.total_steps
        clock.lap("stage A")
    else:
        plan_a, history_a, student, steps_a = None, [], teacher, 0
    steps_b = args.steps - steps_a
    # A trimmed vocabulary keeps the pieces the training corpus uses most, counted over every training row (a few
    # calibration rows see too few of the pieces the student will meet).
    vocab_rows = data.calibration_ids(data.num_rows, seed=args.seed) if spec.vocab_size is not None else None
    plan = surgery.plan_student(student, spec, calibration=calibration, vocab_calibration=vocab_rows,
                                seed=args.seed, measure_compensation=True,
                                source=f"stage-A student of {args.teacher}" if plan_a else args.teacher,
                                revision=None if plan_a else args.revision, tokenizer=args.teacher_folder)
    data = vocabulary.student_batches(args, plan, out, data, lambda folder: load_data(args, corpus, folder))
    pruned = pruned_student(teacher, plan_a, plan)
    student = make_student(args, student, plan, out, "stage_b")
    print(surgery.format_report(plan))
    clock.lap("surgery")
    lineage = composed_map(plan_a, plan)  # teacher layer -> student layer, teacher channels kept

    # 3. Distillation: after a KV merge, a K/V warm-up with the rest frozen; then the main stages (one stage from
    #    the loss flags, --schedule, or the config file's stages).
    merged = str(plan.methods.get("kv", "")).startswith("merge") and teacher_config.num_key_value_heads != spec.num_key_value_heads
    warmup = max(1, round(args.steps * args.kv_warmup)) if args.kv_warmup > 0 and merged else 0
    stages_b = ([phases.kv_warmup(args, warmup)] if warmup else []) + \
        phases.main_stages(args, spec.num_layers, max(1, steps_b - warmup))
    config_b = phases.phase_config(args, "stage_b", stages_b, lineage, out, data)
    student, history_b, evals_b = run_phase(args, "stage_b", teacher, student, data, config_b, out)
    distilled_steps = steps_a + config_b.total_steps
    clock.lap("distillation")

    # 4. The control at equal tokens: the same pruned student retrained with plain CE, or the shape from scratch.
    history_control, evals_control, control = [], [], None
    if args.control != "none":
        control = (pruned_student(teacher, plan_a, plan) if args.control == "pruned-ce"
                   else surgery.create_model(pruned.config, seed=args.seed + 1, mesh=mesh))
        config_c = phases.phase_config(args, "control", [phases.control_stage(args, distilled_steps)], None, out)
        control, history_control, evals_control = run_phase(args, "control", None, control, data, config_c, out)
        clock.lap("control")

    # 5. Evaluate on held-out data, save the student folder (HF + plan + results + card), publish.
    tokens = distilled_steps * args.tokens_per_step
    rows = [("teacher", teacher, 0)]
    if args.teacher_correction:  # the teacher as it was, beside the corrected one that taught
        original = surgery.load_pretrained(args.teacher_folder, dtype=teacher_dtype, mesh=mesh)
        rows.append((ORIGINAL_TEACHER, original, 0))
    rows += [("pruned (before distillation)", pruned, 0), ("distilled student", student, tokens)]
    pairs = [("distilled student", "teacher")]
    if control is not None:
        rows.append((CONTROL_NAMES[args.control], control, tokens))
        pairs = [("distilled student", CONTROL_NAMES[args.control])] + pairs + [(CONTROL_NAMES[args.control],
                                                                                 "teacher")]
    print(f"[eval] {len(rows)} models on the held-out sets ({args.eval_tokens:,} tokens each), then generations "
          "and multiple choice", flush=True)
    results = evaluation.evaluate(args, rows, data, out, pairs=pairs,
                                  vocabularies=vocabulary.vocabularies(args, rows, plan))
    clock.lap("evaluation")
    results.update(wall_time_s=round(time.time() - t_start, 1), preset=args.preset, compression=args.compression,
                   control=args.control, phase_times_s=clock.laps, teacher_correction=args.teacher_correction)
    results.update({"search": searched} if searched else {})
    results["final_losses"] = {k: round(v, 4) for k, v in (history_b[-1] if history_b else {}).items()
                               if k in ("loss", "kl", "feature", "student_ce") and isinstance(v, float)}
    results["step_stats"] = {"distilled": evaluation.step_stats(history_b),
                             "control": evaluation.step_stats(history_control)}
    results["recovery_curves"] = {"distilled": evaluation.curve(evals_b, args),
                                  "control": evaluation.curve(evals_control, args)}
    table = results_table(results) + evaluation.sample_section(results)
    print(table)
    final = os.path.join(out, "student")
    extra = {"results.json": results, "README.md": card_writer(args, plan, plan_a, results, tokens)}
    if plan_a is not None:
        extra["plan_stage_a.json"] = plan_a.to_dict()
    surgery.save_student(student, plan, final, source=args.teacher_folder, extra_files=extra, overwrite=True)
    if jax.process_index() == 0:  # multi-host: process 0 writes the reports
        plot_curves(os.path.join(out, "training_curves.png"), history_a, history_b, history_control,
                    args.tokens_per_step, control_name=CONTROL_NAMES.get(args.control, ""),
                    recovery=results["recovery_curves"],  # a trimmed student's CE is in other tokens
                    teacher_loss=None if plan.kept_vocab else results["rows"][0]["loss"])
        surgery.plot_report(plan_a or plan, os.path.join(out, "layer_importance.png"))  # the depth cut
        if plan_a is not None:
            surgery.plot_report(plan, os.path.join(out, "width_importance_stage_b.png"))
        write_results(out, results, table)
    print(f"student: {final}  (results.md, training_curves.png, layer_importance.png in {out})")
    if args.gguf and jax.process_index() == 0:
        export_gguf(args, final, out)
    if args.push_to_hub:
        url = surgery.push_to_hub(final, args.push_to_hub, private=not args.public)
        print(f"pushed to {url}")
    return results


def export_gguf(args, folder: str, out: str) -> str:
    """The student as one GGUF file beside its folder, for llama.cpp (`--gguf DTYPE`)."""
    started = time.perf_counter()
    path = surgery.export_gguf(folder, os.path.join(out, f"student-{args.gguf}.gguf"), dtype=args.gguf)
    print(f"gguf: {path}  ({os.path.getsize(path) / 2**20:.0f} MiB, {args.gguf}, "
          f"{time.perf_counter() - started:.0f} s; run it with llama.cpp, README 'Run a student with llama.cpp')")
    return path


class PhaseClock:
    """Wall time of each phase of the run, in order (for the results table)."""

    def __init__(self, start: float):
        self.laps: dict[str, float] = {}
        self._last = start

    def lap(self, name: str) -> None:
        now = time.time()
        self.laps[name] = round(now - self._last, 1)
        self._last = now


def correct_teacher(args, teacher, data, out, dtype):
    """Teacher correction (Minitron): the teacher fine-tuned with plain CE on the distillation corpus for
    --teacher-correction steps before it is pruned and teaches. It trains on its own copy of the batches, so the
    student's batches are those of a run without correction; it is saved in phases/teacher_correction (a
    resumed run reloads it)."""
    print(f"[teacher correction] {args.teacher_correction} steps of plain CE on the corpus, learning rate "
          f"{args.teacher_correction_lr:g}", flush=True)
    trainee = teacher if dtype == "float32" else surgery.load_pretrained(args.teacher_folder, dtype="float32",
                                                                         mesh=mesh_of(args))
    config = phases.phase_config(args, "teacher_correction", [phases.teacher_correction_stage(args)], None, out)
    corrected, _, _ = run_phase(args, "teacher_correction", None, trainee, copy.deepcopy(data), config, out,
                                dtype=dtype)
    if dtype != "float32":  # trained in float32, teaches in the run's precision
        corrected = surgery.load_pretrained(os.path.join(out, "phases", "teacher_correction"), dtype=dtype,
                                            mesh=mesh_of(args))
    return corrected


def pruned_student(teacher, plan_a, plan):
    """The student before any distillation: the same surgery on the raw teacher. With staged compression the
    stage-B plan was made on the distilled stage-A student, so it is applied to the undistilled stage-A cut on
    purpose (same shapes, other weights: the plan's weight fingerprint is not checked)."""
    if plan_a is None:
        return surgery.apply_plan(teacher, plan)
    return surgery.apply_plan(surgery.apply_plan(teacher, plan_a), plan, check_weights=False)


def make_student(args, source_model, plan, out, phase):
    """Apply `plan` in memory, or with --from-disk (when the source is the teacher itself) write the student with
    prune_checkpoint, which reads only the kept slices of the teacher's files, and load it."""
    if args.from_disk and source_model is not None and plan.teacher_config == args.teacher_config:
        folder = os.path.join(out, "surgery", phase)
        surgery.prune_checkpoint(args.teacher_folder, plan, folder, overwrite=True)
        return surgery.load_pretrained(folder, dtype="float32", mesh=mesh_of(args))
    return surgery.apply_plan(source_model, plan)


def composed_map(plan_a, plan_b) -> dict:
    """Teacher -> final-student layer and channel correspondence through both stages (plans are data), and the
    kept pieces of a trimmed vocabulary (stage A keeps every piece, so the final plan's ids are the teacher's)."""
    if plan_a is None:
        return {"kept_layers": plan_b.kept_layers, "kept_hidden": plan_b.kept_hidden,
                "kept_vocab": plan_b.kept_vocab}
    return {"kept_layers": [plan_a.kept_layers[i] for i in plan_b.kept_layers],
            "kept_hidden": [plan_a.kept_hidden[i] for i in plan_b.kept_hidden], "kept_vocab": plan_b.kept_vocab}


def load_data(args, corpus: list[str] | None = None, tokenizer: str | None = None) -> distill.TokenBatches:
    """The run's batches: the preset's corpus files when it has one, else --data, in the tokens of `tokenizer` (a
    folder; default: the teacher's). On multi-host each process tokenises its share and keeps its rows of every
    batch."""
    tokenizer = tokenizer or args.teacher_folder
    if corpus is None and not args.data:
        raise cli.RecipeError("--data is required with this teacher (text files, a folder, a glob, or hf:NAME).")
    common = dict(batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                  eval_batch_size=args.batch_size, process_index=jax.process_index(),
                  process_count=jax.process_count(), **cli.position_limit(args.teacher_folder))
    text_tokenizer = distill.load_tokenizer(tokenizer)
    if args.restart_rows and text_tokenizer.add_bos:  # a row continuing a document starts with BOS, as documents do
        common["restart_id"] = text_tokenizer.bos_id
    if args.general_mix:  # general prose beside the domain corpus: training only, never held out
        if corpus is None and args.data.startswith("hf:"):
            raise cli.RecipeError("--general-mix needs text files (--data FILES or a preset's corpus), not hf:; "
                                  "mix general text into the dataset itself instead.")
        files = corpus if corpus is not None else distill.sources.expand_paths(args.data)
        common["extra_train"] = distill.general_mix(sum(os.path.getsize(f) for f in files), args.general_mix)
    if corpus is not None:
        return distill.TokenBatches.from_files(corpus, tokenizer, **common)
    if args.data.startswith("hf:"):
        return distill.TokenBatches.from_hf_dataset(args.data[3:], tokenizer, **common)
    return distill.TokenBatches.from_files(args.data, tokenizer, **common)


def entry(argv=None, prog: str = "gemma_7b_to_2b.py") -> None:
    """The recipe as a command (`prog` names it in --help): one-line errors, exit 3 when --halt-after stops it."""
    try:
        cli.guarded(lambda args: main(args, prog), argv)
    except Interrupted as stop:
        print(stop.code if isinstance(stop.code, str) else "interrupted", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    entry()

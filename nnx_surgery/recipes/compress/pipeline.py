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

Every setting is declared once, in `RecipeConfig` (nnx_surgery/recipes/config/sections.py, which reads as the
defaults file): a flag, a key of a --config file (JSON/YAML, in sections), or a dotted --set; flags win over the
file. --print-config shows the resolved settings, every run saves them in its folder (resolved_config.json), and
`--help` lists each, by section, with its default and why.

`compress` reads as the list of phases: the configuration resolved once (compress/resolution.py, by
recipes/compress_command.py, which sends --aot TARGET to recipes/aot/ before any run starts), what follows from it
and the teacher (run_settings.py), then each phase (run_phases.py, the documented example of the Python API:
`surgery` then `distill`) taking them and the earlier phases' outputs.

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
  N pieces, the student trains on the corpus in its own tokens, and is judged per byte (nnx_surgery/recipes/compress/vocabulary.py).
* `--student params=0.5` (or params=120M) first searches the shapes within that parameter budget, Minitron's way,
  and distils the winner (nnx_surgery/recipes/compress/shape_search.py).
* The control (`--control`): `pruned-ce` retrains the same pruned student with plain cross-entropy on the same
  batches in the same order (Minitron's baseline: what distillation must beat); `scratch` trains the student's
  shape from random initialisation on them. The pairing is checked and reported (run_phases.pairing).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from typing import Any, Iterator

import jax

from nnx_surgery import export, surgery
from nnx_surgery.surgery.storage.atomic import missing_folders, write_json
from nnx_surgery.recipes.compress import compile_cache, run_phases, run_settings, teacher_caching, vocabulary
from nnx_surgery.evaluation import final_eval
from nnx_surgery import refusals
from nnx_surgery.recipes.compress import files
from nnx_surgery.recipes.config import layering
from nnx_surgery.recipes.config.sections import PACKAGED_SOURCES, SECTIONS, RecipeConfig
from nnx_surgery.recipes.compress.reporting import (card_writer, dry_run_report, plot_curves, results_table,
                                                    write_results)
from nnx_surgery.distill.inputs import packaged_prose
from nnx_surgery.recipes.compress.phase_clock import PhaseClock

ORIGINAL_TEACHER = "teacher before correction"


def compress(config: RecipeConfig) -> dict:
    """The run, its settings resolved once (compress_command.py: the configuration; run_settings.py: what follows
    from it and the teacher), then the phases in order (run_phases.py), each taking the settings and the outputs of
    the phases before it."""
    clock = PhaseClock(time.time())
    run = run_settings.for_config(config)  # the output folder, the teacher, the student, the stages
    if config.run.dry_run:  # nothing written
        print(dry_run_report(run))
        return {}
    files.check_resumable(run.config, run.folder)  # --resume with other settings: refused before any read
    created = missing_folders(run.folder)
    prepare_output(run)
    clock.keep_in(run.folder)  # a resumed run adds this command's phases to the earlier ones'
    with removed_on_failure(created):
        try:
            return run_all(run, clock)
        finally:
            clock.stop()


def run_all(run: run_settings.RunSettings, clock: PhaseClock) -> dict:
    """The phases, once the run folder is prepared."""
    config = run.config
    loaded = run_phases.load_teacher_and_data(run)
    compile_cache.enable(run.folder)  # on an accelerator (after the data is known good): a resume reuses compiles
    record_settings(run)  # `--config OUT/resolved_config.json` repeats this run (after the data is known good)
    clock.lap("teacher and data")
    teacher = loaded.teacher
    if config.teacher.correction:  # Minitron: the teacher first adapts to the corpus it will teach on
        teacher = run_phases.correct_teacher(run, loaded)
        clock.lap("teacher correction")
    chosen = run_phases.choose_student(run, loaded, teacher)  # --student params=: the search's winner
    run = chosen.run
    if chosen.search:
        clock.lap("shape search")
    first = run_phases.stage_a(run, loaded, teacher, chosen.teacher_scores)  # staged: depth + MLP cut, distilled
    if first.plan is not None:
        clock.lap("stage A")
    cut = run_phases.final_cut(run, loaded, teacher, first, chosen.teacher_scores)  # plans are data (plan.json)
    clock.lap("surgery")
    ahead = compile_cache.control_ahead(run, cut, first)  # on an accelerator: compiles while the distillation trains
    distilled = run_phases.distil(run, loaded, teacher, first, cut)
    clock.lap("distillation")
    reads = run_phases.corpus_reads(run, loaded, first, cut, distilled)  # how often each source was read
    control = run_phases.train_control(run, loaded, teacher, first, cut, distilled, ahead)  # same batches, steps
    if control is not None:
        clock.lap("control")
    results = evaluate_or_read(run, loaded, teacher, cut, distilled, control)
    clock.lap("evaluation")
    results = results_record(run, results, clock, chosen.search, distilled, control)
    results["pairing"] = run_phases.pairing(run, first, cut, distilled, control)
    results["corpus_reads"] = reads
    results["mlp_refit"] = {phase: refit.report.to_dict() for phase, refit in (("stage_a", first.refit),
                                                                               ("final", cut.refit)) if refit}
    final = write_student(run, results, first, cut, distilled, control)
    publish(run, final)
    return results


@contextlib.contextmanager
def removed_on_failure(created: list[str]) -> Iterator[None]:
    """The run folders this run made (`created`, deepest first) are removed when it fails with nothing to resume:
    refused data or teacher leave them empty, and a full disk before the first checkpoint leaves only what the
    same command, run again once space is freed, would refuse. A run stopped (Ctrl-C, --halt-after) or failing
    otherwise keeps its folder for --resume."""
    try:
        yield
    except BaseException as error:
        if jax.process_index() == 0 and created:
            if refusals.full_disk(error) and not _checkpointed(created[0]):
                shutil.rmtree(created[-1], ignore_errors=True)
            for folder in created:  # deepest first; only those still empty
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
        raise


def _checkpointed(folder: str) -> bool:
    """A complete checkpoint (a step's folder) is in the run folder's checkpoints/."""
    return any(name.isdigit() for _, folders, _ in os.walk(os.path.join(folder, "checkpoints")) for name in folders)


def prepare_output(run: run_settings.RunSettings) -> None:
    """The run folder emptied with --overwrite and made (multi-host: process 0 prepares the shared folder)."""
    out = run.folder
    if jax.process_index() == 0:
        if run.config.run.overwrite and os.path.isdir(out) and os.listdir(out):
            shutil.rmtree(out)
        os.makedirs(out, exist_ok=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(f"prepare_output {out}")


def record_settings(run: run_settings.RunSettings) -> None:
    """resolved_config.json (refusing --resume with other settings) and run_args.json: every flag and what the
    run found (the teacher's folder and config, the data)."""
    files.save_resolved(run.config, run.folder)
    if jax.process_index() == 0:
        record: dict[str, Any] = {name: files.section_values(getattr(run.config, name)) for name in SECTIONS}
        record.update(teacher=run.teacher.source, data_description=run.data.description,
                      teacher_folder=run.teacher.folder, teacher_config=run.teacher.config,
                      halt_steps=layering.thaw(run.output.halt_steps))
        with open(os.path.join(run.folder, "run_args.json"), "w") as f:
            json.dump(record, f, indent=2, default=str)


def evaluate_or_read(run: run_settings.RunSettings, loaded, teacher, cut, distilled, control) -> dict:
    """Every model on the held-out sets, then generations and multiple choice (final_eval.py); kept in
    OUT/phases/evaluation.json, so a resumed run whose models are all finished (say to add --push-to-hub, or
    killed while writing the student) reads the scores back instead of spending the evaluation again."""
    done = os.path.join(run.folder, "phases", "evaluation.json")
    if os.path.exists(done):
        print(f"[eval] finished in an earlier run: {done}", flush=True)
        with open(done) as f:
            return json.load(f)
    results = evaluate_models(run, loaded, teacher, cut, distilled, control)
    if jax.process_index() == 0:
        os.makedirs(os.path.dirname(done), exist_ok=True)
        write_json(done, results)
    return results


def evaluate_models(run: run_settings.RunSettings, loaded, teacher, cut, distilled, control) -> dict:
    tokens = distilled.steps * run.config.tokens_per_step
    rows = [("teacher", teacher, 0)]
    if run.config.teacher.correction:  # the teacher as it was, beside the corrected one that taught
        original = surgery.load_pretrained(run.teacher.folder, dtype=run.teacher.dtype, mesh=loaded.mesh)
        rows.append((ORIGINAL_TEACHER, original, 0))
    rows += [("pruned (before distillation)", cut.pruned, 0), ("distilled student", distilled.model, tokens)]
    pairs = [("distilled student", "teacher")]
    if control is not None:
        name = run.config.control_name or "control"
        rows.append((name, control.model, tokens))
        pairs = [("distilled student", name)] + pairs + [(name, "teacher")]
    print(f"[eval] {len(rows)} models on the held-out sets ({run.config.evaluation.tokens:,} tokens each), then "
          "generations and multiple choice", flush=True)
    vocabularies = vocabulary.vocabularies(rows, cut.plan, cut.tokenizer, run.teacher.config.vocab_size)
    return final_eval.evaluate_rows(run.evaluation, rows, cut.data, run.folder, pairs=pairs, vocabularies=vocabularies)


def results_record(run: run_settings.RunSettings, results: dict, clock: PhaseClock, search: dict | None, distilled,
                   control) -> dict:
    """results.json: the evaluation, the run's wall times (over every command of a resumed run) and settings, the
    search, the final losses, step speed and the recovery curves."""
    config, history = run.config, distilled.history
    times = clock.totals()
    results = dict(results, wall_time_s=times["wall_s"], preset=config.run.preset,
                   compression=config.surgery.compression, control=config.student.control,
                   phase_times_s=times["phases"], commands=times["commands"], unfinished_s=times["unfinished_s"],
                   teacher_correction=config.teacher.correction)
    results.update({"search": search} if search else {})
    if config.data.general_mix and config.data.general_source in PACKAGED_SOURCES:  # which packages, what licence
        results["general_prose"] = packaged_prose.describe_packages()
    results["teacher_cache"] = teacher_caching.read_uses(run.folder)  # the phases that trained from a cache
    results["final_losses"] = {k: round(v, 4) for k, v in (history[-1] if history else {}).items()
                               if k in ("loss", "kl", "feature", "student_ce") and isinstance(v, float)}
    control = control or run_phases.Trained(None, [], [], 0)
    results["step_stats"] = {"distilled": final_eval.step_stats(history),
                             "control": final_eval.step_stats(control.history)}
    results["recovery_curves"] = {"distilled": final_eval.curve(distilled.evals, config.tokens_per_step),
                                  "control": final_eval.curve(control.evals, config.tokens_per_step)}
    return results


def write_student(run: run_settings.RunSettings, results: dict, first, cut, distilled, control) -> str:
    """The results table printed; the student folder (HF + plan + results + card); results.md, the curves and
    the importance plots in the run folder. Returns the student folder."""
    out, config, plan = run.folder, run.config, cut.plan
    table = results_table(results) + final_eval.sample_section(results)
    print(table)
    final = os.path.join(out, "student")
    tokens = distilled.steps * config.tokens_per_step
    extra = {"results.json": results, "README.md": card_writer(run, plan, first.plan, results, tokens)}
    if first.plan is not None:
        extra["plan_stage_a.json"] = first.plan.to_dict()
    surgery.save_student(distilled.model, plan, final, source=run.teacher.folder, extra_files=extra, overwrite=True)
    if jax.process_index() == 0:  # multi-host: process 0 writes the reports
        plot_curves(os.path.join(out, "training_curves.png"), first.history, distilled.history,
                    control.history if control else [], config.tokens_per_step,
                    control_name=config.control_name or "", recovery=results["recovery_curves"],
                    teacher_loss=None if plan.kept_vocab else results["rows"][0]["loss"])  # trimmed: other tokens
        surgery.plot_report(first.plan or plan, os.path.join(out, "layer_importance.png"))  # the depth cut
        if first.plan is not None:
            surgery.plot_report(plan, os.path.join(out, "width_importance_stage_b.png"))
        write_results(out, results, table)
    print(f"student: {final}  (results.md, training_curves.png, layer_importance.png in {out})")
    return final


def publish(run: run_settings.RunSettings, final: str) -> None:
    """--gguf: the student as one GGUF file beside its folder, for llama.cpp; --push-to-hub: the folder uploaded."""
    config = run.config
    if config.run.gguf and jax.process_index() == 0:
        started = time.perf_counter()
        name = f"student-{config.run.gguf}.gguf"
        path = export.export_gguf(final, os.path.join(run.folder, name), dtype=config.run.gguf)
        print(f"gguf: {path}  ({os.path.getsize(path) / 2**20:.0f} MiB, {config.run.gguf}, "
              f"{time.perf_counter() - started:.0f} s; run it with llama.cpp, README 'Run a student with llama.cpp')")
    if config.run.push_to_hub:
        url = export.push_to_hub(final, config.run.push_to_hub, private=not config.run.public)
        print(f"pushed to {url}")


__all__ = ["compress", "run_all", "PhaseClock", "ORIGINAL_TEACHER"]

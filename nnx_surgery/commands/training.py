"""`nnx-surgery distill` (distill.run, then save_student / save_pretrained) and `nnx-surgery eval` (the recipe's
evaluation: evaluation/final_eval.py over evaluation.evaluate_suite, both held-out sets)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from nnx_surgery import distill, evaluation, surgery
from nnx_surgery.evaluation import lm_eval_scores
from nnx_surgery.commands import kept_vocab, plan_of, shape_line, text_batches
from nnx_surgery.model_inputs import teacher_source
from nnx_surgery.paths import empty_folder, input_paths, model_folder, staged_files
from nnx_surgery.distill.inputs.cache_format import CacheError
from nnx_surgery.evaluation.heldout_sets import interval_text
from nnx_surgery.evaluation import final_eval
from nnx_surgery import model_inputs
from nnx_surgery import refusals
from nnx_surgery.recipes.compress.resolution import parse_ramp
from nnx_surgery.recipes.config.sections import EvaluationSection
from nnx_surgery.distill.inputs import topk_cache as teacher_cache

def _tokenizer_source(student: str, teacher: str) -> str:
    return student if os.path.isfile(os.path.join(student, "tokenizer.json")) else teacher


def distill_student(args: argparse.Namespace) -> str:
    """Distil STUDENT from TEACHER on the data (one stage: alpha * KL + (1 - alpha) * CE) and save it to --output,
    with the student's plan.json when it has one."""
    temperature = parse_ramp(args.temperature, "--temperature")  # refused before anything is read
    if args.warmup_steps is not None and args.warmup_steps > args.steps:
        raise refusals.RecipeError(f"--warmup-steps {args.warmup_steps} is longer than --steps {args.steps}: the "
                                 "learning rate would never reach its peak; give at most --steps warm-up steps.")
    teacher_folder = teacher_source(args.teacher, "TEACHER")
    student_folder = model_folder(args.student, "STUDENT")
    cache = getattr(args, "teacher_cache_folder", None)
    if cache and not os.path.isdir(cache):
        raise refusals.RecipeError(f"--teacher-cache-folder {cache}: {refusals.wrong_kind(cache, 'folder')}; give the folder "
                                   "`nnx-surgery cache-teacher` wrote.")
    out = empty_folder(args.output, "--output", args.overwrite,  # writable: checked before any training
                       inputs=input_paths(args.teacher, teacher_folder, args.student, args.data, cache))
    teacher_config = surgery.ModelConfig.from_file(teacher_folder)
    kept = kept_vocab(student_folder, "STUDENT", teacher_config)
    tokenizer = student_folder if kept is not None else teacher_folder  # a trimmed student reads its own tokens
    pieces = surgery.ModelConfig.from_file(student_folder).vocab_size
    if args.top_k is not None and args.top_k > pieces:
        raise refusals.RecipeError(f"--top-k {args.top_k}: the student's vocabulary has {pieces:,} pieces; give at "
                                   "most that many.")
    distill.inputs.batches.check_vocabulary(tokenizer, pieces)
    data, description = text_batches(args, teacher_folder, tokenizer=tokenizer, batch_size=args.batch_size)
    dtype = "bfloat16" if args.precision == "bf16" else "float32"
    if cache:  # the teacher's top k from the cache: the teacher is checked against it, never loaded
        _check_teacher_cache(cache, teacher_folder, tokenizer)
        teacher = None
    else:
        teacher = surgery.load_pretrained(teacher_folder, dtype=dtype)
    # the student in the run's precision, as the recipe's: it trains float32 masters and is saved as it came
    student = surgery.load_pretrained(student_folder, dtype=dtype)
    warmup = args.warmup_steps if args.warmup_steps is not None else args.steps // 50
    stage = distill.Stage(steps=args.steps, name="distill", learning_rate=args.learning_rate, warmup_steps=warmup,
                          weights=distill.LossWeights.mixed(args.alpha),
                          temperature=temperature)
    config = distill.DistillConfig(stages=(stage,), batch_size=args.batch_size, seq_len=args.seq_len,
                                   vocab_map=kept, seed=args.seed, plots=False, top_k=getattr(args, "top_k", None),
                                   teacher_cache=os.path.abspath(cache) if cache else None,
                                   compute_dtype=dtype)
    source = f", teacher from the cache {cache}" if cache else ""
    print(f"[distill] {args.steps} steps of {args.batch_size} x {args.seq_len} tokens of {description}{source}",
          flush=True)
    try:
        result = distill.run(teacher, student, data, config)
    except CacheError as error:
        raise refusals.RecipeError(str(error)) from None
    extra = {"history.json": {"train": result.full_history, "eval": result.full_evals,
                              "data_state": result.data_state}}
    plan = plan_of(student_folder)
    if plan is not None:  # the source makes a trimmed student's tokenizer again from the teacher's
        folder = surgery.save_student(result.student, plan, out, overwrite=args.overwrite, extra_files=extra,
                                      source=teacher_folder if kept else _tokenizer_source(student_folder,
                                                                                            teacher_folder))
    else:
        folder = surgery.save_pretrained(result.student, out, source=_tokenizer_source(student_folder, teacher_folder),
                                         overwrite=args.overwrite, extra_files=extra)
    ce = [record["student_ce"] for record in result.full_evals if "student_ce" in record]
    if ce:
        print(f"held-out CE: {ce[0]:.4f} before, {ce[-1]:.4f} after ({len(ce)} evaluations)")
    print(f"distilled student: {folder}")
    return folder


def _check_teacher_cache(cache: str, teacher_folder: str, tokenizer_folder: str) -> None:
    """The cache was written by this teacher (config and weights), with the tokenizer the data is read with (a
    trimmed student's own); else one line. Its vocabulary is checked by the run (distill.loop.cache_replay)."""

    tokenizer = os.path.join(tokenizer_folder, "tokenizer.json")
    try:
        teacher_cache.check_written_by(cache, teacher_folder, tokenizer if os.path.isfile(tokenizer) else None)
    except teacher_cache.CacheError as error:
        raise refusals.RecipeError(f"--teacher-cache-folder: {error}") from None


SUMMARY = (("loss_per_byte", "in-domain CE/byte", "{:.4f}"), ("kl_to_teacher", "in-domain KL", "{:.4f}"),
           ("top1_agreement", "top-1", "{:.1%}"), ("general_loss_per_byte", "general CE/byte", "{:.4f}"),
           ("general_kl", "general KL", "{:.4f}"), ("far_loss_per_byte", "far-domain CE/byte", "{:.4f}"),
           ("far_kl", "far-domain KL", "{:.4f}"), ("bleu", "BLEU", "{:.1f}"), ("rouge_l", "ROUGE-L", "{:.1f}"),
           ("multiple_choice", "next-line MC", "{:.1%}"), ("loop_share", "looping", "{:.0%}"),
           ("distinct_2", "distinct-2", "{:.3f}"))


def eval_table(rows: list[dict]) -> str:
    """The results' rows as a Markdown table (suite.md has every set in full, with intervals and samples)."""
    columns = [c for c in SUMMARY if any(row.get(c[0]) is not None for row in rows)]
    lines = ["| model | parameters | vocabulary | " + " | ".join(title for _, title, _ in columns) + " |",
             "|---|---:|---:|" + "---:|" * len(columns)]
    for row in rows:
        cells = ["-" if row.get(key) is None else form.format(row[key]) for key, _, form in columns]
        lines.append(f"| {row['model']} | {row['parameters']:,} | {row['vocab_size']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _names(folders: list[str], given: list[str]) -> list[str]:
    """Table names: each folder's base name, or the path as given when two share one (or one is "teacher")."""
    bases = [os.path.basename(os.path.normpath(path)) for path in given]
    return [base if bases.count(base) == 1 and base != "teacher" else path for base, path in zip(bases, given)]


def compared_lines(sets: dict, pairs: list[tuple[str, str]]) -> list[str]:
    """One line per --compare pair and held-out set: the differences a - b with their 95% intervals."""
    lines = []
    for name, report in sets.items():
        for entry in (c for c in report["comparisons"] if (c["a"], c["b"]) in pairs):
            cells = [f"{metric} {interval_text(entry[metric])}" for metric in ("ce", "ce_per_byte", "kl")
                     if entry.get(metric) is not None]
            lines.append(f"[{name}] {entry['a']} - {entry['b']}: " + ", ".join(cells))
    return lines


def _compared(given: list[str], names: list[str]) -> list[tuple[str, str]]:
    """--compare A:B as (A, B) pairs of table names (or "teacher"), checked before any model loads."""
    pairs = []
    for text in given:
        a, sep, b = text.partition(":")
        unknown = [name for name in (a, b) if name not in (*names, "teacher")]
        if not sep or unknown or a == b:
            raise refusals.RecipeError(f"--compare {text!r}: give A:B, two different models of the table "
                                  f"({', '.join(['teacher', *names])}).")
        pairs.append((a, b))
    return pairs


def _check_generation(args: argparse.Namespace, folders: list[str]) -> None:
    """--new-tokens within every model's positions (config.json's max_position_embeddings), before anything is
    loaded or allocated: the held-out prompts and the tokens generated after them share those positions."""
    for folder in folders:
        limit = model_inputs.position_limit(folder).get("max_positions")
        if limit is not None and args.new_tokens >= limit:
            raise refusals.RecipeError(f"--new-tokens {args.new_tokens}: {folder} has {limit} positions "
                                  "(max_position_embeddings in its config.json), which must hold each prompt too; "
                                  "give fewer new tokens.")


def eval_folders(args: argparse.Namespace) -> dict:
    """Judge every FOLDER against --teacher on the held-out sets (the data's held-out documents and, unless
    --no-general-eval, general prose near and far from the training text), with generations and multiple choice;
    write suite.md/json and results.json."""
    teacher_folder = teacher_source(args.teacher, "--teacher")
    folders = [model_folder(path, "FOLDER") for path in args.folders]
    names = _names(folders, args.folders)
    if len(set(names)) != len(names):
        raise refusals.RecipeError(f"FOLDER: {sorted(n for n in names if names.count(n) > 1)} given twice; give each "
                              "folder once.")
    pairs = [(name, "teacher") for name in names] + _compared(args.compare, names)
    _check_generation(args, [teacher_folder, *folders])
    if args.include_path and args.eval_tasks is None:
        raise refusals.RecipeError(f"--include-path {args.include_path}: it adds lm-eval task files for --eval-tasks; "
                                 "give --eval-tasks too.")
    tasks = None if args.eval_tasks is None else lm_eval_scores.checked_tasks(  # refused before any model loads
        args.eval_tasks, include_path=args.include_path, flag="--eval-tasks")
    out = empty_folder(args.output, "--output", args.overwrite,
                       inputs=input_paths(args.teacher, teacher_folder, *args.folders, args.data, args.include_path))
    teacher_config = surgery.ModelConfig.from_file(teacher_folder)
    kept = {name: kept_vocab(folder, "FOLDER", teacher_config) for name, folder in zip(names, folders)}
    data, description = text_batches(args, teacher_folder)
    section = EvaluationSection(tokens=args.eval_tokens, general=args.general_eval, prompts=args.eval_prompts,
                                new_tokens=args.new_tokens, choice_items=args.choice_items, tasks=args.eval_tasks,
                                tasks_limit=args.eval_tasks_limit)
    settings = final_eval.EvalSettings(teacher_folder, args.seq_len, args.seed, description, section, tasks,
                                       tasks_batch=args.tasks_batch)
    rows = [("teacher", surgery.load_pretrained(teacher_folder, dtype="float32"), 0)]
    for name, folder in zip(names, folders):
        model = surgery.load_pretrained(folder, dtype="float32")
        print(f"[eval] {name}: {shape_line(model.config)}", flush=True)
        rows.append((name, model, 0))
    vocabularies = {name: evaluation.Vocabulary(folder, kept_ids) for name, folder in zip(names, folders)
                    if (kept_ids := kept[name]) is not None}
    with staged_files(out) as staging:  # a failure (a full disk, Ctrl-C) leaves --output as it was
        results = final_eval.evaluate_rows(settings, rows, data, staging, pairs=pairs, vocabularies=vocabularies)
        for row in results["rows"]:
            row.pop("tokens")  # the recipe's training tokens: not known here
        results["folders"] = {"teacher": teacher_folder, **dict(zip(names, folders))}
        with open(os.path.join(staging, "results.json"), "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
    print(eval_table(results["rows"]))
    if tasks is not None:
        print("\n" + lm_eval_scores.task_scores_text(results["lm_eval"]))
    for line in compared_lines(results["sets"], pairs[len(names):]):
        print(line)
    written = [name for name in ("suite.md", "suite.json", "results.json") if os.path.exists(os.path.join(out, name))]
    missing = "" if "suite.md" in written else " (no suite.md: it holds the generations, and --eval-prompts is 0)"
    print(f"written in {out}: {', '.join(written)}{missing}")
    return results

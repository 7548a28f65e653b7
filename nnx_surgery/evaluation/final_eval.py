"""The recipe's evaluation: every model of the results table on the same held-out data, and the recovery curves.

Each row is scored on two held-out sets (`evaluation.HeldoutSet`, --eval-tokens each): the corpus's held-out
documents (in-domain: what CE retraining optimises directly) and English prose that no training corpus contains
(general: what compression must keep), with cross-entropy per token and per byte, KL to the teacher and top-1
agreement, and 95% intervals for the differences between the distilled student, the control and the teacher
(paired bootstrap over documents). Unless `--eval-prompts 0`, `evaluation.evaluate_suite` adds greedy continuations
of held-out prompts scored against the teacher's (BLEU, ROUGE-L), a next-line multiple-choice task scored by
log-likelihood, and the same prompts answered by every model (`suite.md` / `suite.json` in the run folder). Multi-host: every process evaluates together (its rows of the
held-out batches; the scores are those of the global batches, the same on every process) and process 0 writes.

Students with a trimmed vocabulary (`--student ...,vocab=N`; nnx_surgery/recipes/compress/vocabulary.py) are scored on the same
passages in their own tokens (`evaluation.cross_vocab`): KL and top-1 agreement against the teacher restricted to
their kept pieces, renormalised; against the teacher (another tokenizer) only CE per byte compares, so the verdicts
and their intervals are per byte; generations and multiple choice use their own tokenizer.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any, TypedDict

from nnx_surgery import distill
from nnx_surgery.evaluation.cross_vocab import heldout_report_across
from nnx_surgery.evaluation.heldout_sets import HeldoutSet
from nnx_surgery.evaluation.suite_scoring import SuiteSettings, evaluate_suite
from nnx_surgery.distill.inputs import packaged_prose
from nnx_surgery.surgery.storage.hf_checkpoint import model_tensors
from nnx_surgery.recipes.config.sections import EvaluationSection, RecipeConfig
from nnx_surgery.surgery.modeling.generation import generate
from nnx_surgery.evaluation.lm_eval_scores import checked_tasks
from nnx_surgery.evaluation import lm_eval_scores

# results.json row keys for the suite's metrics
SUITE_KEYS = {"top1_agreement": "top1_agreement", "kl": "kl_to_teacher", "bleu": "bleu", "rouge_l": "rouge_l",
              "mc_accuracy": "multiple_choice", "loop_share": "loop_share", "distinct_2": "distinct_2"}
IN_DOMAIN, GENERAL, FAR = "in-domain", "general", "far-domain"


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """What the final evaluation reads: the teacher's folder (its tokenizer), --seq-len, --seed, what the training
    text is, the evaluation section (--eval-tokens of each held-out set, --general-eval, the suite's
    --eval-prompts (0: held-out sets only), --new-tokens, --choice-items, --eval-tasks-limit) and the lm-eval
    tasks of --eval-tasks, checked (lm_eval_scores.Tasks; None: no tasks)."""

    teacher_folder: str
    seq_len: int
    seed: int
    data_description: str
    evaluation: EvaluationSection
    tasks: Any = None
    tasks_batch: int | None = None  # rows per lm-eval scoring batch (None: the backend's default)

    @classmethod
    def of(cls, config: RecipeConfig, teacher_folder: str, data_description: str) -> "EvalSettings":
        """The recipe's, from its configuration (--eval-tasks refused now when unknown, without a dataset or
        without the lm-eval extra, before any training)."""
        tasks = None
        if config.evaluation.tasks:
            tasks = checked_tasks(config.evaluation.tasks, include_path=None, flag="--eval-tasks")
        return cls(teacher_folder, config.data.seq_len, config.run.seed, data_description, config.evaluation, tasks)


class _SetOptions(TypedDict):
    """The `HeldoutSet.from_texts` options every final held-out set shares."""

    tokenizer: str
    seq_len: int
    max_tokens: int | None
    seed: int


def heldout_sets(args: EvalSettings, data, far: bool = True) -> list:
    """The final held-out sets: the corpus's held-out documents (in-domain) and, unless --no-general-eval,
    English prose no training corpus contains: the held-out pydoc topics (general: near the prose a general mix
    trains on) and, with `far`, prose from files no training text comes from (far-domain), each cut to
    --eval-tokens scored tokens."""
    common: _SetOptions
    common = dict(tokenizer=args.teacher_folder, seq_len=args.seq_len, max_tokens=args.evaluation.tokens, seed=args.seed)
    texts = {IN_DOMAIN: data.eval_texts(), GENERAL: distill.general_prose("heldout") if args.evaluation.general else [],
             FAR: _far_texts() if args.evaluation.general and far else []}
    for name, held in texts.items():  # the packaged general prose trains only (--general-source packages)
        packaged_prose.refuse_held_out(held, name)
    sets = [HeldoutSet.from_texts(IN_DOMAIN, texts[IN_DOMAIN], description=f"held-out documents of the "
                                          f"training corpus ({args.data_description or 'the --data files'})",
                                          **common)]
    if args.evaluation.general:
        sets.append(HeldoutSet.from_texts(GENERAL, texts[GENERAL], description=(
            "English prose no training corpus contains: the Python language reference's pydoc topics "
            f"(Python {sys.version_info.major}.{sys.version_info.minor}), held-out half"), **common))
    if texts[FAR]:
        sets.append(HeldoutSet.from_texts(FAR, texts[FAR], description=(
            "English prose from files of the Python install that no training text comes from: the history of "
            "Python (LICENSE.txt without its terms), IDLE's change logs and notes, the email package's design notes "
            f"(Python {sys.version_info.major}.{sys.version_info.minor})"), **common))
    return sets


def _far_texts() -> list[str]:
    """The far-domain documents, or none (one printed line) on a Python install without their files."""
    try:
        return distill.far_prose()
    except distill.DataError as error:
        print(f"[eval] no far-domain set: {error}", flush=True)
        return []


def evaluate_rows(args: EvalSettings, rows: list[tuple[str, Any, int]], data, out: str, pairs=(),
             vocabularies=None) -> dict:
    """`rows`: (name, model, training tokens used), the teacher first; `pairs`: (a, b) model names whose
    differences get 95% intervals; `vocabularies`: the rows with a trimmed vocabulary (name ->
    `evaluation.Vocabulary`), judged in their own tokens (module docstring). Returns the results dict of results.json;
    suite.md goes to `out`."""
    models = {name: model for name, model, _ in rows}
    vocabularies = vocabularies or {}
    if args.evaluation.prompts > 0:
        settings = SuiteSettings(prompts=args.evaluation.prompts, new_tokens=args.evaluation.new_tokens,
                                         choice_items=args.evaluation.choice_items, seed=args.seed)
        suite = evaluate_suite(models, None, data.eval_texts(), tokenizer=args.teacher_folder,
                                       generate=greedy, reference=rows[0][0], settings=settings,
                                       out_path=os.path.join(out, "suite.md"), heldout_sets=heldout_sets(args, data),
                                       pairs=pairs, vocabularies=vocabularies)
    else:  # no generations: the held-out sets alone
        reports = {held.name: heldout_report_across(models, held, reference=rows[0][0], pairs=pairs,
                                                            vocabularies=vocabularies)
                   for held in heldout_sets(args, data)}
        suite = {"models": {name: {"sets": {k: r["models"][name] for k, r in reports.items()}} for name in models},
                 "sets": reports}
    results: dict[str, Any] = {"rows": [], "sets": {k: {key: v for key, v in r.items() if key != "models"}
                                                     for k, r in suite["sets"].items()}}
    if vocabularies:
        results["trimmed_vocabulary"] = trimmed_note(vocabularies, rows[0][0])
    for name, model, used in rows:
        scores = suite["models"][name]
        in_domain = scores["sets"][IN_DOMAIN]
        row = {"model": name, "parameters": model.config.num_parameters(),
               "non_embedding_parameters": non_embedding(model.config), "vocab_size": model.config.vocab_size,
               "safetensors_bytes": safetensors_bytes(model), "tokens": used, "loss": in_domain["ce"],
               "perplexity": math.exp(min(in_domain["ce"], 50.0)), "eval_tokens": in_domain["tokens"],
               "loss_per_byte": in_domain["ce_per_byte"], "trimmed_vocabulary": name in vocabularies}
        if name != rows[0][0]:
            row.update(top1_agreement=in_domain["top1_agreement"], kl_to_teacher=in_domain["kl"])
        for set_name, prefix in ((GENERAL, "general"), (FAR, "far")):
            if set_name in scores["sets"]:
                held = scores["sets"][set_name]
                row.update({f"{prefix}_loss": held["ce"], f"{prefix}_loss_per_byte": held["ce_per_byte"]})
                if name != rows[0][0]:
                    row.update({f"{prefix}_kl": held["kl"], f"{prefix}_top1_agreement": held["top1_agreement"]})
        row.update({ours: scores[theirs] for theirs, ours in SUITE_KEYS.items()
                    if theirs not in ("top1_agreement", "kl") and scores.get(theirs) is not None})
        results["rows"].append(row)
    if "samples" in suite:
        results["samples"] = suite["samples"]
        results["multiple_choice"] = suite["multiple_choice"]
    if args.tasks is not None:
        add_task_scores(results, args, models, vocabularies, out)
    return results


def add_task_scores(results: dict, args: EvalSettings, models: dict, vocabularies: dict, out: str) -> None:
    """Every model scored on the lm-eval tasks (our backend, in memory; a trimmed student with its own tokenizer),
    in each results row's `lm_eval`, in results["lm_eval"] and in `out`/lm_eval.md."""
    scores, seconds = {}, {}
    for row in results["rows"]:
        name = row["model"]
        tokenizer = vocabularies[name].tokenizer if name in vocabularies else args.teacher_folder
        started = time.perf_counter()
        batch = {"batch_size": args.tasks_batch} if args.tasks_batch else {}
        row["lm_eval"] = scores[name] = lm_eval_scores.score_model(models[name], tokenizer, args.tasks,
                                                                   limit=args.evaluation.tasks_limit, **batch)
        seconds[name] = round(time.perf_counter() - started, 1)
        distill.distributed.say(f"[eval] lm-eval tasks {', '.join(args.tasks.names)}: {name} ({seconds[name]:.0f} s)")
    results["lm_eval"] = {"tasks": list(args.tasks.names), "limit": args.evaluation.tasks_limit, "scores": scores,
                          "seconds": seconds}
    if distill.distributed.is_main_process():
        with open(os.path.join(out, "lm_eval.md"), "w", encoding="utf-8") as handle:
            handle.write(lm_eval_scores.task_scores_text(results["lm_eval"]) + "\n")



def greedy(model, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The suite's generation: greedy, batched, KV-cached, stopping at the model's EOS."""
    return generate(model, prompt_ids, max_new_tokens=max_new_tokens).tokens


def non_embedding(config) -> int:
    return config.num_parameters() - config.vocab_size * config.hidden_size


def safetensors_bytes(model) -> int:
    """The tensor bytes of the model's safetensors files as `save_pretrained` writes them (its parameters'
    dtype; each file adds a JSON header of a few kB)."""
    return sum(math.prod(t.shape) * t.dtype.itemsize for t in model_tensors(model))


def trimmed_note(vocabularies: dict, reference: str) -> str:
    """How rows with a trimmed vocabulary are judged (results.json and the table's notes)."""
    sizes = sorted({len(v.teacher_ids) for v in vocabularies.values()})
    return (f"{', '.join(vocabularies)}: a trimmed vocabulary ({' / '.join(f'{n:,}' for n in sizes)} pieces), scored "
            "on the same held-out passages in its own tokens. CE per token is in each model's own tokens, so only "
            f"CE per byte compares it with the {reference}; its KL and top-1 agreement are against the {reference} "
            "restricted to its kept pieces (renormalised); its continuations and multiple choice use its own "
            "tokenizer.")


def curve(evals: list[dict], tokens_per_step: int) -> list[dict]:
    """Held-out evaluations of one training run as points: tokens seen (`tokens_per_step`: micro-batch x sequence x
    accumulation), cross-entropy, and (when the run had a teacher) KL to it and the teacher-student logit
    correlation."""
    points = []
    for record in evals:
        point = {"step": record["step"], "tokens": record["step"] * tokens_per_step,
                 "ce": round(record["student_ce"], 4)}
        for key in ("kl", "logit_corr"):
            if key in record:
                point[key] = round(record[key], 4)
        points.append(point)
    return points


def sample_section(results: dict, limit: int = 3) -> str:
    """A few held-out prompts with every model's greedy continuation, for the console and results.md."""
    lines = []
    for sample in results.get("samples", [])[:limit]:
        prompt = sample["prompt"].rstrip("\n").splitlines()[-3:]
        lines += ["", "prompt (last lines): " + " / ".join(line.strip() for line in prompt)]
        for name, text in sample["continuations"].items():
            lines.append(f"  {name:>40}: {' '.join(text.split())[:160]!r}")
    return "\n".join(lines)


def step_stats(history: list[dict]) -> dict | None:
    """Median step time, tokens/s and TFLOP/s of a training phase, compilation steps left out. The TFLOP/s count
    the teacher of a trimmed student at its kept pieces (`teacher_head_counted`; runs before 2026-12-05 counted
    its whole head)."""
    steady = [r for r in history if not r.get("warmup") and "step_time_s" in r]
    if not steady:
        return None

    def median(key):
        values = sorted(r[key] for r in steady)
        return round(values[len(values) // 2], 4)

    return {"steps": len(steady), "step_time_s": median("step_time_s"), "tokens_per_s": median("tokens_per_s"),
            "tflops_per_s": median("tflops_per_s"), "teacher_head_counted": "kept pieces"}

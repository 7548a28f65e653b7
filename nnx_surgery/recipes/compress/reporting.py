"""What the recipe shows a person: the dry-run summary, the results table, training curves and the model card."""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import jax

from nnx_surgery import export, surgery
from nnx_surgery.distill.mesh import parse_mesh_spec
from nnx_surgery.recipes.config.sections import CONTROL_NAMES, RecipeConfig
from nnx_surgery.recipes.compress.run_settings import RunSettings
from nnx_surgery.recipes.compress.shape_search import GUESS, StudentChoice, eval_points
from nnx_surgery.distill.inputs.source_reads import reads_line
from nnx_surgery.recipes.compress.teacher_caching import summary_line
from nnx_surgery.evaluation.lm_eval_scores import task_scores_text
from nnx_surgery.recipes.compress.phase_clock import wall_time_line

BYTES = {"bf16": 2, "fp32": 4}


def _mesh_sizes(mesh: str | None) -> dict[str, int]:
    return parse_mesh_spec(mesh) if mesh else {}


def dry_run_report(run: RunSettings) -> str:
    """Shapes, parameter counts and memory per device for the chosen mesh and precision, and the plan, from the
    run's settings (run_settings.RunSettings). With `--student params=...`, first the shapes the search would train
    and its cost; the uniform guess stands for the student below."""
    config, teacher, spec = run.config, run.teacher.config, run.student.spec
    search = run.student.choice if run.student.choice.budget else None
    student = spec.config_for(teacher, list(range(spec.num_layers)))
    pieces = spec.vocab_size_for(teacher)
    student = student if pieces is None else student.replace(vocab_size=pieces)
    devices = 1
    for size in _mesh_sizes(config.training.mesh).values():
        devices *= size
    n_t, n_s = teacher.num_parameters(), student.num_parameters()
    t_bytes = n_t * BYTES[config.training.precision]
    s_bytes = n_s * 4 * 4  # float32 master weights, gradients and two Adam moments
    act = config.data.batch_size * config.data.seq_len * student.hidden_size * student.num_hidden_layers * 4 * 16
    act += config.data.batch_size * config.data.seq_len * teacher.hidden_size * 4 * 4  # teacher forward, one layer live
    logits = 32 * student.vocab_size * 4 * 6  # fused KL chunk: both models' logits, probabilities, gradient
    rows = [("", "teacher", "student"),
            ("family", teacher.model_type, student.model_type),
            ("layers", teacher.num_hidden_layers, student.num_hidden_layers),
            ("hidden", teacher.hidden_size, student.hidden_size),
            ("intermediate", teacher.intermediate_size, student.intermediate_size),
            ("query heads", teacher.num_attention_heads, student.num_attention_heads),
            ("KV heads", teacher.num_key_value_heads, student.num_key_value_heads),
            ("head_dim", teacher.head_dim, student.head_dim),
            ("vocabulary", teacher.vocab_size, student.vocab_size),
            ("parameters", _count(n_t), f"{_count(n_s)}  ({n_s / n_t:.0%} of the teacher)")]
    width = max(len(str(r[0])) for r in rows)
    lines = search_plan(config, search) if search is not None else []
    lines += [f"{str(a).ljust(width)}  {str(b).rjust(10)}  {c}" for a, b, c in rows]
    gib = 2**30
    memory = [(f"teacher weights ({config.training.precision})", t_bytes / devices),
              ("student weights, grads, Adam moments (float32)", s_bytes / devices),
              ("activations (rough, no remat) and the logit chunk", act / devices + logits)]
    memory.append(("total", sum(v for _, v in memory)))
    lines += ["", f"mesh {config.training.mesh or 'one device'} ({devices} device(s)), precision {config.training.precision}, "
              f"batch {config.data.batch_size} x {config.data.seq_len} per step",
              "memory per device (FSDP shards parameters and optimizer state over all devices):"]
    lines += [f"  {name.ljust(50)} {value / gib:9.3f} GiB" for name, value in memory]
    lines += ["", "plan:"]
    folder = run.teacher.folder
    if os.path.exists(os.path.join(folder, "config.json")) and _has_weights(folder):
        # the kept pieces come from calibration counts, which a dry run does not have
        target = run.student.stage_a_spec or dataclasses.replace(spec, vocab_size=None)
        plan = surgery.plan_student(folder, target)  # data-free, tensor by tensor from disk
        lines.append(f"  ({'stage A of staged compression; ' if config.surgery.compression == 'staged' else ''}"
                     "data-free magnitude scores read from disk; the run uses calibration data)")
        lines.append(surgery.format_report(plan))
        if pieces is not None:
            lines.append(f"  vocab: {pieces:,} of the teacher's {teacher.vocab_size:,} pieces, chosen at run time from "
                         "the calibration data (the special tokens, the byte pieces, then the most frequent)")
    else:
        lines.append("  the teacher's weights are not on disk yet; the plan is computed at run time")
    return "\n".join(lines)


def search_plan(config: RecipeConfig, search: StudentChoice) -> list[str]:
    """The dry run's account of a shape search: each candidate's shape and parameter counts (the uniform guess
    and the heads-kept shape marked), and its cost in steps and tokens against the main distillation's."""
    budget, search_steps = search.budget, config.search.steps
    assert budget is not None  # a search is planned
    assert search_steps is not None  # resolution.derive writes it from --steps
    width = max(len(c.text) for c in search.candidates)
    lines = [f"shape search ({budget.text}: {search.target:,} {budget.counting.replace('_', '-')} parameters "
             f"+-{config.search.tolerance:.0%}; {search.fitting} shapes fit, {len(search.candidates)} searched):",
             f"  {'candidate'.ljust(width)}  {'parameters':>10}  {'non-embedding':>13}"]
    for candidate in search.candidates:
        note = search.note(candidate)
        mark = {None: "", GUESS: "  uniform guess (every axis cut by the same ratio)"}.get(note, f"  {note}")
        lines.append(f"  {candidate.text.ljust(width)}  {_count(candidate.parameters):>10}  "
                     f"{_count(candidate.non_embedding):>13}{mark}")
    steps = len(search.candidates) * config.search.steps
    lines += [f"  cost: {len(search.candidates)} candidates x {config.search.steps} steps x "
              f"{config.tokens_per_step:,} tokens per step = {steps:,} steps, {steps * config.tokens_per_step:,} tokens: "
              f"{steps / config.training.steps:.2f}x the main distillation's {config.training.steps:,} steps "
              f"({config.training.steps * config.tokens_per_step:,} tokens)",
              "  each candidate scored on the held-out sets at steps "
              f"{', '.join(map(str, eval_points(search_steps)))}; ranked by in-domain CE at the last",
              "  the shapes and plan below are the uniform guess's; the run distils the search's winner", ""]
    return lines


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _has_weights(folder: str) -> bool:
    return any(name.endswith(".safetensors") for name in os.listdir(folder))


CONTROL_ROWS = tuple(CONTROL_NAMES.values())
# (results row key, column title, format); a column shows when any row has its key
COLUMNS = (("loss", "in-domain CE", "{:.4f}"), ("loss_per_byte", "in-domain CE/byte", "{:.4f}"),
           ("top1_agreement", "in-domain top-1", "{:.1%}"), ("kl_to_teacher", "in-domain KL", "{:.3f}"),
           ("general_loss", "general CE", "{:.4f}"), ("general_loss_per_byte", "general CE/byte", "{:.4f}"),
           ("general_top1_agreement", "general top-1", "{:.1%}"), ("general_kl", "general KL", "{:.3f}"),
           ("far_loss", "far-domain CE", "{:.4f}"), ("far_loss_per_byte", "far-domain CE/byte", "{:.4f}"),
           ("far_top1_agreement", "far-domain top-1", "{:.1%}"), ("far_kl", "far-domain KL", "{:.3f}"),
           ("bleu", "BLEU", "{:.1f}"), ("rouge_l", "ROUGE-L", "{:.1f}"), ("multiple_choice", "next-line MC", "{:.1%}"),
           ("loop_share", "looping", "{:.0%}"), ("distinct_2", "distinct-2", "{:.3f}"))


def results_table(results: dict) -> str:
    """The results table (one row per model: total parameters, vocabulary, safetensors size; CE in nats, KL and
    agreement against the teacher), the verdicts with 95% intervals on each held-out set, and the wall time of
    each phase."""
    columns = [c for c in COLUMNS if any(c[0] in row for row in results["rows"])]
    lines = ["| model | parameters (non-embedding) | vocabulary | safetensors | tokens used | "
             + " | ".join(c[1] for c in columns) + " |", "|---|---|---|---|---|" + "---|" * len(columns)]
    for row in results["rows"]:
        non_embedding = row.get("non_embedding_parameters")
        size = f"{row['parameters'] / 1e6:.2f}M" + (f" ({non_embedding / 1e6:.1f}M)" if non_embedding else "")
        vocabulary = "-" if row.get("vocab_size") is None else \
            f"{row['vocab_size']:,}" + (" (trimmed)" if row.get("trimmed_vocabulary") else "")
        weights = "-" if row.get("safetensors_bytes") is None else f"{row['safetensors_bytes'] / 1e6:.1f} MB"
        cells = ["-" if row.get(key) is None else form.format(row[key]) for key, _, form in columns]
        lines.append(f"| {row['model']} | {size} | {vocabulary} | {weights} | {row['tokens']:,} | "
                     + " | ".join(cells) + " |")
    if results.get("trimmed_vocabulary"):
        lines += ["", results["trimmed_vocabulary"]]
    lines += ["", *verdicts(results), *pairing_lines(results), *search_summary(results.get("search"))]
    if results.get("corpus_reads"):  # (older results.json files do not say)
        lines.append(f"Text read by the distillation (and the control): {reads_line(results['corpus_reads'])}.")
    if "teacher_cache" in results:  # (older results.json files do not say)
        lines.append(summary_line(results["teacher_cache"]))
    if results.get("lm_eval"):  # --eval-tasks
        lines += [task_scores_text(results["lm_eval"]), ""]
    lines.append(wall_time_line(results))
    return "\n".join(lines)


METRIC_NAMES = {"ce": "CE", "ce_per_byte": "CE per byte", "kl": "KL to the teacher", "top1_agreement": "top-1 agreement"}


def search_summary(search: dict | None) -> list[str]:
    """The shape search in results.md: what was searched, the winner, the uniform guess's rank, the ranking at
    each scored step, and the link to search.md (relative to the run folder, where results.md lies)."""
    if not search:
        return []
    count = len(search["candidates"])
    rankings = "; ".join(f"step {step}: " + " > ".join(f"`{name}`" for name in names)
                         for step, names in search["rankings"].items())
    return [f"Shape search ({search['student']}: {search['target_parameters']:,} "
            f"{search['counting'].replace('_', '-')} parameters +-{search['tolerance']:.0%}): {count} of the "
            f"{search['shapes_within_budget']} shapes within the budget, {search['steps']} steps each on the same "
            f"batches, ranked by {search['rank_by'][0]} {METRIC_NAMES[search['rank_by'][1]]}. Winner, the student above: `{search['winner']}`; "
            f"the uniform guess `{search['uniform_guess']}` ranked {search['guess_rank']} of {count}.",
            f"  Ranking at {rankings}. Details: [{search['report']}]({search['report']}).", ""]


def verdicts(results: dict) -> list[str]:
    """Per held-out set: the share of the pruned-to-teacher gap the distilled student (and the control) closed,
    and the distilled student against the control with the 95% interval of the difference. A difference whose
    interval contains 0 is called a tie. With a trimmed vocabulary everything is per byte: CE per token is in
    each model's own tokens, and the teacher's are not the students'."""
    by_name = {r["model"]: r for r in results["rows"]}
    per_byte = any(r.get("trimmed_vocabulary") for r in results["rows"])
    unit, metric = ("nats/byte", "ce_per_byte") if per_byte else ("nats/token", "ce")
    distilled, teacher = by_name.get("distilled student"), by_name.get("teacher")
    pruned = by_name.get("pruned (before distillation)")
    control = next((by_name[name] for name in CONTROL_ROWS if name in by_name), None)
    lines = []
    for key, title in (("loss", "in-domain"), ("general_loss", "general"), ("far_loss", "far-domain")):
        key = f"{key}_per_byte" if per_byte else key
        if not (distilled and teacher and pruned and key in distilled):
            continue
        gap = pruned[key] - teacher[key]
        closed = [f"the distilled student closed {(pruned[key] - distilled[key]) / gap:.0%}"] if gap > 0 else []
        if control and gap > 0:
            closed.append(f"the {control['model']} {(pruned[key] - control[key]) / gap:.0%}")
        sentence = f"{title.capitalize()} held-out set: " + (
            " and ".join(closed) + f" of the pruned-to-teacher gap in CE{' per byte' * per_byte}" if closed else
            "pruning did not raise CE over the teacher")
        sentence += f"; the distilled student is {distilled[key] - teacher[key]:+.4f} {unit} from the teacher"
        versus = (_comparison(results, title, "distilled student", "teacher") or {}).get(metric)
        if versus and versus["low"] is not None:  # across tokenizers: per byte on the same passages
            sentence += f" [{versus['low']:+.4f}, {versus['high']:+.4f}]"
        lines.append(sentence + ".")
        comparison = _comparison(results, title, "distilled student", control["model"] if control else None)
        if comparison:
            ce, kl = comparison[metric], comparison["kl"]
            if ce["low"] is None:
                lines.append(f"  Distilled - control: CE {ce['difference']:+.4f} {unit}, KL "
                             f"{kl['difference']:+.3f} (one held-out document: no interval).")
                continue
            if ce["high"] < 0:
                verdict = "beats"
            elif ce["low"] > 0:
                verdict = "loses to"
            else:
                verdict = "ties (the 95% interval contains 0) with"
            lines.append(f"  Distilled {verdict} the control: CE {ce['difference']:+.4f} {unit} "
                         f"[{ce['low']:+.4f}, {ce['high']:+.4f}], KL to the teacher {kl['difference']:+.3f} "
                         f"[{kl['low']:+.3f}, {kl['high']:+.3f}] (distilled - control, 95% interval).")
    return lines


SET_KEYS = (("loss", "in-domain"), ("general_loss", "general"), ("far_loss", "far-domain"))


def gap_closed(results: dict, rows: Mapping[str, str] | None = None) -> dict[str, dict[str, float]]:
    """Per held-out set (in-domain, general, far-domain): the share of the pruned-to-teacher gap in CE per byte
    that the distilled student and the control closed (as the verdicts say it), from a results.json; a set the
    run did not score, or where pruning raised no CE, is left out. `rows`: other models instead (label -> the
    model's row name, e.g. a sweep's variants)."""
    by_name = {r["model"]: r for r in results["rows"]}
    teacher, pruned = by_name.get("teacher"), by_name.get("pruned (before distillation)")
    models = ({"distilled": by_name.get("distilled student"),
               "control": next((by_name[name] for name in CONTROL_ROWS if name in by_name), None)}
              if rows is None else {label: by_name.get(name) for label, name in rows.items()})
    out: dict[str, dict[str, float]] = {}
    for key, title in SET_KEYS:
        key = f"{key}_per_byte"
        if not (teacher and pruned and key in teacher and key in pruned) or pruned[key] <= teacher[key]:
            continue
        gap = pruned[key] - teacher[key]
        out[title] = {name: (pruned[key] - row[key]) / gap for name, row in models.items() if row and key in row}
    return out


def pairing_lines(results: dict) -> list[str]:
    """Whether the control trained paired with the distillation (run_phases.pairing's record): "same batches, same
    order" only when every step's batch digest agrees, and whether both started from the same weights."""
    pairing, rows = results.get("pairing") or {}, {r["model"] for r in results["rows"]}
    control = next((name for name in CONTROL_ROWS if name in rows), "control")
    if "control" not in pairing:
        return []
    batches, steps = pairing["batches"], pairing["batches"]["steps"]
    if batches["same"]:
        phases = " + ".join(pairing["distillation"]["phases"])
        line = (f"Training: the distilled student ({phases}) and the {control} read the same batches, same order "
                f"({steps[0]} steps, batch sequence {pairing['control']['batch_sequence']})")
    else:
        line = (f"Training is NOT paired: the {control}'s batches agree with the distillation's for "
                f"{batches['agreeing_steps']} of {steps[0]} steps (the control ran {steps[1]})"
                + (f": {batches['why']}" if batches.get("why") else ""))
    same_start = pairing.get("same_start")
    if same_start is True:
        line += f", from bit-identical starting weights ({pairing['control']['start_weights']})."
    elif same_start is False:
        line += ", but NOT from the same starting weights."
    else:
        line += " (the two start from other weights by design: a scratch control, or staged compression)."
    return [line]


def _comparison(results: dict, set_name: str, a: str, b: str | None) -> dict | None:
    if b is None:
        return None
    for entry in results.get("sets", {}).get(set_name, {}).get("comparisons", []):
        if (entry["a"], entry["b"]) == (a, b):
            return entry
    return None


def _cell(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def write_results(out: str, results: dict, table: str) -> None:
    """results.json and results.md in the run folder (multi-host: process 0 writes, the folder being shared)."""
    if jax.process_index() != 0:
        return
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table + "\n")


def plot_curves(path: str, stage_a: list[dict], stage_b: list[dict], control: list[dict], tokens_per_step: int, *,
                control_name: str = "", recovery: dict | None = None, teacher_loss: float | None = None) -> str:
    """Left: student cross-entropy on its training batches against tokens seen (distilled, with stage A then
    stage B when staged, and the control). Right, when evaluated: the recovery curves, held-out CE of both.
    Multi-host: process 0 draws and writes it; the others return the path."""
    from matplotlib.figure import Figure

    if jax.process_index() != 0:
        return path

    def points(history, first_step=0):
        return [((first_step + i + 1) * tokens_per_step, r["student_ce"]) for i, r in enumerate(history)
                if "student_ce" in r]

    recovery = {k: v for k, v in (recovery or {}).items() if v}
    fig = Figure(figsize=(12.5 if recovery else 7.5, 4.2))
    axes = fig.subplots(1, 2 if recovery else 1)
    ax = axes[0] if recovery else axes
    for label, data in (("distilled" + (": stage A (depth + MLP)" if stage_a else ""), points(stage_a)),
                        ("distilled" + (": stage B" if stage_a else ""), points(stage_b, len(stage_a))),
                        (control_name or "control", points(control))):
        if data:
            ax.plot(*zip(*data), label=label, linewidth=1)
    if stage_a:
        ax.axvline(len(stage_a) * tokens_per_step, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("student cross-entropy on its batch (nats/token)")
    ax.set_title("training curves at equal token budgets")
    ax.legend()
    if recovery:
        ax = axes[1]
        for label, curve in recovery.items():
            name = control_name if label == "control" and control_name else label
            ax.plot([p["tokens"] for p in curve], [p["ce"] for p in curve], marker="o", label=name)
        if teacher_loss is not None:
            ax.axhline(teacher_loss, color="grey", linestyle="--", linewidth=1, label="teacher")
        ax.set_xlabel("training tokens seen")
        ax.set_ylabel("held-out cross-entropy (nats/token)")
        ax.set_title("recovery curves (held-out)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def card_writer(run: RunSettings, plan, plan_a, results: dict, tokens: int):
    """A callable for `save_student(extra_files={"README.md": ...})`: the model card with the lineage. `run`: the
    run's settings (run_settings.RunSettings)."""
    config = run.config

    def write(path: str) -> None:
        teacher = plan_a.teacher_config if plan_a is not None else plan.teacher_config
        student = plan.student
        summary = {axis: f"{getattr(teacher, axis)} -> {getattr(student, axis)}"
                   for axis in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                "num_key_value_heads", "vocab_size")}
        summary["compression"] = config.surgery.compression
        summary["KV heads"] = plan.methods.get("kv")
        evaluation = {"held-out loss": {r["model"]: round(r["loss"], 4) for r in results["rows"]},
                      "held-out loss per byte": {r["model"]: round(r["loss_per_byte"], 4) for r in results["rows"]},
                      "perplexity": {r["model"]: round(r["perplexity"], 3) for r in results["rows"]}}
        for key, title in (("general_loss", "general-domain held-out loss (pydoc prose)"),
                           ("far_loss", "far-domain held-out loss (prose no training text comes from)")):
            if any(key in r for r in results["rows"]):
                evaluation[title] = {r["model"]: round(r[key], 4) for r in results["rows"] if key in r}
        export.write_model_card(os.path.dirname(path), teacher_id=str(run.teacher.source),
                                 teacher_revision=config.teacher.revision, plan_summary=summary,
                                 data_description=" ".join([run.data.description, *pairing_lines(results)]),
                                 steps=config.training.steps,
                                 tokens=tokens, losses=results.get("final_losses", {}), evaluation=evaluation,
                                 repo_id=config.run.push_to_hub,
                                 gguf=f"student-{config.run.gguf}.gguf" if config.run.gguf else None)
    return write

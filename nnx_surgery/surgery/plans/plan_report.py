"""A surgery report a person can read: a terminal table and a PNG plot of what a plan keeps and why; and the
files both surgery paths write beside a student's weights (the plan and its report)."""
from __future__ import annotations

from typing import Callable

import numpy as np

from nnx_surgery.surgery.plans.plan_record import PLAN_FILE, Plan
from nnx_surgery.surgery.plans.vocab_selection import describe_vocab

REPORT_PNG, REPORT_TXT = "surgery_report.png", "surgery_report.txt"


def student_files(plan: Plan, report: bool = True) -> dict[str, Callable[[str], object]]:
    """Files written beside a student's weights, as {file name: writer(path)}: the plan, and (with `report`)
    its report as text and PNG. `save_student` and `prune_checkpoint` both pass these to the folder writer."""
    files: dict[str, Callable[[str], object]] = {PLAN_FILE: lambda path: plan.save(path)}
    if report:
        files[REPORT_TXT] = lambda path: _write_text(path, format_report(plan) + "\n")
        files[REPORT_PNG] = lambda path: plot_report(plan, path)
    return files


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def kept_fractions(plan: Plan) -> dict[str, tuple[int, int]]:
    """(kept, teacher) per axis, plus parameters."""
    t, s = plan.teacher_config, plan.student
    return {"layers": (s.num_hidden_layers, t.num_hidden_layers), "hidden": (s.hidden_size, t.hidden_size),
            "mlp": (s.intermediate_size, t.intermediate_size),
            "query heads": (s.num_attention_heads, t.num_attention_heads),
            "kv heads": (s.num_key_value_heads, t.num_key_value_heads), "vocab": (s.vocab_size, t.vocab_size),
            "parameters": (s.num_parameters(), t.num_parameters())}


def _layer_rows(plan: Plan) -> list[list[str]]:
    teacher = plan.teacher_config
    student_of = {t: s for s, t in enumerate(plan.kept_layers)}
    columns = [("block infl.", plan.scores.get("block_influence")), ("loss incr.", plan.scores.get("loss_increase")),
               ("heads", _sums(plan.scores.get("heads"))), ("mlp", _sums(plan.scores.get("mlp")))]
    rows = []
    for t in range(teacher.num_hidden_layers):
        kept = t in student_of
        row = [str(t), teacher.layer_types[t].replace("_attention", ""), str(student_of[t]) if kept else "-"]
        row += [f"{values[t]:.4g}" if values is not None else "" for _, values in columns]
        if kept:
            s = student_of[t]
            heads = plan.scores.get("heads")
            mlp = plan.scores.get("mlp")
            row.append(_share(heads[t], plan.flat_heads(s)) if heads else "")
            row.append(_share(mlp[t], plan.kept_mlp[s]) if mlp else "")
        else:
            row += ["", ""]
        rows.append(row)
    return rows


def format_report(plan: Plan) -> str:
    """Per-layer importance and per-axis kept fractions as a plain-text table."""
    header = ["teacher", "type", "student", "block infl.", "loss incr.", "heads imp.", "mlp imp.",
              "heads kept%", "mlp kept%"]
    rows = _layer_rows(plan)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [f"Surgery plan: {_title(plan)}  "
           f"(depth: {plan.methods.get('depth')}, width: {plan.methods.get('width')}, "
           f"kv: {plan.methods.get('kv')}, compensation: {plan.methods.get('compensation')})",
           "", line(header), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    out += ["", "kept per axis:"]
    for axis, (kept, total) in kept_fractions(plan).items():
        out.append(f"  {axis:<12} {kept:>14,} / {total:<14,} {100 * kept / total:6.1f}%")
    hidden = plan.scores.get("hidden")
    if hidden:
        out.append(f"  hidden importance kept: {_share(hidden, plan.kept_hidden)}")
    if plan.scores.get("vocab"):
        out.append(f"  {describe_vocab(plan.scores['vocab'])}")
    if plan.embed_scale != 1.0 or plan.final_norm_scale != 1.0:
        out.append(f"  embedding scale {plan.embed_scale:.6g}, final norm factor {plan.final_norm_scale:.6g}")
    effect = plan.scores.get("compensation")
    if effect:
        out.append(f"  KL(teacher || student) on calibration: compensated {effect['compensated']['kl']:.4g}, "
                   f"plain {effect['plain']['kl']:.4g}")
    kv = plan.kv_groups[0] if plan.kv_groups else []
    out.append(f"  KV heads (student layer 0): {kv} weights {plan.kv_weights[0] if plan.kv_weights else []}")
    return "\n".join(out)


def plot_report(plan: Plan, path: str) -> str:
    """A PNG: per-layer scores with the kept layers marked, kept fraction per axis, sorted hidden importance."""
    # Imported here: matplotlib is slow to import and only this function draws. No pyplot: no global backend or
    # figure state.
    from matplotlib.figure import Figure

    teacher = plan.teacher_config
    fig = Figure(figsize=(15, 4.2))
    axes = fig.subplots(1, 3)
    layers = np.arange(teacher.num_hidden_layers)
    kept = np.isin(layers, plan.kept_layers)
    depth_key = "loss_increase" if plan.scores.get("loss_increase") else "block_influence"
    values = plan.scores.get(depth_key) or _sums(plan.scores.get("mlp")) or [0.0] * len(layers)
    axes[0].bar(layers, values, color=np.where(kept, "tab:blue", "lightgray"))
    axes[0].set(title=f"per-layer {depth_key if plan.scores.get(depth_key) else 'MLP importance'} "
                      "(grey: removed)", xlabel="teacher layer")
    fractions = kept_fractions(plan)
    axes[1].barh(list(fractions), [100 * k / t for k, t in fractions.values()], color="tab:green")
    axes[1].set(title="kept per axis (%)", xlim=(0, 100))
    hidden = plan.scores.get("hidden")
    if hidden:
        order = np.argsort(hidden)[::-1]
        mask = np.isin(order, plan.kept_hidden)
        axes[2].scatter(np.arange(len(order)), np.asarray(hidden)[order], s=4,
                        c=np.where(mask, "tab:blue", "lightgray"))
        axes[2].set(title="hidden channel importance (sorted)", xlabel="rank", yscale="log"
                    if min(hidden) > 0 else "linear")
    fig.suptitle(_title(plan))
    fig.tight_layout()
    fig.savefig(path, dpi=80, format="png", metadata={"Software": None})
    return path


def _title(plan: Plan) -> str:
    spec = plan.spec
    shape = (f"{spec['num_layers']} layers, hidden {spec['hidden_size']}, mlp {spec['intermediate_size']}, "
             f"{spec['num_attention_heads']} heads / {spec['num_key_value_heads']} KV")
    if spec.get("vocab_size") is not None:
        shape += f", vocab {plan.student_config['vocab_size']}"
    student = f"{spec['name']} ({shape})" if spec.get("name") else shape
    return f"{plan.teacher.get('source') or 'teacher'} -> {student}"


def _sums(table) -> list[float] | None:
    return [float(np.sum(row)) for row in table] if table else None


def _share(values, kept) -> str:
    values = np.asarray(values, dtype=np.float64)
    total = values.sum()
    return f"{100 * values[list(kept)].sum() / total:.1f}%" if total > 0 else "n/a"

"""The demo's size-quality trade-off: `make demo`'s recipe run with several student shapes at the same wall time.

    python bench/student_sweep.py --run mlp1024-v16k --out bench/results/student-sweep.jsonl   # one shape
    python bench/student_sweep.py --report bench/results/student-sweep.jsonl                   # table and plot

Each shape (SHAPES: MLP width 512 / 768 / 1024 / 1536, vocabulary 16k / 32k) is the gemma3-270m preset with
`--student SHAPE --steps STEPS --eval-prompts 8`: the same teacher, data, batches, evaluation (the 8 held-out
prompts the preset had when the sweep ran; it now has 16) and paired control as `make demo`.
A larger student's steps cost more, so it gets fewer of them: STEPS is chosen so that the whole run takes about
the demo's wall time on a quiet 2-core machine (the record keeps the measured wall time; the report flags a run
more than 10% off the first shape's). A run folder that already holds results.json is read, not rerun.

Per shape the record keeps: parameters (and their share of the teacher's), the student's safetensors and q8_0
GGUF sizes, per-byte gap closure on both held-out sets for the distilled student and the control (the share of
the pruned-to-teacher gap in CE per byte that training closed), KL to the teacher, the paired distilled-minus-
control intervals, and the degeneration of greedy continuations (share that loops, distinct-2) beside the
teacher's. `--report` prints the Markdown table of BENCHMARKS.md and writes the quality-against-size plot.

Eight prompts give a share that loops in steps of 12.5%, too coarse for "no more often than 1.5x the teacher"
when the teacher loops in one of eight. `--loops RESULTS` adds the loop share of more continuations, from one
`nnx-surgery eval` of every run's distilled student beside the teacher (the demo's data and seed, e.g.
`--eval-prompts 32`; its results.json), matched to the shapes by run folder:

    nnx-surgery eval --teacher gguf:gemma3-270m --corpus-bytes 4000000 --eval-prompts 32 --eval-tokens 1024 \
        --no-general-eval --choice-items 4 -o bench/out/sweep-loops bench/out/sweep/*/student
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "recipes", "gemma_7b_to_2b.py")

# name -> (--student, --steps): steps chosen for about the demo's wall time (the demo: mlp=512 at 24 steps)
SHAPES = {
    "mlp512-v16k": ("layers=18,mlp=512,vocab=16384", 24),
    "mlp768-v16k": ("layers=18,mlp=768,vocab=16384", 20),
    "mlp1024-v16k": ("layers=18,mlp=1024,vocab=16384", 18),
    "mlp1536-v16k": ("layers=18,mlp=1536,vocab=16384", 15),
    "mlp512-v32k": ("layers=18,mlp=512,vocab=32768", 20),
    "mlp1024-v32k": ("layers=18,mlp=1024,vocab=32768", 16),
}
PROMPTS = 8  # the preset's held-out prompts when the sweep ran (the demo now has 16): the steps fit that wall time
SETS = (("in-domain", "loss_per_byte", "kl_to_teacher"), ("general", "general_loss_per_byte", "general_kl"))
GOAL = {"max_share": 0.40, "min_closure": 0.65, "max_loop_ratio": 1.5}


def run_shape(name: str, shape: str, steps: int, runs: str, extra: list[str]) -> str:
    """The recipe run of one shape in `runs`/NAME (its console in NAME.log); an existing finished run is kept."""
    folder = os.path.join(runs, name)
    if os.path.exists(os.path.join(folder, "results.json")):
        return folder
    command = [sys.executable, RECIPE, "--preset", "gemma3-270m", "--student", shape, "--steps", str(steps),
               "--eval-prompts", str(PROMPTS), "--output", folder, "--resume", *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(folder + ".log", "w", encoding="utf-8") as log:
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    return folder


def closure(pruned: float, model: float, teacher: float) -> float:
    """The share of the pruned-to-teacher gap that training closed (1: the teacher's loss; 0: no change)."""
    return (pruned - model) / (pruned - teacher)


def record(name: str, shape: str, steps: int, folder: str) -> dict:
    """One shape's figures from its run folder (results.json and the q8_0 GGUF)."""
    with open(os.path.join(folder, "results.json"), encoding="utf-8") as handle:
        results = json.load(handle)
    rows = {row["model"]: row for row in results["rows"]}
    teacher, pruned = rows["teacher"], rows["pruned (before distillation)"]
    models = {"distilled": rows["distilled student"], "control": rows["CE-retrained pruned student (control)"]}
    gguf = os.path.join(folder, "student-q8_0.gguf")
    out = {"name": name, "student": shape, "steps": steps, "wall_time_s": results["wall_time_s"],
           "phase_times_s": results["phase_times_s"], "parameters": pruned["parameters"],
           "share": pruned["parameters"] / teacher["parameters"], "safetensors_bytes": pruned["safetensors_bytes"],
           "gguf_q8_0_bytes": os.path.getsize(gguf) if os.path.exists(gguf) else None,
           "teacher": {"loop_share": teacher["loop_share"], "distinct_2": teacher["distinct_2"]},
           "pruned": {"loop_share": pruned["loop_share"], "distinct_2": pruned["distinct_2"]},
           "teacher_ce_per_byte": {set_name: teacher[key] for set_name, key, _ in SETS},
           "pruned_ce_per_byte": {set_name: pruned[key] for set_name, key, _ in SETS},
           "same_batches": results.get("pairing", {}).get("batches", {}).get("same")}
    for label, row in models.items():
        entry = {"loop_share": row["loop_share"], "distinct_2": row["distinct_2"]}
        for set_name, key, kl in SETS:
            entry[set_name] = {"ce_per_byte": row[key], "kl": row[kl],
                               "closure": closure(pruned[key], row[key], teacher[key])}
        out[label] = entry
    for set_name, _, _ in SETS:
        pair = next(c for c in results["sets"][set_name]["comparisons"]
                    if c["a"] == "distilled student" and c["b"].startswith("CE-retrained"))
        out["distilled"][set_name]["minus_control"] = pair["ce_per_byte"]
    out["meets_goal"] = meets_goal(out)
    return out


def meets_goal(entry: dict, teacher_loops: float | None = None) -> bool:
    """The goal for the demo's student: at most 40% of the teacher, at least 65% of the gap closed per byte on
    both sets, loops no more often than 1.5x the teacher (over the more prompts of `--loops` when given)."""
    student = entry["distilled"]
    loops, reference = student["loop_share"], entry["teacher"]["loop_share"]
    if teacher_loops is not None and "loops_more" in entry:
        loops, reference = entry["loops_more"], teacher_loops
    return (entry["share"] <= GOAL["max_share"]
            and all(student[s]["closure"] >= GOAL["min_closure"] for s, _, _ in SETS)
            and loops <= GOAL["max_loop_ratio"] * reference)


def add_loops(records: list[dict], path: str) -> dict:
    """Each record's `loops_more` (the distilled student's loop share over the eval's prompts) from an
    `nnx-surgery eval` results.json whose rows are RUN/student folders; returns the teacher's row there."""
    with open(path, encoding="utf-8") as handle:
        rows = json.load(handle)["rows"]
    by_run = {os.path.basename(os.path.dirname(os.path.normpath(row["model"]))): row for row in rows[1:]}
    for entry in records:
        if entry["name"] in by_run:
            entry["loops_more"] = by_run[entry["name"]]["loop_share"]
            entry["meets_goal"] = meets_goal(entry, rows[0]["loop_share"])
    return rows[0]


def table(records: list[dict], loops_teacher: dict | None = None) -> str:
    """The Markdown table of BENCHMARKS.md: one row per shape, distilled (control) where both are shown."""
    base = records[0]["wall_time_s"]  # the smallest student's: the demo's shape before the sweep
    more = "" if loops_teacher is None else " | loops, more prompts"
    lines = ["| student | params (share) | safetensors / q8_0 GGUF | steps | wall time | above the teacher per byte, "
             "in / gen: pruned -> distilled (control) | gap closed in-domain | "
             f"gap closed general | KL in / gen | distilled - control per byte, in / gen | loops | distinct-2{more} | "
             "meets the goal |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if more else "")]
    for r in records:
        d, c = r["distilled"], r["control"]
        flag = "" if abs(r["wall_time_s"] / base - 1) <= 0.10 else " (over 10% off)"
        gguf = f"{r['gguf_q8_0_bytes'] / 2**20:.0f} MiB" if r["gguf_q8_0_bytes"] else "-"

        def above(s):
            t = r["teacher_ce_per_byte"][s]
            return (f"{r['pruned_ce_per_byte'][s] - t:.3f} -> {d[s]['ce_per_byte'] - t:.3f} "
                    f"({c[s]['ce_per_byte'] - t:.3f})")

        def pair(s):
            p = d[s]["minus_control"]
            return f"{p['difference']:+.4f} [{p['low']:+.4f}, {p['high']:+.4f}]"

        lines.append(
            f"| `{r['student']}` | {r['parameters'] / 1e6:.1f}M ({100 * r['share']:.1f}%) | "
            f"{r['safetensors_bytes'] / 2**20:.0f} MiB / {gguf} | {r['steps']} | {r['wall_time_s']:.0f} s{flag} | "
            f"{above('in-domain')} / {above('general')} | "
            f"{100 * d['in-domain']['closure']:.0f}% ({100 * c['in-domain']['closure']:.0f}%) | "
            f"{100 * d['general']['closure']:.0f}% ({100 * c['general']['closure']:.0f}%) | "
            f"{d['in-domain']['kl']:.3f} / {d['general']['kl']:.3f} | {pair('in-domain')} / {pair('general')} | "
            f"{100 * d['loop_share']:.0f}% ({100 * c['loop_share']:.0f}%) | {d['distinct_2']:.3f} "
            f"({c['distinct_2']:.3f}) |" + ("" if not more else f" {100 * r['loops_more']:.0f}% |"
                                             if "loops_more" in r else " - |")
            + (" yes |" if r["meets_goal"] else " no |"))
    teacher = records[0]["teacher"]
    lines.append(f"\nTeacher: loops {100 * teacher['loop_share']:.0f}%, distinct-2 {teacher['distinct_2']:.3f}"
                 + ("" if loops_teacher is None else
                    f" (over the more prompts: loops {100 * loops_teacher['loop_share']:.0f}%)")
                 + ". Cells: distilled student (CE-retrained control).")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    """Against the student's share of the teacher's parameters, on both sets: the share of the pruned-to-teacher
    gap closed per byte (top) and the distance left to the teacher in nats per byte (bottom)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    xs = [100 * r["share"] for r in records]
    for column, (set_name, _, _) in enumerate(SETS):
        for label, marker in (("distilled", "o"), ("control", "s")):
            closed = [100 * r[label][set_name]["closure"] for r in records]
            left = [r[label][set_name]["ce_per_byte"] - r["teacher_ce_per_byte"][set_name] for r in records]
            axes[0, column].scatter(xs, closed, marker=marker, label=label)
            axes[1, column].scatter(xs, left, marker=marker, label=label)
        for r, x, y in zip(records, xs, [100 * r["distilled"][set_name]["closure"] for r in records]):
            axes[0, column].annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        axes[0, column].axhline(100 * GOAL["min_closure"], color="grey", linestyle="--", linewidth=0.8)
        axes[0, column].set_title(f"{set_name} held-out set")
        axes[1, column].set_xlabel("student parameters, % of the teacher")
    axes[0, 0].set_ylabel("pruned-to-teacher gap closed per byte, %")
    axes[1, 0].set_ylabel("CE per byte above the teacher's, nats")
    axes[0, 0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", default=[], choices=sorted(SHAPES), help="shape to run")
    parser.add_argument("--steps", type=int, help="override the shape's steps (one --run)")
    parser.add_argument("--runs", default=os.path.join(ROOT, "bench", "out", "sweep"), help="run folders")
    parser.add_argument("--out", help="JSON lines to append each shape's record to")
    parser.add_argument("--report", help="JSON lines of records: print the table, write the plot beside them")
    parser.add_argument("--loops", help="an `nnx-surgery eval` results.json of the runs' students (docstring)")
    args, extra = parser.parse_known_args(argv)
    os.makedirs(args.runs, exist_ok=True)
    for name in args.run:
        shape, steps = SHAPES[name]
        steps = args.steps or steps
        started = time.perf_counter()
        entry = record(name, shape, steps, run_shape(name, shape, steps, args.runs, extra))
        entry["measured_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps(entry))
        if args.out:
            with open(args.out, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry) + "\n")
    if args.report:
        with open(args.report, encoding="utf-8") as handle:
            records = sorted((json.loads(line) for line in handle if line.strip()), key=lambda r: r["share"])
        teacher = add_loops(records, args.loops) if args.loops else None
        print(table(records, teacher))
        plot(records, os.path.splitext(args.report)[0] + ".png")


if __name__ == "__main__":
    main()

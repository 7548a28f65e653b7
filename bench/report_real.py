"""BENCHMARKS.md section: the real Gemma 3 270M (GGUF import, generation, the demo's distillation step, the demo's
quality table, the recovery curves, GGUF export and llama.cpp decoding).

    python bench/report_real.py [bench/results/real-270m.jsonl] > /tmp/section.md

Reads the committed records in bench/results/real-270m.jsonl and bench/results/gguf-export.jsonl (`gguf_export`
summaries from bench/gguf_export.py): `gguf_import` and `generate` summaries (from
bench/gguf_import.py and bench/generate.py), `demo` records (the rows, sets, step_stats, recovery_curves,
multiple_choice, phase_times_s and wall_time_s of a `make demo` results.json, with `bench: "demo"`, a description
and a verdict, appended as one JSON line; the newest is rendered) and `recovery` records (bench/real_recovery.py's lines).
`recipe_run` records (the rows, sets and curves of other recipe runs' results.json, quoted in bench/NOTES.md) are
kept for reference and not rendered.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # distill, for the intervals
import common  # noqa: E402

REAL_RESULTS = os.path.join(common.BENCH, "results", "real-270m.jsonl")
SWEEP_RESULTS = os.path.join(common.BENCH, "results", "student-sweep.jsonl")  # bench/student_sweep.py
SWEEP_LOOPS = os.path.join(common.BENCH, "results", "student-sweep-loops.json")
GGUF_EXPORT_RESULTS = os.path.join(common.BENCH, "results", "gguf-export.jsonl")  # bench/gguf_export.py
VOCAB, HIDDEN = 262_144, 640  # Gemma 3 270M
CPU_PEAK_GFLOPS = 180.0  # measured fp32 matmul peak of the 2-core development machine (bench/flops.py)


def read(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().startswith("{")]


def _latest(records: list[dict], bench: str, **match) -> dict | None:
    found = [r for r in records if r.get("bench") == bench and r.get("summary", True)
             and all(r.get(k) == v for k, v in match.items())]
    return found[-1] if found else None


def section_import(records: list[dict]) -> list[str]:
    if not _latest(records, "gguf_import"):
        return []
    lines = ["### GGUF import (Q4_K_M, 253 MB) -> HF folder", "",
             "`python bench/gguf_import.py --peers ours,transformers`: ours writes a complete HF folder (safetensors, "
             "tokenizer, configs); transformers' `from_pretrained(gguf_file=)` only builds the model in memory. "
             "Fresh process per run, file in the page cache.", "",
             "| dtype | ours (s) | ours peak RSS (GiB) | transformers (s) | transformers peak RSS (GiB) | speedup |",
             "|---|---|---|---|---|---|"]
    for dtype in ("float32", "bfloat16"):
        row = _latest(records, "gguf_import", dtype=dtype)
        if row:
            lines.append(f"| {dtype} | {row.get('ours_import_s')} | {row.get('ours_peak_rss_gib')} | "
                         f"{row.get('transformers_import_s')} | {row.get('transformers_peak_rss_gib')} | "
                         f"{row.get('speedup_vs_transformers')}x |")
    return lines + [""]


def section_generate(records: list[dict]) -> list[str]:
    if not _latest(records, "generate"):
        return []
    lines = ["### Generation: `surgery.generate` vs `transformers.generate` (greedy, float32, CPU)", "",
             "`python bench/generate.py`: the same prompts and lengths for both, medians of repeats in one run; "
             "`same tokens` checks both produced identical ids.", "",
             "| batch | prompt + new | ours prefill tok/s | transformers prefill tok/s | ratio | ours decode tok/s | "
             "transformers decode tok/s | ratio | same tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for batch in (1, 8):
        row = _latest(records, "generate", batch=batch)
        if row:
            lines.append(f"| {batch} | {row['prompt']} + {row['new']} | {row['ours_prefill_tokens_per_s']} | "
                         f"{row['transformers_prefill_tokens_per_s']} | {row['prefill_speedup']}x | "
                         f"{row['ours_decode_tokens_per_s']} | {row['transformers_decode_tokens_per_s']} | "
                         f"{row['decode_speedup']}x | {row['same_tokens']} |")
    return lines + [""]


def section_demo(records: list[dict]) -> list[str]:
    """The newest `demo` record; when it names a record it `replaces` (with `replaced_because`), that one follows
    under its own heading, so superseded figures stay beside the new ones with the reason."""
    demo = _latest(records, "demo")
    if not demo:
        return []
    lines = _demo_lines(demo, "### `make demo`: the main job")
    old = next((r for r in records if r.get("bench") == "demo" and r.get("run") == demo.get("replaces")), None)
    if old is not None:
        lines += _demo_lines(old, f"#### Before: `make demo` of {old['run']} ({demo.get('replaced_because', '')})")
    return lines


def _demo_lines(demo: dict, heading: str) -> list[str]:
    lines = [heading, "", f"{demo.get('description', '')}.", ""]
    if any("general_loss" in row for row in demo["rows"]):  # judged on both held-out sets
        lines += _demo_table_both_sets(demo)
    else:
        lines += ["| model | parameters (non-embedding) | held-out CE | perplexity | tokens | top-1 agreement | "
                  "KL to teacher | BLEU | ROUGE-L | next-line MC |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row in demo["rows"]:
            def cell(key, spec="{:.4f}"):
                return "-" if row.get(key) is None else spec.format(row[key])
            lines.append(f"| {row['model']} | {row['parameters'] / 1e6:.1f}M "
                         f"({row['non_embedding_parameters'] / 1e6:.1f}M) | {row['loss']:.4f} | "
                         f"{row['perplexity']:.2f} | {row['tokens']:,} | {cell('top1_agreement', '{:.2%}')} | "
                         f"{cell('kl_to_teacher')} | {cell('bleu', '{:.1f}')} | {cell('rouge_l', '{:.1f}')} | "
                         f"{cell('multiple_choice', '{:.2%}')} |")
    lines += ["", demo.get("verdict", ""), ""]
    vocab = next((row.get("vocab_size") for row in demo["rows"] if row.get("tokens")), None) or VOCAB  # trimmed?
    for phase, stats in (demo.get("step_stats") or {}).items():
        if stats:
            # distill.step_flops counts a trained head; the demo freezes the tied embedding, so the step skips the
            # head-gradient matmul (2 * V * D FLOPs per token, V the student's vocabulary): count only what runs.
            executed = stats["tflops_per_s"] * 1e3 - 2 * vocab * HIDDEN * stats["tokens_per_s"] / 1e9
            skipped = "the skipped head gradient"
            counted_whole = stats.get("teacher_head_counted") != "kept pieces"  # runs before 2026-12-05
            if phase != "control" and vocab < VOCAB and counted_whole:  # the trimmed teacher computes kept columns
                executed -= 2 * (VOCAB - vocab) * HIDDEN * stats["tokens_per_s"] / 1e9
                skipped += " and the teacher's head columns of the trimmed pieces"
            lines.append(f"- {phase} phase step: {stats['step_time_s']:.2f} s median ({stats['tokens_per_s']:.0f} "
                         f"tokens/s; {executed:.0f} GFLOP/s by `distill.step_flops`' count less {skipped} = "
                         f"{executed / CPU_PEAK_GFLOPS:.0%} of the {CPU_PEAK_GFLOPS:.0f} GFLOP/s matmul peak) over "
                         f"{stats['steps']} steps")
    lines.append(f"- wall time of the run (install excluded): {demo.get('wall_time_s', 0):.0f} s")
    parts = demo.get("evaluation_parts_s")  # the evaluation's own lines, "[eval ...] ... (N s)", summed by part
    if parts:
        teacher = demo.get("evaluation_teacher_s")
        listed = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in parts.items())
        lines.append("- the evaluation's parts: " + listed
                     + ("" if teacher is None else f"; of all these, the teacher's own passes {teacher:.0f} s"))
    curves = {k: v for k, v in (demo.get("recovery_curves") or {}).items() if v}
    if curves:
        steps = sorted({p["step"] for curve in curves.values() for p in curve})
        caption = ("Recovery curves of this run (CE on the run's packed held-out batches at each evaluation, not "
                   "the passages of the table):" if "general_loss" in demo["rows"][0] else
                   "Recovery curves of this run (held-out CE at each evaluation; the teacher is at "
                   f"{demo['rows'][0]['loss']:.4f}):")
        lines += ["", caption, "",
                  "| run | " + " | ".join(f"step {s}" for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
        for name, curve in curves.items():
            by_step = {p["step"]: p["ce"] for p in curve}
            lines.append(f"| {name} | " + " | ".join(f"{by_step[s]:.4f}" if s in by_step else "-" for s in steps)
                         + " |")
    return lines + [""]


def _demo_table_both_sets(demo: dict) -> list[str]:
    """The demo's rows on its held-out sets (in-domain, general and, in records from 2026-12-06 on, far-domain: CE
    per token and per byte, KL and top-1 agreement with the teacher), as the recipe's results table has them."""
    from nnx_surgery.recipes.compress.reporting import COLUMNS  # the recipe's own results table's columns

    columns = [c for c in COLUMNS if c[0] in ("loss", "loss_per_byte") or any(c[0] in r for r in demo["rows"])]
    lines = ["| model | parameters (non-embedding) | tokens | " + " | ".join(c[1] for c in columns) + " |",
             "|---" * (3 + len(columns)) + "|"]
    for row in demo["rows"]:
        cells = ["-" if row.get(key) is None else spec.format(row[key]) for key, _, spec in columns]
        lines.append(f"| {row['model']} | {row['parameters'] / 1e6:.1f}M ({row['non_embedding_parameters'] / 1e6:.1f}M)"
                     f" | {row['tokens']:,} | " + " | ".join(cells) + " |")
    return lines


def section_recovery(records: list[dict]) -> list[str]:
    points = [r for r in records if r.get("bench") == "recovery" and "run" in r]
    if not points:
        return []
    runs: dict[str, list[dict]] = {}
    for point in points:
        runs.setdefault(point["series"], []).append(point)
    steps = sorted({p["step"] for p in points})
    lines = ["### Recovery curves: held-out CE after each number of steps, same student, same batches", "",
             points[0].get("setup", ""), "",
             "| recipe | " + " | ".join(f"step {s}" for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for name, series in runs.items():
        by_step = {p["step"]: p["ce"] for p in series}
        lines.append(f"| {name} | " + " | ".join(f"{by_step[s]:.4f}" if s in by_step else "-" for s in steps) + " |")
    return lines + [""]


SETUP_KEYS = ("student", "steps", "batch", "lr", "warmup", "corpus_bytes", "general_mix", "restart_rows",
              "teacher_correction", "teacher_correction_lr", "seed", "eval_tokens")


def _setup(record: dict, defaults: dict) -> tuple:
    """The record's setup (SETUP_KEYS); keys older records lack take `defaults` (bench/real_recovery.py's)."""
    if not record.get("teacher_correction"):
        record = {**record, "teacher_correction_lr": defaults["teacher_correction_lr"]}  # unused without it
    return tuple(record.get(key, defaults[key]) for key in SETUP_KEYS)


def section_recovery_sets(records: list[dict]) -> list[str]:
    """bench/real_recovery.py's records judged on both held-out sets: one table per setup (corpus mix, restart
    rows, teacher correction), each arm at each scored step, the share of the pruned-to-teacher gap closed, and
    each arm against the CE arm of its setup at the same step (95% interval, paired bootstrap over documents)."""
    import real_recovery

    found = [r for r in records if r.get("bench") == "recovery2"]
    if not found:
        return []
    defaults = real_recovery.setup_of(real_recovery.parse_args([]))
    setups: dict[tuple, list[dict]] = {}
    for record in found:
        setups.setdefault(_setup(record, defaults), []).append(record)
    lines = ["### Recovery on both held-out sets: in-domain (held-out stdlib modules) and general (held-out pydoc "
             "topics, English prose)", "",
             "`bench/real_recovery.py`: the same pruned student and the same batches for every arm of a setup; "
             "CE in nats/token, KL(teacher || student); `vs CE arm`: this arm's CE minus the CE arm's on the same "
             "passages, with a 95% interval (paired bootstrap over documents).", ""]
    for key, group in setups.items():
        setup = dict(zip(SETUP_KEYS, key))
        lines += [f"Setup: student {setup['student']}, {setup['steps']} steps of {setup['batch']}, general prose "
                  f"{setup['general_mix']:.0%} of the corpus, rows restarted with BOS: {setup['restart_rows']}, "
                  f"teacher correction: {_correction(setup)}, seed {setup['seed']}, "
                  f"{setup['eval_tokens']:,} tokens per held-out set.", ""]
        lines += _sets_table(group)
        runs = list(dict.fromkeys(r["run"] for r in group if "run" in r))
        steps = sorted({r["step"] for r in group if "run" in r} - {setup["steps"]})
        lines += ["Reproduce:", "",
                  f"    {real_recovery.command_line(setup, runs, steps)}", ""]
    return lines


def _correction(setup: dict) -> str:
    steps = setup["teacher_correction"]
    return f"{steps} steps at lr {setup['teacher_correction_lr']:g}" if steps else "none"


def _sets_table(group: list[dict]) -> list[str]:
    from nnx_surgery.evaluation.heldout_sets import HeldoutSet, paired_interval
    import numpy as np

    teacher = next(r for r in group if r.get("event") == "teacher")
    pruned = next(r for r in group if r.get("event") == "pruned")
    lines = ["| arm | step | in-domain CE | closed | general CE | closed | general KL | general top-1 | "
             "in-domain vs CE arm at its rate | general vs CE arm at its rate |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, record in (("teacher", teacher), ("pruned", pruned)):
        lines.append(f"| {name} | 0 | {record['in-domain']['ce']:.4f} | - | {record['general']['ce']:.4f} | - | "
                     f"{abs(record['general']['kl']):.3f} | {record['general']['top1']:.1%} | - | - |")
    # each arm against the CE arm of the same step and learning rate (the `@LR` of its name)
    ce_arms = {(r["step"], str(r["run"]).partition("@")[2]): r for r in group
               if str(r.get("run", "")).startswith("ce")}

    def versus(record, part):
        base = ce_arms.get((record["step"], str(record["run"]).partition("@")[2]))
        if base is None or base is record:
            return "-"
        mine, theirs = record[part], base[part]
        held = HeldoutSet(part, np.zeros((len(mine["passage_nll"]), 1), np.int32),
                          np.ones((len(mine["passage_nll"]), 1), np.float32), np.asarray(mine["passage_documents"]),
                          np.ones(len(mine["passage_nll"]), np.int64))
        scores = [{"nll": np.asarray(x["passage_nll"]), "kl": np.asarray(x["passage_kl"]),
                   "agree": np.zeros(len(x["passage_nll"])), "tokens": np.asarray(x["passage_tokens"], float)}
                  for x in (mine, theirs)]
        point, low, high = paired_interval(scores[0], scores[1], held, "ce")
        return f"{point:+.4f} [{low:+.4f}, {high:+.4f}]" if low is not None else f"{point:+.4f}"

    for record in (r for r in group if "run" in r):
        closed = [(pruned[part]["ce"] - record[part]["ce"]) / (pruned[part]["ce"] - teacher[part]["ce"])
                  for part in ("in-domain", "general")]
        lines.append(f"| {record['run']} | {record['step']} | {record['in-domain']['ce']:.4f} | {closed[0]:.0%} | "
                     f"{record['general']['ce']:.4f} | {closed[1]:.0%} | {record['general']['kl']:.3f} | "
                     f"{record['general']['top1']:.1%} | {versus(record, 'in-domain')} | {versus(record, 'general')} |")
    return lines + [""]


GGUF_MODELS = ("teacher", "pruned", "vocab")


def section_gguf_export(records: list[dict]) -> list[str]:
    """bench/gguf_export.py's summaries: file sizes and export times per type, then decode tokens/s of llama.cpp on
    the exports beside `surgery.generate` in the same run, and whether the greedy tokens agree."""
    rows = [row for row in (_latest(records, "gguf_export", model=m) for m in GGUF_MODELS) if row]
    if not rows:
        return []
    first = rows[0]
    cores, m = first["machine"]["cores"], first["machine"]
    loads = sorted(row["loadavg"][0] for row in rows)
    lines = ["### GGUF export and llama.cpp (CPU)", "",
             f"`python bench/gguf_export.py` ({m['date']}, {m['cpu']}, {cores} cores shared with other jobs: 1-minute "
             f"load average {loads[0]}-{loads[-1]} at the models' summaries): the real 270M and two students pruned "
             "from it (data-free; the trimmed vocabulary planned on stdlib source), exported by "
             "`export.export_gguf`, each export type in a fresh process, median of 3 (f32: once), folder in the "
             "page cache.", "",
             "| model | safetensors (float32) | " + " | ".join(f"{d} GGUF" for d in ("f32", "f16", "q8_0", "q4_0"))
             + " |", "|---|---|---|---|---|---|"]
    for row in rows:
        cells = [f"{row[f'{d}_gguf_bytes'] / 1e6:.0f} MB in {row[f'{d}_export_s']:.1f} s"
                 if row.get(f"{d}_gguf_bytes") else "-" for d in ("f32", "f16", "q8_0", "q4_0")]
        lines.append(f"| {row['model']} ({row['spec']}) | {row['safetensors_bytes'] / 1e6:.0f} MB | "
                     + " | ".join(cells) + " |")
    lines += ["", f"Greedy decoding, batch 1, {first['prompt']} prompt tokens (stdlib source) + {first['new']} new, "
              "median tokens/s of 3 runs after a warm-up, the peers one after the other in one run. Ours: "
              "`surgery.generate`, jitted, float32 weights and KV cache. llama.cpp (llama-cpp-python "
              f"{first['versions'].get('llama_cpp', '?')}): the exported file, KV cache in float32, argmax of its "
              f"logits fed back, n_threads {cores} (the cores) and 1. Ratio: llama.cpp / ours. `tokens`: llama.cpp's "
              "greedy tokens against ours (all equal, or how many leading ones are).", "",
              f"| model | file | ours tok/s | llama.cpp n_threads={cores} tok/s | ratio | llama.cpp n_threads=1 "
              "tok/s | ratio | tokens |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for dtype in ("f32", "f16", "q8_0"):
            if f"llama_{dtype}_decode_tokens_per_s" not in row and f"llama_{dtype}_t1_decode_tokens_per_s" not in row:
                continue
            same = row.get(f"llama_{dtype}_same_tokens")
            agree = row.get(f"llama_{dtype}_agree_prefix", row.get(f"llama_{dtype}_t1_agree_prefix"))
            tokens = ("all equal" if same or row.get(f"llama_{dtype}_t1_same_tokens")
                      else f"first {agree} of {row['new']} equal" if agree is not None else "-")
            lines.append(f"| {row['model']} | {dtype} | {common.fmt(row['ours_decode_tokens_per_s'], 1)} | "
                         f"{common.fmt(row.get(f'llama_{dtype}_decode_tokens_per_s'), 1)} | "
                         f"{common.fmt(row.get(f'llama_{dtype}_vs_ours'), 2, 'x')} | "
                         f"{common.fmt(row.get(f'llama_{dtype}_t1_decode_tokens_per_s'), 1)} | "
                         f"{common.fmt(row.get(f'llama_{dtype}_t1_vs_ours'), 2, 'x')} | {tokens} |")
    return lines + [""]


def _sweep_records(path: str, loops: str) -> tuple[list[dict], dict | None]:
    """The sweep's records by size, with the loop shares over more prompts (and that run's teacher row) when
    measured."""
    import student_sweep

    records = sorted(read(path), key=lambda r: r["share"])
    return records, student_sweep.add_loops(records, loops) if os.path.exists(loops) else None


def section_student_sweep(path: str = SWEEP_RESULTS, loops: str = SWEEP_LOOPS) -> list[str]:
    """The demo's size-quality trade-off at its wall time (bench/student_sweep.py's records), with the loop
    shares over more prompts where they were measured."""
    import student_sweep

    if not os.path.exists(path):
        return []
    records, teacher = _sweep_records(path, loops)
    kept = [r["student"] for r in records if r["meets_goal"]]
    lines = ["### The demo's student: size against quality at the demo's wall time (`python bench/student_sweep.py`)",
             "", "Each row is `make demo`'s recipe with `--student SHAPE --steps STEPS --eval-prompts 8`: the "
             "same teacher, data, batches, evaluation and paired control; a larger student's steps cost more, so "
             "it gets fewer, for about the same wall time (one run at a time on the 2-core machine). Goal: at "
             "most 40% of the teacher, at least 65% of the pruned-to-teacher gap closed per byte on both held-out "
             "sets, loops no more often than 1.5x the teacher. Met by: "
             + (", ".join(f"`{k}`" for k in kept) or "none") + ".", "",
             student_sweep.table(records, teacher), "",
             "![gap closed and distance to the teacher against size](bench/results/student-sweep.png)", ""]
    return lines


def sweep_target_rows(path: str = SWEEP_RESULTS, loops: str = SWEEP_LOOPS) -> list[tuple[str, str, bool]]:
    """The targets-at-a-glance row of the demo's student (the gemma3-270m preset's shape in the sweep)."""
    preset = os.path.join(os.path.dirname(common.BENCH), "nnx_surgery", "recipes", "config", "presets",
                          "gemma3-270m.json")
    if not os.path.exists(path) or not os.path.exists(preset):
        return []
    with open(preset, encoding="utf-8") as handle:
        shape = json.load(handle)["student"]["shape"]
    records, teacher = _sweep_records(path, loops)
    demo = next((r for r in records if r["student"] == shape), None)
    if demo is None:
        return []
    d = demo["distilled"]
    loops_text = (f"loops {d['loop_share']:.0%} (teacher {demo['teacher']['loop_share']:.0%})" if teacher is None
                  or "loops_more" not in demo else
                  f"loops {demo['loops_more']:.0%} over more prompts (teacher {teacher['loop_share']:.0%})")
    value = (f"`{shape}`, {demo['share']:.1%} of the teacher: {d['in-domain']['closure']:.0%} / "
             f"{d['general']['closure']:.0%} closed, {loops_text}")
    return [("Demo student at the demo's wall time: <= 40% of the teacher, >= 65% of the gap closed per byte on "
             "both sets, loops <= 1.5x the teacher", value, demo["meets_goal"])]


def render(records: list[dict]) -> list[str]:
    body = (section_demo(records) + section_student_sweep() + section_recovery_sets(records) + section_recovery(records)
            + section_import(records) + section_generate(records) + section_gguf_export(records))
    return ["## Real Gemma 3 270M (offline, CPU)", ""] + body if body else []


def main(argv=None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    records = read(args[0]) if args else read(REAL_RESULTS) + read(GGUF_EXPORT_RESULTS)
    print("\n".join(render(records)))


if __name__ == "__main__":
    main()

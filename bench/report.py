"""Write BENCHMARKS.md from the JSON lines the benchmark scripts printed (bench/run_all.sh calls this).

    python bench/report.py bench/out/results.jsonl > BENCHMARKS.md

For every benchmark the latest summary line wins (so a partial re-run updates only its section); the per-run lines
of that same run id give the spread. Targets are checked from the numbers; where one is missed the section says by
how much, and the cause and remedy found when it was investigated (NOTES below; keep them in step with the code).
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import fmt, latest  # noqa: E402
from report_gpu import GPU_MFU_TARGET, GPU_RESULTS, gpu_run, section_gpu  # noqa: E402
import report_aot  # noqa: E402
import report_lm_eval  # noqa: E402
import report_tpu  # noqa: E402
import report_real  # noqa: E402

PEER_NAMES = {"ours": "ours (`load_pretrained` / `distill.run`)",
              "ours-fast": "ours, aligned reads (bench/fastload.py)",
              "torch": "PyTorch + transformers", "tunix": "Tunix 0.1.7"}
NOTES_FILE = os.path.join(common.BENCH, "NOTES.md")


def read_records(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    try:
                        records.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass
    return records


def runs_of(records: list[dict], summary: dict, **match) -> list[dict]:
    return [r for r in records if not r.get("summary") and r.get("run") == summary.get("run")
            and all(r.get(k) == v for k, v in match.items())]


def spread(values: list[float], digits: int = 2) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}"


LOAD_LAYOUTS = {"aligned": "Our writer's layout: tensor data 64-byte aligned in the file, so ours maps it (no copy)",
                "hub": "Hub layout (the safetensors library's, as transformers and the Hub write files): same tensors, "
                       "data not 64-byte aligned (7 Hub files in 8), so ours copies every byte"}


def _load_summary(records: list[dict], cache: str, layout: str) -> dict | None:
    found = [r for r in records if r.get("bench") == "load" and r.get("summary") and r.get("cache") == cache
             and r.get("layout", "aligned") == layout]  # lines from before layouts were measured: aligned
    return found[-1] if found else None


def section_load(records: list[dict]) -> list[str]:
    out = ["## 1. Loading a checkpoint into memory (CPU)", ""]
    measured = {layout: (_load_summary(records, "warm", layout), _load_summary(records, "cold", layout))
                for layout in LOAD_LAYOUTS}
    measured = {layout: pair for layout, pair in measured.items() if pair[0] or pair[1]}
    if not measured:
        return out + ["Not measured yet (`python bench/load.py`).", ""]
    any_summary = next(s for pair in measured.values() for s in pair if s)
    gb = any_summary["checkpoint_bytes"] / 1e9
    out += [f"Run `{any_summary.get('run')}`: `python bench/load.py --shape gemma-2-2b --peers ours,torch,tunix "
            "--cache warm,cold --layouts aligned,hub`.", "",
            f"Checkpoint: `{any_summary['checkpoint'].removesuffix('-hub')}` shape, bf16, {gb:.2f} GB in "
            "safetensors shards, in two file layouts (below); every peer keeps bf16. Time from the loader call to "
            "every parameter resident; peak RSS of the whole process. Warm: files in the page cache; cold: evicted "
            "before every run. Medians over repeats; speed-up = median of the same-repeat ratios peer time / our "
            "time.", ""]
    targets = []
    for layout, (warm, cold) in measured.items():
        summary = warm or cold
        starts = summary.get("data_start_mod_64")
        out += [f"**{LOAD_LAYOUTS[layout]}** (`{summary['checkpoint']}`"
                + (f", data starts at {', '.join(map(str, starts))} mod 64" if starts is not None else "") + "):",
                "", "| peer | warm load s (range) | cold load s (range) | peak RSS GiB | peak RSS / checkpoint bytes | "
                "RSS growth during load / checkpoint bytes | our speed-up (warm / cold) |",
                "|---|---|---|---|---|---|---|"]
        peers = [p for p in ("ours", "ours-fast", "torch", "tunix") if summary.get(f"{p}_runs")]
        for peer in peers:
            row = [PEER_NAMES.get(peer, peer)]
            for s in (warm, cold):
                if s and s.get(f"{peer}_load_s") is not None:
                    times = [r.get("load_s") for r in runs_of(records, s, bench="load", peer=peer, cache=s["cache"])
                             if r.get("layout", "aligned") == layout]
                    row.append(f"{s[f'{peer}_load_s']:.2f} ({spread(times)})")
                else:
                    row.append("n/a")
            rss = summary.get(f"{peer}_peak_rss_gib")
            row += [fmt(rss), fmt(None if rss is None else rss * common.GIB / summary["checkpoint_bytes"]),
                    fmt(summary.get(f"{peer}_rss_growth_over_checkpoint"))]
            if peer == "ours":
                row.append("—")
            elif peer == "ours-fast":  # not a peer: how much faster the proposed read path is than ours
                row.append(" / ".join(fmt(1 / v if v else None, 2, "x faster than ours") for v in
                                      ((s or {}).get("speedup_vs_ours-fast") for s in (warm, cold))))
            else:
                row.append(" / ".join(fmt((s or {}).get(f"speedup_vs_{peer}"), 2, "x") for s in (warm, cold)))
            out.append("| " + " | ".join(row) + " |")
        out += [""]
        speed = [(s or {}).get("speed_target_met") for s in (warm, cold)]
        targets.append(f"{layout}: faster than every peer warm {fmt(speed[0])}, cold {fmt(speed[1])}; peak RSS "
                       f"<= 1.15x checkpoint bytes: {fmt(summary.get('ours_peak_rss_over_checkpoint'))}x "
                       f"({fmt(summary.get('rss_target_met'))})")
    missing = [layout for layout in LOAD_LAYOUTS if layout not in measured]
    out += ["**Targets** (both layouts): " + "; ".join(targets)
            + "".join(f"; {layout}: **not measured**" for layout in missing) + ".", ""]
    return out


READER_NAMES = {"package": "`prune_checkpoint` (the package's code)",
                "rows": "`prune_checkpoint` + row reader (prototype of 2026-11-29, since merged)",
                "rows+pipeline": "`prune_checkpoint` + row reader + pipelined writer (prototype of 2026-11-29, since "
                                 "merged)"}


def section_prune(records: list[dict]) -> list[str]:
    out = ["## 2. Surgery from disk: 7B-shaped teacher -> 2B-shaped student (`prune_checkpoint`)", ""]
    s = latest(records, bench="prune", summary=True)
    if not s or "readers" not in s:
        return out + ["Not measured yet (`python bench/prune.py`).", ""]
    runs = runs_of(records, s, bench="prune")
    reads = [r["seconds"] for r in runs if r.get("step") == "read" and "error" not in r]
    out += [f"Run `{s.get('run')}`: `python bench/prune.py --readers package`.", "",
            f"Teacher `{s['teacher']}`: {s['teacher_bytes'] / 1e9:.2f} GB bf16; student `{s['student']}`. Cold page "
            "cache for the teacher before every step; each step a fresh process; the reference read and the "
            "surgeries alternate within each repeat.", "",
            "| step | wall s (median, range) | peak RSS GiB | vs one sequential read of the teacher |",
            "|---|---|---|---|",
            f"| sequential read of the teacher's files (reference) | {fmt(s['read_s'])} ({spread(reads)}) | — | "
            f"1.00x "
            f"({fmt(s.get('read_gb_per_s'))} GB/s) |"]
    for reader, entry in s["readers"].items():
        times = [r["seconds"] for r in runs if r.get("reader") == reader and r.get("step") == "prune"
                 and "error" not in r]
        if entry.get("prune_s") is None and entry.get("stopped_after_s"):
            read_gb = (entry.get("read_bytes_when_stopped") or 0) / 1e9
            written = (entry.get("written_bytes_when_stopped") or 0) / 1e9
            out.append(f"| {READER_NAMES.get(reader, reader)} | **stopped after {entry['stopped_after_s']:.0f} s**: "
                       f"had read {read_gb:.0f} GB and written {written:.2f} of ~5 GB | — | > "
                       f"{entry['stopped_after_s'] / s['read_s']:.1f}x |")
            continue
        out.append(f"| {READER_NAMES.get(reader, reader)} | {fmt(entry.get('prune_s'))} ({spread(times)}) | "
                   f"{fmt(entry.get('peak_rss_gib'))} | {fmt(entry.get('prune_over_read'), 2, 'x')} |")
    out += [f"| `plan_student(teacher, '{s['student']}')`, data-free, made once (reader: {s.get('plan_reader')}) | "
            f"{fmt(s.get('plan_s'))} | {fmt(s.get('plan_peak_rss_gib'))} | — |", ""]
    package = s["readers"].get("package", {}).get("targets_met", {})
    out += [f"**Targets** (peak RSS < 3 GB; wall time <= 1.5x the read): "
            f"{fmt(package.get('rss_under_3gb'))} / {fmt(package.get('time_within_1.5x_read'))}.", ""]
    return out


def section_distill(records: list[dict]) -> list[str]:
    out = ["## 3. Distillation step: tokens/s and peak RSS", ""]
    found = False
    for scale, title in (("tiny", "Tiny (dispatch-bound)"), ("270m", "Gemma3-270M teacher, 262k vocabulary")):
        s = latest(records, bench="distill_step", summary=True, scale=scale)
        if not s:
            out += [f"### {title}", "", "Not measured yet "
                    f"(`python bench/distill_step.py --scale {scale}`).", ""]
            continue
        found = True
        out += [f"### {title}: batch {s['batch']} x {s['seq']}", "",
                f"Run `{s.get('run')}`: `python bench/distill_step.py --scale {scale} --repeats {s.get('repeats')} "
                f"--warmup {s.get('warmup')} --steps {s.get('steps')}`.",
                "", f"Counted FLOPs {s['step_gflop']:.2f} GFLOP/step; ideal at 180 GFLOP/s: "
                f"{s['ideal_tokens_per_s']:.1f} tokens/s. Each run: {s.get('warmup', '?')} warm-up + "
                f"{s.get('steps', '?')} measured steps in a fresh process; {s.get('repeats', '?')} repeats, peers "
                "alternating; medians over repeats of each run's median step.", "",
                "| peer | tokens/s | step s (per-run medians) | % of 180 GFLOP/s | peak RSS GiB | first loss |",
                "|---|---|---|---|---|---|"]
        for peer in ("ours", "tunix", "torch"):
            if not s.get(f"{peer}_runs"):
                if s.get(f"{peer}_errors"):
                    out.append(f"| {PEER_NAMES[peer]} | failed: {str(s[f'{peer}_errors'][0])[:80]} | | | | |")
                continue
            steps = [r.get("median_step_s") for r in runs_of(records, s, bench="distill_step", peer=peer, scale=scale)]
            frac = s.get(f"{peer}_fraction_of_peak")
            out.append(f"| {PEER_NAMES[peer]} | {fmt(s[f'{peer}_tokens_per_s'], 1)} | {fmt(s[f'{peer}_step_s'], 3)} "
                       f"({spread(steps, 3)}) | {fmt(None if frac is None else 100 * frac, 1)} | "
                       f"{fmt(s[f'{peer}_peak_rss_gib'])} | {fmt(s.get(f'{peer}_loss_first'), 7)} |")
        ratios = []
        for peer in ("tunix", "torch"):
            if s.get(f"speedup_vs_{peer}") is not None:
                each = ", ".join(f"{v:.2f}" for v in s.get(f"speedup_vs_{peer}_per_repeat", []))
                ratios.append(f"vs {peer}: {s[f'speedup_vs_{peer}']:.2f}x tokens/s"
                              + (f" (per repeat: {each})" if each else "") + f", {s[f'rss_vs_{peer}']:.2f}x peak RSS")
        out += ["", "Same-run ratios (ours / peer, median over repeats): " + "; ".join(ratios) + ".",
                f"First-step losses agree across peers to {fmt(s.get('loss_first_spread'), 8)} (same work).", ""]
        met = s.get("targets_met") or {}
        if met:
            out += ["**Targets:** " + ", ".join(f"{k} {s['targets'][k]}: {fmt(v)}" for k, v in met.items()) + ".", ""]
    if not found:
        out.append("")
    return out


def section_mesh(records: list[dict]) -> list[str]:
    out = ["## 4. Scaling: 1 vs 8 host CPU devices", ""]
    s = latest(records, bench="mesh", summary=True)
    if not s:
        return out + ["Not measured yet (`python bench/mesh.py`).", ""]
    runs = [r for r in records if r.get("bench") == "mesh" and not r.get("summary") and r.get("run") == s.get("run")]
    out += [f"Run `{s.get('run')}`: `python bench/mesh.py` (a 4-layer Gemma 3 teacher, vocab 4096, hidden 256, "
            "8 heads, 4 KV heads; a 2-layer pruned student; batch 8 x 64).", "",
            "Per-device bytes on the fullest device (float32); fraction = per-device bytes / 1-device bytes. "
            "Step times on 8 fake devices sharing 2 cores only show the sharded step runs.", "",
            "| mesh (fsdp, tp) | devices | student params / device | Adam state / device | teacher / device | "
            "fraction (params, Adam) | ideal 1/N | step s | first loss |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if "error" in r:
            out.append(f"| {r['mesh']} | failed: {r['error'][:60]} | | | | | | | |")
            continue
        mib = lambda key: f"{r[key] / 2**20:.2f} MiB"  # noqa: E731
        out.append(f"| {r['mesh']} | {r['devices']} | {mib('student_param_bytes_per_device')} | "
                   f"{mib('adam_bytes_per_device')} | {mib('teacher_bytes_per_device')} | "
                   f"{fmt(r.get('student_param_fraction_of_1_device'), 3)}, "
                   f"{fmt(r.get('adam_fraction_of_1_device'), 3)} | {fmt(r.get('ideal_fraction'), 3)} | "
                   f"{fmt(r.get('median_step_s'), 3)} | {fmt(r.get('loss_first'), 7)} |")
    out += ["", f"**Target:** per-device parameter and optimizer bytes fall as 1/N: {fmt(s.get('falls_as_1_over_n'))}"
            f"; largest first-loss difference to 1 device: {fmt(s.get('max_loss_first_diff'), 8)}.", ""]
    return out


def section_quality(records: list[dict]) -> list[str]:
    out = ["## 5. Model quality: distilled vs scratch student at equal tokens", ""]
    s = latest(records, bench="quality", summary=True)
    if not s:
        return out + ["Not measured yet (`python bench/quality.py`).", ""]
    out += [s.get("description", ""), "", "| model | parameters | training tokens | held-out CE (nats/token) | "
            "perplexity |", "|---|---|---|---|---|"]
    for row in s.get("rows", []):
        params = row.get("parameters")
        out.append(f"| {row['name']} | {fmt(None if params is None else params / 1e6, 3, 'M')} | "
                   f"{row.get('tokens', 'n/a'):,} | {fmt(row.get('ce'), 4)} | {fmt(row.get('perplexity'), 2)} |")
    out += ["", s.get("verdict", ""), ""]
    return out


def section_targets(records: list[dict]) -> list[str]:
    """One table with every target, the measured value and whether it is met."""
    rows = []
    warm = latest(records, bench="load", summary=True, cache="warm")
    cold = latest(records, bench="load", summary=True, cache="cold")
    if warm:
        def versus(summary):
            return ", ".join(f"{fmt((summary or {}).get(f'speedup_vs_{p}'), 2, 'x')} {p}" for p in ("torch", "tunix"))
        rows.append(("Load 2B on CPU: faster than every peer",
                     f"ours / peer speed: warm {versus(warm)}; cold {versus(cold)}",
                     warm.get("speed_target_met") and (cold or {}).get("speed_target_met")))
        rows.append(("Load 2B on CPU: peak RSS <= 1.15x checkpoint bytes",
                     f"{fmt(warm.get('ours_peak_rss_over_checkpoint'), 2, 'x')}", warm.get("rss_target_met")))
    prune = latest(records, bench="prune", summary=True)
    if prune and "readers" in prune:
        package = prune["readers"].get("package", {})
        rows.append(("Surgery 7B -> 2B: peak RSS < 3 GB", f"{fmt(package.get('peak_rss_gib'))} GiB",
                     (package.get("targets_met") or {}).get("rss_under_3gb")))
        rows.append(("Surgery 7B -> 2B: <= 1.5x one read of the teacher",
                     f"{fmt(package.get('prune_over_read'), 2, 'x')}",
                     (package.get("targets_met") or {}).get("time_within_1.5x_read")))
    for scale in ("270m", "tiny"):
        d = latest(records, bench="distill_step", summary=True, scale=scale)
        if not d:
            continue
        met = d.get("targets_met") or {}
        if scale == "270m":
            rows.append(("Distil 270M: >= 1.3x Tunix tokens/s", fmt(d.get("speedup_vs_tunix"), 2, "x"),
                         met.get("speedup_vs_tunix")))
            rows.append(("Distil 270M: <= 0.6x Tunix peak RSS", fmt(d.get("rss_vs_tunix"), 2, "x"),
                         met.get("rss_vs_tunix")))
        label = "270M" if scale == "270m" else scale
        rows.append((f"Distil {label}: ahead of the PyTorch step", fmt(d.get("speedup_vs_torch"), 2, "x"),
                     met.get("speedup_vs_torch")))
    mesh = latest(records, bench="mesh", summary=True)
    if mesh:
        worst = max((m["adam_fraction"] / m["ideal"] for m in mesh.get("meshes", {}).values()), default=None)
        rows.append(("FSDP: per-device parameter and Adam bytes fall as 1/N",
                     f"{fmt(worst, 3)}x of 1/N at worst (replicated norm scales)",
                     mesh.get("falls_as_1_over_n")))
    quality = latest(records, bench="quality", summary=True)
    if quality and quality.get("distilled_minus_scratch_ce") is not None:
        rows.append(("Quality: distilled beats scratch at equal tokens",
                     f"{quality['distilled_minus_scratch_ce']:+.3f} nats/token",
                     quality.get("distilled_beats_scratch")))
    rows += report_aot.target_rows()
    rows += report_real.sweep_target_rows()
    rows += report_lm_eval.target_rows()
    rows += report_tpu.committed_target_rows()
    _, gpu_events = gpu_run(records)
    gpu_steps = [e for e in gpu_events if e.get("event") == "distill" and e.get("peer") == "ours" and e.get("mfu")]
    if gpu_steps:
        best = max(gpu_steps, key=lambda e: e["mfu"])
        rows.append(("GPU (H200): distillation step MFU >= 40 %",
                     f"{fmt(100 * best['mfu'], 1, ' %')} (batch {best['batch']} x {best['seq']})",
                     best["mfu"] >= GPU_MFU_TARGET))
    if not rows:
        return []
    out = ["## Targets at a glance", "", "| target | measured | met |", "|---|---|---|"]
    out += [f"| {name} | {value} | {fmt(bool(ok)) if ok is not None else 'n/a'} |" for name, value, ok in rows]
    return out + ["", "Causes and remedies of the misses: last section.", ""]


def render(records: list[dict]) -> str:
    starts = [r for r in records if r.get("bench") == "environment"]
    env = starts[-1] if starts else {"machine": common.machine(), "versions": common.versions()}
    m = env["machine"]
    lines = ["# Benchmarks", "",
             "Regenerated by `bash bench/run_all.sh` (CPU part; see bench/README.md for the scripts) from the JSON "
             "lines in `bench/out/results.jsonl`; each section shows the latest run of its script (run id = start "
             "time). The GPU check is `bash bench/gpu.sh`.", "",
             f"Machine: {m['cpu']}, {m['cores']} cores ({m['simd']}), {m['mem_gib']} GiB RAM, {m['os']}, no GPU; "
             f"shared with other jobs while measuring. Date: {m['date']} (each section's run id gives its start). "
             "Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items())
             + "; the Tunix peer: google-tunix 0.1.7 in its own venv (bench/.venv-tunix: jax 0.10.2, flax 0.12.8, "
             "safetensors 0.7.0).", "",
             "Method: every measurement runs in a fresh process (peak RSS = that process's `ru_maxrss`); peers "
             "alternate within each repeat; figures are medians over repeats and ratios are taken within the same "
             "run, never between runs (absolute times on this shared machine moved by up to 2x between runs while "
             "these were taken).",
             ""]
    for section in (section_targets, section_load, section_prune, section_distill, section_mesh, section_quality):
        lines += section(records)
    lines += report_aot.render()  # committed records: sizes compiled for TPU slices, the teacher cache
    lines += section_gpu(records)
    lines += report_real.render(report_real.read(report_real.REAL_RESULTS)  # committed real-270M records
                                + report_real.read(report_real.GGUF_EXPORT_RESULTS))
    lines += report_lm_eval.render()  # committed records: lm-eval requests/s against the hf backend
    if os.path.exists(NOTES_FILE):
        with open(NOTES_FILE) as f:
            lines += [f.read().rstrip(), ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    paths = (argv if argv is not None else sys.argv[1:]) or [os.path.join(common.OUT, "results.jsonl")]
    paths = [GPU_RESULTS, *paths]  # the committed GPU runs first, so a later GPU run in `paths` wins
    print(render(read_records(paths)))


if __name__ == "__main__":
    main()

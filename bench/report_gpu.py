"""The GPU section of BENCHMARKS.md (bench/report.py renders it): the latest H200 run of bench/gpu.sh, from the
committed raw lines in bench/results/gpu-h200.jsonl (GPU runs are rare) or a newer run among the given records."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import fmt, latest  # noqa: E402

GPU_MFU_TARGET = 0.40
GPU_RESULTS = os.path.join(common.BENCH, "results", "gpu-h200.jsonl")  # committed: GPU runs are rare


def gpu_run(records: list[dict]) -> tuple[dict | None, list[dict]]:
    start = latest(records, bench="gpu", event="start", backend="gpu")
    if not start:
        return None, []
    return start, [r for r in records if r.get("bench") == "gpu" and r.get("run") == start.get("run")]


def section_gpu(records: list[dict]) -> list[str]:
    out = ["## GPU check (`bash bench/gpu.sh`)", ""]
    start, events = gpu_run(records)
    if not start:
        tiny = latest(records, bench="gpu", event="start")
        out += ["Not run on a GPU yet: no accelerator was lent to the session that wrote this file. The script is "
                "prepared for one NVIDIA H200 (< 8 minutes: Gemma-2-2B-shaped teacher and a pruned 1.05B student, "
                "bf16; tokens/s and MFU against 989 TFLOP/s; load throughput) and was run here on CPU at tiny shapes"
                + (f" ({tiny.get('machine', {}).get('date', '')})." if tiny else "."), ""]
        return out
    versions = ", ".join(f"{k} {v}" for k, v in start.get("versions", {}).items())
    out += [f"Run `{start.get('run')}` on {start['device']} ({start.get('machine', {}).get('cores')} host cores), "
            f"{start.get('machine', {}).get('date', '')}; {versions}. Teacher: random Gemma-2-2B-shaped checkpoint "
            "(bf16, 5.2 GB); student: cut from it on disk (13 of 26 layers, MLP 9216 -> 3072, 1.05B parameters); "
            "sequence 1024, forward KL, bf16 compute, float32 master weights and AdamW; MFU = counted FLOPs "
            "(bench/flops.py) / step time / 989 TFLOP/s (bf16 dense peak). Medians of 10 steps after 3 warm-up "
            "steps. Raw lines: `bench/results/gpu-h200.jsonl`.", ""]
    parts = latest(events, event="parts")
    practical = parts.get("matmul_peak_tflop_per_s") if parts else None
    out += ["| step | batch x seq | logit chunk | step (s) | tokens/s | TFLOP/s | MFU (989) | MFU (measured "
            "matmul peak) | device peak (GiB) |", "|---|---|---|---|---|---|---|---|---|"]
    distills = [e for e in events if e.get("event") == "distill" and "median_step_s" in e]
    for e in distills:
        name = "ours" + (f", remat {e['remat']}" if e.get("remat") else "") if e["peer"] == "ours" else \
            "PyTorch + transformers (bf16 weights, no master copy)"
        vs_practical = None if not practical else e["tflop_per_s"] / practical
        device_bytes = e.get("peak_device_bytes")
        out.append(f"| {name} | {e['batch']} x {e['seq']} | {e.get('logit_chunk', 'n/a')} | "
                   f"{fmt(e['median_step_s'], 3)} | {fmt(e['tokens_per_s'], 0)} | {fmt(e.get('tflop_per_s'), 1)} | "
                   f"{fmt(100 * e['mfu'], 1, ' %')} | {fmt(None if vs_practical is None else 100 * vs_practical, 1, ' %')}"
                   f" | {fmt(None if device_bytes is None else device_bytes / common.GIB, 1)} |")
    for e in events:
        if e.get("event") == "oom":
            out.append(f"| {e['peer']} | {e['batch']} x 1024 | | out of memory | | | | | |")
    torch_run = next((e for e in distills if e["peer"] == "torch"), None)
    same_batch = [e for e in distills if e["peer"] == "ours" and torch_run and e["batch"] == torch_run["batch"]]
    if same_batch:
        out += ["", f"Ours vs the PyTorch step at batch {torch_run['batch']}: "
                f"{fmt(torch_run['median_step_s'] / min(e['median_step_s'] for e in same_batch), 2, 'x')} "
                "its tokens/s."]
    compiled = next((e for e in distills if e.get("compiled_total_bytes")), None)
    if compiled:  # the first point's step compiled apart, as --aot would report it
        peak = compiled.get("peak_device_bytes")
        out += ["", f"Compiled against measured (batch {compiled['batch']}, the first point): XLA's memory analysis "
                f"of the same step, {fmt(compiled['compiled_total_bytes'] / common.GIB, 2)} GiB"
                + (f"; the device's peak {fmt(peak / common.GIB, 2)} GiB ({fmt(compiled['peak_to_compiled'], 3)}x, "
                   "the loaded models' copies included)." if peak else ".")]
    loads = [e for e in events if e.get("event") == "load" and "load_s" in e]
    if loads:
        out += ["", "Load onto the GPU (`load_pretrained`, teacher, fresh process): " + "; ".join(
            f"{e['cache']} cache {fmt(e['load_s'], 1)} s ({fmt(e.get('gb_per_s'), 2)} GB/s)" for e in loads) + "."]
    if parts:
        out += ["", f"Where the time goes (bench/step_parts.py, batch {parts.get('batch')}, logit chunk "
                f"{parts.get('chunk')}; each part jitted alone):", "",
                "| part | seconds | TFLOP | TFLOP/s |", "|---|---|---|---|"]
        for name in ("teacher_forward", "student_trunk", "logit_loss", "adamw", "head_gradients",
                     "head_gradients_f32_operands", "matmul_peak"):
            out.append(f"| {name} | {fmt(parts.get(f'{name}_seconds'), 4)} | {fmt(parts.get(f'{name}_tflop'), 2)} | "
                       f"{fmt(parts.get(f'{name}_tflop_per_s'), 1)} |")
    trace = latest(events, event="trace")
    if trace and "kinds_ms_per_step" in trace:
        kinds = "; ".join(f"{kind} {fmt(ms, 1)}" for kind, ms in trace["kinds_ms_per_step"].items())
        out += ["", f"Device time by kind of kernel (jax.profiler trace of {trace.get('steps')} steps at batch "
                f"{trace.get('batch')}, line `{trace['line']['thread']}`, bench/trace_summary.py), ms per step: "
                f"{kinds}; busiest kernels:", "", "| kernel | kind | per step | ms per step |", "|---|---|---|---|"]
        steps = max(1, trace.get("steps", 1))
        for row in trace.get("top", [])[:12]:
            out.append(f"| `{row['name'][:80]}` | {row['kind']} | {fmt(row['count'] / steps, 0)} | "
                       f"{fmt(row['ms_per_step'], 2)} |")
    return out + [""]

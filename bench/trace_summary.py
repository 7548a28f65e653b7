"""Where a traced step's device time goes: a summary of a `jax.profiler.trace(..., create_perfetto_trace=True)` file.

    python bench/trace_summary.py TRACE.json.gz [--steps N] [--top 30]

A perfetto trace holds complete events ("ph": "X", durations in microseconds) on (process, thread) lines: on a GPU,
one line per CUDA stream with the kernels, plus lines that repeat the same time as XLA ops and modules. Summing
every line would count device time twice, so the summary names every line with its busy time and breaks down
one: the busiest line of the device process (a process named like "/device:GPU:0"; on CPU, where there is none,
the busiest line of all; on a TPU, whose device lines are steps, modules and ops, the "XLA Ops" line). An op
that encloses others on its line (a TPU's `while` loop and the fusions of its body) counts only its own time, so
nothing is counted twice. Its events are grouped by name (top `--top`) and by kind of kernel from the name
(`KINDS`: matmul, fusion, reduction, copy, ...), in milliseconds per step when `--steps` says how many steps the
trace holds. Used by bench/gpu_bench.py; the raw trace is kept next to the results for a closer look.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import re

# kind of kernel by name, first match wins (cuBLAS / CUTLASS / Triton / XLA kernel names, lower-cased)
KINDS = (
    ("matmul", re.compile(r"gemm|xmma|cutlass|cublas|wgmma|nvjet|hgmma|\bdot\b|dot_|matmul|_mma")),
    ("attention", re.compile(r"flash|fmha|attention|cudnn")),
    ("reduction", re.compile(r"reduc|softmax|row_reduction")),
    ("scatter_gather", re.compile(r"scatter|gather|dynamic.update|dynamic.slice|take")),
    ("copy_transpose", re.compile(r"copy|transpose|memcpy|memset|concatenat|broadcast|pad")),
    ("fusion", re.compile(r"fusion|triton|loop_|input_")),
)


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, pattern in KINDS:
        if pattern.search(lowered):
            return kind
    return "other"


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def self_times(events: list[dict]) -> list[float]:
    """Each event's duration less that of the events it encloses on the same line (its direct children), in the
    events' order: their sum is the line's busy time, nested or not."""
    order = sorted(range(len(events)), key=lambda i: (events[i]["ts"], -events[i]["dur"]))
    own = [float(e["dur"]) for e in events]
    open_events: list[int] = []  # the enclosing events, innermost last
    for i in order:
        start = events[i]["ts"]
        while open_events and events[open_events[-1]]["ts"] + events[open_events[-1]]["dur"] <= start:
            open_events.pop()
        if open_events:
            own[open_events[-1]] -= events[i]["dur"]
        open_events.append(i)
    return own


def summarize(path: str, steps: int = 1, top: int = 30) -> dict:
    """Busy time per (process, thread) line, and a breakdown of the device's busiest line (module docstring)."""
    events = _load(path)
    process_names, thread_names = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process_names[e["pid"]] = e.get("args", {}).get("name", str(e["pid"]))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread_names[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", str(e.get("tid")))
    lines: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            lines[(e["pid"], e.get("tid"))].append(e)
    if not lines:
        raise ValueError(f"{path}: no complete ('X') events; is it a perfetto trace from jax.profiler.trace?")

    def label(key):
        return process_names.get(key[0], str(key[0])), thread_names.get(key, str(key[1]))

    busy = {key: sum(e["dur"] for e in found) for key, found in lines.items()}
    device = [key for key in lines if re.search(r"gpu|device|tpu", label(key)[0], re.I)
              and not re.search(r"host", label(key)[0], re.I)]
    tpu_ops = [key for key in device if re.search(r"tpu", label(key)[0], re.I) and label(key)[1] == "XLA Ops"]
    chosen = max(tpu_ops or device or lines, key=lambda key: busy[key])
    per_step = 1e-3 / max(1, steps)  # microseconds -> milliseconds per step
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    by_kind: dict[str, float] = collections.defaultdict(float)
    own = self_times(lines[chosen])
    busy[chosen] = sum(own)
    for e, seconds in zip(lines[chosen], own):
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += seconds
        by_kind[kind_of(e["name"])] += seconds
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])
    return {
        "lines": [{"process": label(key)[0], "thread": label(key)[1], "events": len(lines[key]),
                   "busy_ms_per_step": round(busy[key] * per_step, 3)}
                  for key in sorted(lines, key=lambda key: -busy[key])[:12]],
        "line": {"process": label(chosen)[0], "thread": label(chosen)[1]},
        "steps": steps,
        "busy_ms_per_step": round(busy[chosen] * per_step, 3),
        "kinds_ms_per_step": {kind: round(value * per_step, 3) for kind, value in
                              sorted(by_kind.items(), key=lambda item: -item[1])},
        "top": [{"name": name[:160], "kind": kind_of(name), "count": count, "ms_per_step": round(total * per_step, 3)}
                for name, (count, total) in ranked[:top]],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=1, help="steps the trace holds (times are divided by it)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    summary = summarize(args.trace, args.steps, args.top)
    print(f"{summary['line']['process']} / {summary['line']['thread']}: {summary['busy_ms_per_step']} ms busy per step")
    for kind, ms in summary["kinds_ms_per_step"].items():
        print(f"  {kind:16s} {ms:10.3f} ms")
    for row in summary["top"]:
        print(f"  {row['ms_per_step']:10.3f} ms  {row['count']:6d}x  [{row['kind']}] {row['name']}")


if __name__ == "__main__":
    main()

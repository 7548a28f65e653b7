"""BENCHMARKS.md's TPU tables from bench/tpu_bench.py's JSON lines (bench/results/tpu-v5e.jsonl by default).

    python bench/report_tpu.py [RESULTS.jsonl]
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _loss(record: dict) -> str:
    """Which logit loss a record ran: the Pallas kernels (DistillConfig.logit_impl fused or kernel on a TPU, since
    they exist) or XLA's chunked loss (fused_xla; every record made before the kernels has no logit_impl)."""
    return "kernels" if record.get("logit_impl") in ("fused", "kernel") else "XLA chunked"


def _chunk(record: dict) -> str:
    if _loss(record) == "kernels":
        return "-"
    chunk, block = record.get("logit_chunk"), record.get("logit_block")
    if not chunk:
        return "256 (default then)"
    return f"{chunk}" + (f" / block {block}" if block and block != chunk else "")


def step_table(records: list[dict]) -> str:
    lines = ["| pair | batch x 2048 | remat | attention | logit loss | logit chunk | step | tokens/s | TFLOP/s | "
             "MFU of 197 | compile | XLA's step bytes | chip's peak | chip / XLA |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r.get("event") != "step" or "error" in r:
            continue
        ratio = f"{r['chip_to_compiled']:.3f}" if r.get("chip_to_compiled") else "(not first in its process)"
        lines.append(f"| {r['pair']} | {r['batch']} | {r['remat'] or 'none'} | {r['attention']} | {_loss(r)} | "
                     f"{_chunk(r)} | "
                     f"{r['median_step_s']:.3f} s | {r['tokens_per_s']:,.0f} | {r['tflop_per_s']:.1f} | "
                     f"{100 * r['mfu']:.1f}% | {r['compile_s']:.0f} s | {r['compiled_bytes'] / 1e9:.2f} GB | "
                     f"{r['peak_device_bytes'] / 1e9:.2f} GB | {ratio} |")
    return "\n".join(lines)


def loss_table(records: list[dict]) -> str:
    lines = ["| tokens | logit loss | logit chunk | temporaries | arguments | outputs |", "|---|---|---|---|---|---|"]
    for r in records:
        if r.get("event") == "loss_memory":
            loss = "kernels" if r.get("logit_impl") == "kernel" else "XLA chunked"
            chunk = "-" if loss == "kernels" else r["logit_chunk"]
            lines.append(f"| {r['tokens']:,} | {loss} | {chunk} | {r['temp_bytes'] / 1e9:.2f} GB | "
                         f"{r['argument_bytes'] / 1e9:.2f} GB | {r['output_bytes'] / 1e9:.2f} GB |")
    return "\n".join(lines)


def trace_tables(records: list[dict]) -> str:
    """Each traced point (tpu_bench --trace): where a step's device time goes, by kind and the heaviest ops, from
    bench/trace_summary.py's own-time breakdown of the chip's "XLA Ops" line."""
    out = []
    for r in records:
        if r.get("event") != "trace" or "top" not in r:
            continue
        kinds = ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in r["kinds_ms_per_step"].items())
        out.append(f"{r['pair']} pair, {r['batch']} x 2048, {r['attention']} attention, line `{r['line']['thread']}`: "
                   f"{r['busy_ms_per_step']:.1f} ms busy per step ({kinds})")
        out += ["", "| op | kind | per step | ms per step |", "|---|---|---|---|"]
        out += [f"| `{op['name']}` | {op['kind']} | {op['count'] // max(1, r['steps'])} | {op['ms_per_step']:.1f} |"
                for op in r["top"]]
        out.append("")
    return "\n".join(out)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else os.path.join(HERE, "results", "tpu-v5e.jsonl")
    with open(path, encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    print(step_table(records))
    print()
    print(loss_table(records))
    print()
    print(trace_tables(records))


if __name__ == "__main__":
    main()

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


MFU_GOALS = {"270m": 0.40, "1b": 0.50}  # issue 64, seq 2048
LOSS_TEMP_GOAL = 1.5e9  # bytes, the logit loss alone at 16k tokens of the 270M pair's head
CLOSURE_GOALS = {"in-domain": 0.85, "general": 0.90, "far-domain": 0.60}  # issue 61, the TPU preset
DEMO = os.path.join(HERE, "results", "demo-tpu-v5e", "results.json")  # its phase_times.json beside it


def _best_step(records: list[dict], pair: str, kernels: bool) -> dict | None:
    steps = [r for r in records if r.get("event") == "step" and "error" not in r and r.get("pair") == pair
             and r.get("seq", 2048) == 2048 and (_loss(r) == "kernels") == kernels]
    return max(steps, key=lambda r: r["mfu"]) if steps else None


def uninterrupted_seconds(phase_times: dict) -> float:
    """One uninterrupted command's seconds by a run's `phase_times.json`: each phase's lap in the first command
    that finished it (a resumed command loads again and reads back what was finished)."""
    first: dict[str, float] = {}
    for command in phase_times.get("commands", []):
        for phase, seconds in command.get("laps", {}).items():
            first.setdefault(phase, seconds)
    return sum(first.values())


def target_rows(records: list[dict], demo: dict | None = None,
                phase_times: dict | None = None) -> list[tuple[str, str, bool]]:
    """"Targets at a glance": the TPU step's MFU and memory (tpu_bench records), the TPU demo's closure (its
    results.json) and its wall time in one command (its phase_times.json)."""
    rows = []
    best = {pair: (_best_step(records, pair, True), _best_step(records, pair, False)) for pair in MFU_GOALS}
    if all(kernel for kernel, _ in best.values()):
        text = " and ".join(f"{100 * k['mfu']:.1f}%" for k, _ in best.values())
        xla = " and ".join(f"{100 * x['mfu']:.1f}%" for _, x in best.values() if x)
        rows.append(("TPU v5e, seq 2048: distillation step MFU >= 40% (270M pair), >= 50% (1B pair)",
                     f"{text} (the Pallas logit kernels; {xla} with XLA's chunked loss)",
                     all(k["mfu"] >= MFU_GOALS[pair] for pair, (k, _) in best.items())))
    losses = {r.get("logit_impl", "fused_xla"): r for r in records
              if r.get("event") == "loss_memory" and r["tokens"] == 16384}
    if "kernel" in losses:
        rows.append(("TPU v5e: the logit loss's temporaries at 16k tokens (270M pair's head) <= 1.5 GB",
                     f"{losses['kernel']['temp_bytes'] / 1e9:.2f} GB (kernels)",
                     losses["kernel"]["temp_bytes"] <= LOSS_TEMP_GOAL))
    ratios = [r["chip_to_compiled"] for r in records if r.get("chip_to_compiled")]
    if ratios:
        rows.append(("TPU v5e: compiled step bytes within 10% of the chip's `bytes_in_use + bytes_reserved`",
                     f"{min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} points "
                     f"({sum(0.9 <= x <= 1.1 for x in ratios)} within 10%)",
                     sum(0.9 <= x <= 1.1 for x in ratios) >= 4))
    if demo:
        from nnx_surgery.recipes.compress.reporting import gap_closed

        closed = {name: shares["distilled"] for name, shares in gap_closed(demo).items()}
        rows.append(("TPU demo (`gemma3-270m-tpu`): >= 85% / 90% / 60% of the gap closed per byte (in-domain / "
                     "general / far)", " / ".join(f"{100 * closed[name]:.0f}%" for name in CLOSURE_GOALS),
                     all(closed[name] >= goal for name, goal in CLOSURE_GOALS.items())))
    if phase_times:
        seconds = uninterrupted_seconds(phase_times)
        rows.append(("TPU demo: the whole run in <= 10 minutes of chip time",
                     f"about {seconds:.0f} s by its phases ({len(phase_times['commands'])} command"
                     f"{'s' * (len(phase_times['commands']) > 1)}: "
                     + " + ".join(f"{c['wall_s']:.0f} s" for c in phase_times["commands"]) + ")", seconds <= 600))
    return rows


def committed_target_rows() -> list[tuple[str, str, bool]]:
    """target_rows of the committed records: bench/results/tpu-v5e.jsonl and the TPU demo's run."""
    with open(os.path.join(HERE, "results", "tpu-v5e.jsonl"), encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    demo = phase_times = None
    if os.path.exists(DEMO):
        with open(DEMO, encoding="utf-8") as handle:
            demo = json.load(handle)
        with open(os.path.join(os.path.dirname(DEMO), "phase_times.json"), encoding="utf-8") as handle:
            phase_times = json.load(handle)
    return target_rows(records, demo, phase_times)


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

"""The --aot report's compiled memory against the memory the same step takes when it runs, on this CPU.

    python bench/aot_vs_measured.py                       # the tiny preset's and the demo's (gemma3-270m) main step
    python bench/aot_vs_measured.py --preset tiny

For each preset, in a fresh process: the recipe's flags resolved as `--aot cpu:1` resolves them
(`aot_programs.aot_run`: the teacher's config.json alone), the last main stage's train step (every parameter trained) built with abstract
arguments (`distill.loop.lowering`, the program the run compiles) and compiled; XLA's `memory_analysis()` gives
arguments, temporaries, outputs and aliased bytes. Then the same compiled step runs on concrete arguments of those
shapes (zeros: the values do not change the buffers), and the process's resident memory is read:

    measured arguments   RSS after the arguments are made - RSS before (the compiled step is already loaded)
    measured step peak   peak RSS while the step runs (VmHWM, reset just before) - RSS before the arguments
    compiled total       arguments + temporaries + outputs - aliased (donated buffers reused for outputs)

The step runs twice (the first call may allocate XLA:CPU's thread pools and caches) and the second is measured.
One JSON line per preset (bench/results/aot_vs_measured.jsonl with --record) and a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

PRESETS = {"tiny": ["--preset", "tiny"], "gemma3-270m": ["--preset", "gemma3-270m"]}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:  # "5": reset the peak resident set size (Linux)
        handle.write("5")


def measure_in_this_process(preset: str, workdir: str) -> dict:
    import jax
    import numpy as np

    from nnx_surgery.distill.loop.step_runner import release_free_heap
    from nnx_surgery.recipes.aot import programs as aot_programs, targets as aot_targets
    from nnx_surgery.recipes.compress import resolution

    flags = resolution.resolve([*PRESETS[preset], "--output", os.path.join(workdir, preset), "--aot", "cpu:1",
                              "--mesh", "fsdp=1"])
    target = aot_targets.resolve_target("cpu:1")
    run = aot_programs.aot_run(flags)
    entry = [e for e in aot_programs.run_programs(run, target) if e.phase == "stage_b" and e.train][-1]  # main
    program = entry.build()
    compiled = program.lower().compile()
    analysis = compiled.memory_analysis()
    release_free_heap()

    def concrete(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding)  # no zeros program compiled
        return leaf

    before = common.current_rss_bytes()
    arguments = jax.block_until_ready(jax.tree.map(concrete, program.arguments))
    made = common.current_rss_bytes() - before
    spare = jax.block_until_ready(jax.tree.map(concrete, program.arguments))  # the first call's donated inputs
    jax.block_until_ready(compiled(*spare))
    del spare
    release_free_heap()
    before_step = common.current_rss_bytes()
    _reset_peak()
    outputs = jax.block_until_ready(compiled(*arguments))
    peak = common.status_bytes("VmHWM")
    del outputs
    compiled_total = (analysis.argument_size_in_bytes + analysis.temp_size_in_bytes
                      + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
    measured_total = made + (peak - before_step)
    return {"bench": "aot_vs_measured", "preset": preset, "program": entry.name, "tokens": program.tokens,
            "compiled": {"arguments": analysis.argument_size_in_bytes, "temporaries": analysis.temp_size_in_bytes,
                         "outputs": analysis.output_size_in_bytes, "aliased": analysis.alias_size_in_bytes,
                         "total": compiled_total},
            "measured": {"arguments": made, "step_above_arguments": peak - before_step, "total": measured_total},
            "ratio_measured_to_compiled": measured_total / compiled_total,
            "machine": common.machine(), "versions": common.versions()}


def table(records: list[dict]) -> str:
    mib = lambda value: f"{value / 2**20:,.1f}"  # noqa: E731
    lines = ["| preset | program | compiled args | measured args | compiled temp + out - alias | measured step "
             "above args | compiled total | measured total | measured / compiled |", "|---|---|" + "---:|" * 7]
    for r in records:
        c, m = r["compiled"], r["measured"]
        lines.append(f"| {r['preset']} | {r['program']} | {mib(c['arguments'])} | {mib(m['arguments'])} | "
                     f"{mib(c['temporaries'] + c['outputs'] - c['aliased'])} | {mib(m['step_above_arguments'])} | "
                     f"{mib(c['total'])} | {mib(m['total'])} | {r['ratio_measured_to_compiled']:.3f} |")
    return "\n".join(lines) + "\n\n(MiB)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), action="append")
    parser.add_argument("--record", action="store_true", help="append to bench/results/aot_vs_measured.jsonl")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default="/tmp/aot_vs_measured")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_in_this_process(args.child, args.workdir)))
        return
    records = []
    for preset in args.preset or list(PRESETS):
        done = subprocess.run([sys.executable, __file__, "--child", preset, "--workdir", args.workdir],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"{preset}: the measuring process failed:\n{done.stderr[-3000:]}")
        record = json.loads(done.stdout.strip().splitlines()[-1])
        common.emit(record, os.path.join(os.path.dirname(__file__), "results", "aot_vs_measured.jsonl")
                    if args.record else None)
        records.append(record)
    print(table(records))


if __name__ == "__main__":
    main()

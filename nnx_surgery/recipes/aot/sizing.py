"""`--aot TARGET`: compile the run's own programs for TARGET and report what each device needs; train nothing.

    python recipes/gemma_7b_to_2b.py --teacher gemma-7b --student gemma-2b --precision bf16 --seq-len 2048 \\
        --batch-size 8 --aot v5e:2x4 --aot-tokens 94e9 --output runs/7b-on-v5e-8

With every other flag as the run would get it, the programs it would execute (programs.py) are compiled by
XLA for TARGET (targets.py: a TPU slice through libtpu, or cpu:N), then it stops like --dry-run: the report
(report.py) is printed and saved as OUT/aot_report.json, the only file written (an earlier report there is
replaced; nothing else in the folder is touched). When the asked settings do not fit with 10% free, or with
--aot-search, the search (search.py) compiles other settings and prints the fastest that fits as flags.
"""
from __future__ import annotations

import dataclasses
import os
import time

from nnx_surgery.recipes.aot import programs as aot_programs, search as aot_search, targets as aot_targets
from nnx_surgery.recipes.aot.report import HEADROOM, days_to, format_table, measure
from nnx_surgery.recipes.compress import checks, resolution
from nnx_surgery.recipes.config.sections import RecipeConfig
from nnx_surgery.refusals import RecipeError
from nnx_surgery.surgery.storage.atomic import write_json

REPORT = "aot_report.json"
DEFAULT_MFU = 0.4


def report_sizes(config: RecipeConfig) -> dict:
    """Compile, report, search when asked or needed; returns the report (also OUT/aot_report.json)."""
    if config.aot.target is None:
        raise RecipeError("the compile report needs --aot TARGET.")
    aot_targets.prepare_host_devices(config.aot.target)  # --aot cpu:N, before JAX starts
    checks.check_devices(config)  # --mesh's syntax (its fit is the target's, checked with the programs)
    mfu = config.aot.mfu or DEFAULT_MFU
    target = aot_targets.resolve_target(config.aot.target)
    if not config.training.mesh:  # a run on the slice is given a mesh over all of it
        config = resolution.replaced(config, training={"mesh": f"fsdp={len(target.devices)}"})
    run = aot_programs.aot_run(config)
    print(f"[aot] {target.describe()}; teacher {run.teacher.source} ({run.teacher.folder}), student "
          f"{student_text(run.student.spec)}, mesh {config.training.mesh}", flush=True)
    built = [(entry, entry.build()) for entry in aot_programs.run_programs(run, target)]  # refusals before compiling
    rows = []
    for entry, program in built:
        started = time.perf_counter()
        row = measure(program, target, mfu)
        row.update(phase=entry.phase, train=entry.train)
        rows.append(row)
        print(f"[aot] {entry.name}: compiled in {time.perf_counter() - started:.0f} s", flush=True)
    print(format_table(rows, target, mfu, config.aot.tokens))
    report = sizing_report(config, run, target, rows, mfu)
    worst = critical(rows)
    if config.aot.search or not report["fits"]:
        found = aot_search.search_fitting_settings(config, target, worst["program"], mfu, worst) if worst else None
        report["search"] = found
        print(search_line(found, config.aot.tokens))
    os.makedirs(run.folder, exist_ok=True)
    write_json(os.path.join(run.folder, REPORT), report)
    print(f"report: {os.path.join(run.folder, REPORT)}")
    return report


def student_text(spec) -> str:
    """The student's shape as --student writes it."""
    text = (f"layers={spec.num_layers},hidden={spec.hidden_size},mlp={spec.intermediate_size},"
            f"heads={spec.num_attention_heads},kv_heads={spec.num_key_value_heads}")
    return text + (f",vocab={spec.vocab_size}" if spec.vocab_size is not None else "") + \
        (f" ({spec.name})" if spec.name else "")


def critical(rows: list[dict]) -> dict | None:
    """The train step that needs the most memory per device (one XLA refused first)."""
    train = [row for row in rows if row.get("train")]
    if not train:
        return None
    return max(train, key=lambda r: (bool(r.get("out_of_memory")), r["bytes"].get("total") or
                                     r.get("out_of_memory", {}).get("needed") or 0))


def sizing_report(config: RecipeConfig, run, target, rows: list[dict], mfu: float) -> dict:
    """The report: the target and its figures, the settings, each program's row, whether all fit with HEADROOM
    free, and the main stage's time to --aot-tokens."""
    chip = target.chip
    main = next((r for r in reversed(rows) if r.get("phase") == "stage_b" and r.get("train")), None)
    fits = all(r["fits"] and r.get("headroom", 0) >= HEADROOM for r in rows)
    return {"target": {"name": target.name, "devices": len(target.devices), "hosts": target.hosts,
                       "devices_per_chip": target.cores_per_chip, "memory_per_device": target.memory_per_device,
                       "chip": dataclasses.asdict(chip) if chip else None},
            "settings": {"teacher": run.teacher.source, "teacher_config": run.teacher.folder,
                         "student": student_text(run.student.spec), "mesh": config.training.mesh,
                         "batch_size": config.data.batch_size, "grad_accum": config.distill.grad_accum,
                         "seq_len": config.data.seq_len, "remat": config.distill.remat,
                         "precision": config.training.precision,
                         "tokens_per_step": config.tokens_per_step, "mfu": mfu},
            "programs": rows, "fits": fits, "headroom_required": HEADROOM,
            "token_budget": config.aot.tokens,
            "days_to_budget": days_to(config.aot.tokens, main) if config.aot.tokens and main else None}


def search_line(found: dict | None, budget: float | None) -> str:
    if not found:
        return "[aot search] no train step to search over."
    best = found.get("best")
    if best is None:
        return f"[aot search] {found['why']}"
    rate = best.get("tokens_per_s")
    speed = f", about {rate:,.0f} tokens/s" if rate else ""
    days = days_to(budget, best) if budget else None
    return (f"fits ({found['program']}: {best['bytes']['total'] / 2 ** 30:.2f} GiB per device, "
            f"{best['headroom']:.0%} free{speed}{f', {days:.1f} days for the budget' if days else ''}): pass "
            f"{found['flags']}")


__all__ = ["report_sizes", "REPORT", "DEFAULT_MFU"]

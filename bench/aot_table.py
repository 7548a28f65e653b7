"""The recipe's job on paper: Gemma 7B -> 2B's main train step compiled by XLA's TPU compiler (libtpu, no TPU) for
the slices users rent, and the table of what fits (BENCHMARKS.md, issue 44 item 4).

    python bench/aot_table.py --run [--workers 2] [--only KEY,...]   # compile what bench/results/aot_table.jsonl lacks
    python bench/aot_table.py --table                                # the Markdown tables from the JSONL

Each configuration (CONFIGS, most important first) is a target, a sequence length, a loss mix (logit KL only, or
the full mix: logit KL + attention transfer + pooled feature loss) and a student, with a short ladder of settings
(mesh split, micro-batch x gradient accumulation, remat): the settings are compiled in order, each in its own
process (libtpu's and XLA's memory are returned when it ends), until one fits with the recipe's 10% headroom
(`aot_report.HEADROOM`); at most len(ladder) compiles. Only the program the table needs is compiled: the run's
main-stage train step (the last `aot_programs.run_programs` entry of phase "stage_b" that trains), exactly as
`compress --aot TARGET` builds it from the same flags (`resolution.resolve`, `aot_programs.aot_run`) and measures it
(`aot_report.measure`). Every compile is appended to bench/results/aot_table_attempts.jsonl as it finishes, and
each configuration, once its ladder ends, to bench/results/aot_table.jsonl (tried settings, the best one), so a
partial run keeps what it finished.

The flags are the recipe's (`nnx-surgery compress`) with --teacher gemma-7b --precision bf16 (bf16 compute and
teacher, float32 master weights and Adam) --aot TARGET --aot-tokens 94e9; `flags_for(...)` prints them per row.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "aot_table.jsonl")
ATTEMPTS = os.path.join(ROOT, "bench", "results", "aot_table_attempts.jsonl")
PERSISTENT = os.path.join(ROOT, "bench", "results", "aot_table_persistent.jsonl")
GIB = 2 ** 30
BUDGET = 94e9
LOSSES = {"logit": ["--attention-weight", "0", "--feature-weight", "0"],  # the 7b preset's feature weight is 0.1
          "full": ["--attention-weight", "1", "--feature-weight", "0.1", "--feature-kind", "pooled"]}


@dataclasses.dataclass(frozen=True)
class Setting:
    mesh: str
    batch: int  # rows per micro-batch (global)
    accum: int
    remat: str | None
    logit_impl: str = "fused"  # or "two_pass" (distill.losses.two_pass: no (V, D) accumulator)

    def text(self) -> str:
        impl = "" if self.logit_impl == "fused" else f", {self.logit_impl} logit loss"
        return f"{self.mesh}, {self.batch}x{self.accum}, remat {self.remat or 'none'}{impl}"


@dataclasses.dataclass(frozen=True)
class Config:
    key: str
    group: str  # "main" (the 4 targets x 2 lengths x 2 mixes), "scaling" (fixed rows per chip, more chips) or
    # "teachers" (the other families' released pairs)
    target: str
    seq: int
    loss: str
    ladder: tuple
    student: str = "gemma-2b"
    teacher: str = "gemma-7b"


def S(mesh, batch, accum, remat, logit_impl="fused"):
    return Setting(mesh, batch, accum, remat, logit_impl)


L, LD, NONE, TP = "layers", "layers_dots", None, "two_pass"
CONFIGS = [
    # v5e-8: the goal (>= 32k tokens per step, logit KL; >= 16k with the full mix)
    Config("v5e-8/2048/logit", "main", "v5e:2x4", 2048, "logit", (S("fsdp=8", 16, 1, L), S("fsdp=8", 8, 2, L))),
    Config("v5e-8/2048/full", "main", "v5e:2x4", 2048, "full", (S("fsdp=8", 8, 1, L), S("fsdp=4,tp=2", 4, 2, L),
                                                                S("fsdp=8", 8, 1, L, TP))),
    Config("v5e-8/8192/logit", "main", "v5e:2x4", 8192, "logit", (S("fsdp=8", 8, 1, L), S("fsdp=8", 8, 1, L, TP),
                                                                  S("fsdp=4,tp=2", 4, 1, L))),
    Config("v5e-8/8192/full", "main", "v5e:2x4", 8192, "full", (S("fsdp=8", 8, 1, L), S("fsdp=4,tp=2", 4, 1, L),
                                                                 S("fsdp=2,tp=4", 2, 1, L), S("fsdp=1,tp=8", 1, 1, L))),
    # the other targets at 2048: one guess each (the fastest remat expected to fit), a fallback when it does not
    Config("v6e-8/2048/logit", "main", "v6e:2x4", 2048, "logit", (S("fsdp=8", 16, 1, LD), S("fsdp=8", 16, 1, L))),
    Config("v5p-8/2048/logit", "main", "v5p:2x2x1", 2048, "logit", (S("fsdp=4", 16, 1, NONE), S("fsdp=4", 16, 1, LD))),
    Config("v5e-16/2048/logit", "main", "v5e:4x4", 2048, "logit", (S("fsdp=16", 32, 1, L), S("fsdp=16", 16, 2, L))),
    Config("v6e-8/2048/full", "main", "v6e:2x4", 2048, "full", (S("fsdp=8", 16, 1, LD), S("fsdp=8", 16, 1, L))),
    Config("v5p-8/2048/full", "main", "v5p:2x2x1", 2048, "full", (S("fsdp=4", 16, 1, NONE), S("fsdp=4", 16, 1, LD))),
    Config("v5e-16/2048/full", "main", "v5e:4x4", 2048, "full", (S("fsdp=16", 16, 1, L), S("fsdp=8,tp=2", 8, 2, L))),
    Config("v6e-8/8192/logit", "main", "v6e:2x4", 8192, "logit", (S("fsdp=8", 8, 1, L), S("fsdp=4,tp=2", 4, 1, L))),
    Config("v5p-8/8192/logit", "main", "v5p:2x2x1", 8192, "logit", (S("fsdp=4", 4, 1, LD), S("fsdp=4", 4, 1, L))),
    Config("v5e-16/8192/logit", "main", "v5e:4x4", 8192, "logit", (S("fsdp=16", 16, 1, L), S("fsdp=8,tp=2", 8, 1, L))),
    Config("v6e-8/8192/full", "main", "v6e:2x4", 8192, "full", (S("fsdp=8", 8, 1, L), S("fsdp=4,tp=2", 4, 1, L))),
    Config("v5p-8/8192/full", "main", "v5p:2x2x1", 8192, "full", (S("fsdp=4", 4, 1, LD), S("fsdp=4", 4, 1, L),
                                                                   S("fsdp=2,tp=2", 2, 2, L))),
    Config("v5e-16/8192/full", "main", "v5e:4x4", 8192, "full", (S("fsdp=16", 16, 1, L), S("fsdp=8,tp=2", 8, 1, L),
                                                                  S("fsdp=4,tp=4", 4, 1, L),
                                                                  S("fsdp=2,tp=8", 2, 1, L))),
    # per-device bytes against chips, 2 rows of 2048 per chip, logit KL, remat layers (8 and 16 chips: the rows
    # v5e-8/2048/logit and v5e-16/2048/logit above)
    Config("scaling/v5e-64/2048/logit", "scaling", "v5e:8x8", 2048, "logit", (S("fsdp=64", 128, 1, L),)),
    # the two-pass logit loss (no (V, D) float32 accumulator) on the v5e-8's fitting logit-KL setting
    Config("v5e-8/2048/logit/two_pass", "main", "v5e:2x4", 2048, "logit", (S("fsdp=8", 16, 1, L, TP),)),
    # the recipe's own default student shape (`scaled`) where time allows
    Config("scaled/v5e-8/2048/logit", "main", "v5e:2x4", 2048, "logit", (S("fsdp=8", 16, 1, L),), "scaled"),
    Config("scaled/v5e-8/2048/full", "main", "v5e:2x4", 2048, "full", (S("fsdp=8", 8, 1, L),), "scaled"),
]
# the other families' released pairs the surgery can make (Gemma 3 27B -> 4B cannot: the 4B's head_dim is 256, the
# 27B's 128, and a student keeps its teacher's head_dim), logit KL at 2048 on the smallest target expected to fit
CONFIGS += [
    Config("9b/v5e-8/2048/logit", "teachers", "v5e:2x4", 2048, "logit", (S("fsdp=8", 16, 1, L), S("fsdp=8", 8, 2, L)),
           "gemma-2-2b", "gemma-2-9b"),
    Config("12b/v5e-8/2048/logit", "teachers", "v5e:2x4", 2048, "logit", (S("fsdp=8", 16, 1, L), S("fsdp=8", 8, 2, L)),
           "gemma-3-1b", "gemma-3-12b"),
]
BY_KEY = {config.key: config for config in CONFIGS}


def flags_for(config: Config, setting: Setting, output: str = "OUT") -> list[str]:
    """The recipe's flags for one compile (remat is applied on the resolved flags: the command line also takes
    --remat layers; layers_dots through --set remat=\"layers_dots\")."""
    return ["--teacher", config.teacher, "--student", config.student, "--precision", "bf16", "--seq-len",
            str(config.seq), "--batch-size", str(setting.batch), "--grad-accum", str(setting.accum), "--mesh",
            setting.mesh, *LOSSES[config.loss], "--aot", config.target, "--aot-tokens", "94e9", "--output", output]


def command_text(config: Config, setting: Setting) -> str:
    remat = f" --set 'remat=\"{setting.remat}\"'" if setting.remat else ""
    impl = f" --set logit_impl={setting.logit_impl}" if setting.logit_impl != "fused" else ""
    return "nnx-surgery compress " + " ".join(flags_for(config, setting, "/tmp/aot/x")) + remat + impl


# ---------------------------------------------------------------------------------------------------- one compile
def compile_one(key: str, index: int) -> dict:
    """In this (fresh) process: the config's index-th setting's main train step, compiled and measured."""
    from nnx_surgery.recipes.aot import sizing as aot, programs as aot_programs, targets as aot_targets
    from nnx_surgery.recipes.aot.report import measure
    from nnx_surgery.recipes.compress import resolution

    config, setting = BY_KEY[key], BY_KEY[key].ladder[index]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as output:
        flags = resolution.resolve(flags_for(config, setting, os.path.join(output, "run")))
        flags = resolution.replaced(flags, distill={"remat": setting.remat, "logit_impl": setting.logit_impl})
        aot.check_settings(flags)
        target = aot_targets.resolve_target(config.target)
        run = aot_programs.aot_run(flags)
        entry = [e for e in aot_programs.run_programs(run, target) if e.phase == "stage_b" and e.train][-1]
        program = entry.build()
        built = time.perf_counter() - started
        row = measure(program, target, aot.DEFAULT_MFU)
    row.update(key=key, setting=dataclasses.asdict(setting), entry=entry.name, build_s=round(built, 1),
               micro_tokens=setting.batch * config.seq, step_tokens=setting.batch * setting.accum * config.seq,
               devices=len(target.devices), hosts=target.hosts, target=config.target,
               student=aot.student_text(run.student.spec), command=command_text(config, setting))
    return row


def persistent_bytes(target_name: str, seq: int = 2048, rows_per_chip: int = 2) -> dict:
    """Without compiling: the argument bytes per device of the main step (teacher, student, Adam, batch) under fsdp
    over every chip of `target_name`, from the abstract arguments' shardings (what the compiled rows report as
    their arguments)."""
    from nnx_surgery.recipes.aot import programs as aot_programs, targets as aot_targets
    from nnx_surgery.recipes.aot.report import device_bytes
    from nnx_surgery.recipes.compress import resolution

    target = aot_targets.resolve_target(target_name)
    chips = len(target.devices)
    config = Config("persistent", "scaling", target_name, seq, "logit", (S(f"fsdp={chips}", rows_per_chip * chips,
                                                                          1, L),))
    with tempfile.TemporaryDirectory() as output:
        flags = resolution.resolve(flags_for(config, config.ladder[0], os.path.join(output, "run")))
        run = aot_programs.aot_run(flags)
        entry = [e for e in aot_programs.run_programs(run, target) if e.phase == "stage_b" and e.train][-1]
        program = entry.build()
    parts = {name: device_bytes(program.parts.get(name)) for name in ("teacher", "optimizer", "batch")}
    parts["student"] = sum(device_bytes(program.parts.get(k)) for k in ("student", "frozen", "projections"))
    return {"target": target_name, "devices": chips, "rows_per_chip": rows_per_chip, "seq_len": seq, **parts,
            "arguments": sum(parts.values())}


def _compile_in_subprocess(key: str, index: int, timeout: float) -> dict:
    setting = BY_KEY[key].ladder[index]
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--compile", key, str(index)],
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"key": key, "setting": dataclasses.asdict(setting), "error": f"compile over {timeout:.0f} s",
                "wall_s": round(time.perf_counter() - started, 1)}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"key": key, "setting": dataclasses.asdict(setting), "error": " | ".join(tail)[-600:],
                "wall_s": round(time.perf_counter() - started, 1)}
    row = json.loads(lines[-1])
    row["wall_s"] = round(time.perf_counter() - started, 1)
    return row


_lock = threading.Lock()


def _append(path: str, row: dict) -> None:
    with _lock:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as handle:
            handle.write(json.dumps(row) + "\n")


def good(row: dict) -> bool:
    from nnx_surgery.recipes.aot.report import HEADROOM
    return bool(row.get("fits")) and row.get("headroom", 0) >= HEADROOM


def run_config(key: str, timeout: float) -> dict:
    """The config's ladder, compiled in order until a setting fits with the headroom; the config's line."""
    config = BY_KEY[key]
    tried, best = [], None
    # rows recorded before settings had a logit_impl were compiled with the fused loss
    earlier = {json.dumps({"logit_impl": "fused", **row["setting"]}, sort_keys=True): row for row in attempts(key)}
    for index, setting in enumerate(config.ladder):
        row = earlier.get(json.dumps(dataclasses.asdict(setting), sort_keys=True))
        if row is None or ("error" in row and "compile over" not in row["error"]):  # a timeout stands as a result
            print(f"[{time.strftime('%H:%M:%S')}] {key}: compiling {setting.text()}", flush=True)
            row = _compile_in_subprocess(key, index, timeout)
            _append(ATTEMPTS, row)
        tried.append(row)
        print(f"[{time.strftime('%H:%M:%S')}] {key}: {setting.text()}: {verdict(row)}", flush=True)
        if good(row):
            best = row
            break
    line = {"key": key, "group": config.group, "target": config.target, "seq_len": config.seq,
            "loss": config.loss, "student": config.student, "tried": tried, "best": best,
            "fits": best is not None, "recorded": time.strftime("%Y-%m-%d %H:%M:%S")}
    _append(RESULTS, line)
    return line


def verdict(row: dict) -> str:
    if "error" in row:
        return "error: " + row["error"][-200:]
    oom = row.get("out_of_memory")
    if oom:
        need = f"XLA needs {oom['needed'] / GIB:.2f} of {oom['available'] / GIB:.2f} GiB" if "needed" in oom else \
            oom["message"][:160]
        return f"does not fit ({need}); compile {row.get('compile_s')} s"
    return (f"{row['bytes']['total'] / GIB:.2f} GiB per device, {row['headroom']:.0%} free, "
            f"{row.get('tokens_per_s') or 0:,.0f} tokens/s; compile {row['compile_s']} s")


# ------------------------------------------------------------------------------------------------------ the tables
def _lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def attempts(key: str) -> list[dict]:
    """The compiles of `key` recorded so far (a run stopped part-way resumes from them)."""
    return [row for row in _lines(ATTEMPTS) if row.get("key") == key]


def load(path: str = RESULTS, partial: bool = False) -> dict[str, dict]:
    """{key: the latest configuration line}; with `partial`, keys whose ladder did not end get a line made from
    their attempts so far (marked "partial")."""
    found = {row["key"]: row for row in _lines(path)}
    if partial:
        for key in dict.fromkeys(row["key"] for row in _lines(ATTEMPTS)):
            if key in found or key not in BY_KEY:
                continue
            config, tried = BY_KEY[key], attempts(key)
            best = next((row for row in tried if good(row)), None)
            found[key] = {"key": key, "group": config.group, "target": config.target, "seq_len": config.seq,
                          "loss": config.loss, "student": config.student, "tried": tried, "best": best,
                          "fits": best is not None, "partial": True}
    return found


# The MFU measured on one v5e chip for the pair nearest these rows' setting: the Gemma 3 1B pair's train step with
# `--remat layers`, splash attention and 32k tokens (bench/results/tpu-v5e.jsonl; BENCHMARKS.md "On a TPU v5e
# chip"). The rows were compiled at aot.DEFAULT_MFU; `tokens_at` re-estimates them at this one.
CHIP_MFU = 0.518


def tokens_at(row: dict, mfu: float) -> float:
    """A compiled row's tokens/s at `mfu` of the chip's peak: its compute time scaled from the MFU it was estimated
    at, its HBM-bandwidth bound unchanged (the slower of the two, as `--aot` estimates)."""
    from nnx_surgery.recipes.aot.sizing import DEFAULT_MFU

    step = max(row["step_s_compute"] * DEFAULT_MFU / mfu, row["step_s_memory"])
    return row["step_tokens"] / step


def _gib(value) -> str:
    return "" if value is None else f"{value / GIB:.2f}"


def _setting(row: dict) -> str:
    s = row["setting"]
    impl = "" if s.get("logit_impl", "fused") == "fused" else f", {s['logit_impl']} loss"
    return f"{s['mesh']}, {s['batch']}x{s['accum']}, {s['remat'] or 'none'}{impl}"


def _tried_text(line: dict) -> str:
    parts = []
    for row in line["tried"]:
        if "error" in row:
            parts.append(f"{_setting(row)}: error")
        elif row.get("out_of_memory"):
            oom = row["out_of_memory"]
            parts.append(f"{_setting(row)}: OOM ({_gib(oom.get('needed'))} GiB temps)")
        else:
            parts.append(f"{_setting(row)}: {_gib(row['bytes']['total'])} GiB" +
                         ("" if good(row) else f" ({row['headroom']:.0%} free)"))
    return "; ".join(parts)


def table(lines: dict[str, dict], group: str = "main") -> str:
    """The configurations of `group` ("teachers": a teacher column first)."""
    lead = "| teacher " if group == "teachers" else ""
    out = [lead + "| target | seq | loss | student | fits | GiB/device (of) | setting (mesh, micro x accum, remat) | "
           f"tokens/step (micro) | tokens/s | days for 94B | tokens/s at {CHIP_MFU:.1%} MFU (measured on a chip) | "
           "days | compile s | tried |",
           "|---" * (14 + bool(lead)) + "|"]
    for config in CONFIGS:
        line = lines.get(config.key)
        if config.group != group or line is None:
            continue
        prefix = f"| {config.teacher} " if lead else ""
        best = line["best"]
        shown = best or next((r for r in line["tried"] if r.get("fits")), None) or \
            next((r for r in reversed(line["tried"]) if "bytes" in r and "total" in r["bytes"]), None)
        loss = "logit KL" if config.loss == "logit" else "full mix"
        if best is not None:
            b = best["bytes"]
            rate = best.get("tokens_per_s")
            out.append(prefix + f"| {config.target} | {config.seq} | {loss} | {config.student} | yes | "
                       f"{_gib(b['total'])} ({_gib(best['memory_per_device'])}) | {_setting(best)} | "
                       f"{best['step_tokens'] // 1024}k ({best['micro_tokens'] // 1024}k) | "
                       f"{rate:,.0f} | {BUDGET / rate / 86400:.1f} | {tokens_at(best, CHIP_MFU):,.0f} | "
                       f"{BUDGET / tokens_at(best, CHIP_MFU) / 86400:.1f} | {best['compile_s']:.0f} | "
                       f"{_tried_text(line)} |")
        else:
            total = _gib(shown["bytes"]["total"]) if shown else ""
            compile_s = "/".join(f"{r['compile_s']:.0f}" for r in line["tried"] if "compile_s" in r)
            tight = any(r.get("fits") for r in line["tried"])  # fits XLA's HBM, not the recipe's headroom
            verdict_text = "not finished" if line.get("partial") else "under 10% free" if tight else "**no**"
            out.append(prefix + f"| {config.target} | {config.seq} | {loss} | {config.student} | {verdict_text} | "
                       f"{total} | "
                       f"| | | | | | {compile_s} | {_tried_text(line)} |")
    return "\n".join(out)


def breakdown(lines: dict[str, dict]) -> str:
    """Where a device's bytes go in each best (or last measured) setting."""
    out = ["| row | setting | teacher | student | Adam | batch | temporaries | outputs | total | of | XLA TFLOP/device "
           "(analytic) | bound |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for config in CONFIGS:
        line = lines.get(config.key)
        if line is None:
            continue
        for row in line["tried"]:
            if "bytes" not in row:
                continue
            b = row["bytes"]
            oom = row.get("out_of_memory")
            temps = _gib(b.get("temporaries")) if not oom else f"> {_gib(oom.get('needed'))} (OOM)"
            flops = (f"{row['flops_per_device_xla'] / 1e12:.0f} ({row['flops_per_device_analytic'] / 1e12:.0f})"
                     if "flops_per_device_xla" in row else "")
            out.append(f"| {config.key} | {_setting(row)} | {_gib(b['teacher_parameters'])} | "
                       f"{_gib(b['student_parameters'])} | {_gib(b['optimizer_state'])} | {_gib(b['batch'])} | "
                       f"{temps} | {_gib(b.get('outputs'))} | {_gib(b.get('total'))} | "
                       f"{_gib(row['memory_per_device'])} | {flops} | {row.get('bound', '')} |")
    return "\n".join(out)


SCALING = ("v5e-8/2048/logit", "v5e-16/2048/logit", "scaling/v5e-64/2048/logit")


def scaling(lines: dict[str, dict]) -> str:
    out = ["| chips | setting | teacher | student + Adam | batch | temporaries | total GiB/device | compile s |",
           "|---|---|---|---|---|---|---|---|"]
    for key in SCALING:
        line = lines.get(key)
        if line is None:
            continue
        row = next((r for r in line["tried"] if "bytes" in r and r["setting"]["batch"] // r["devices"] == 2
                    and r["setting"]["accum"] == 1), None)
        if row is None:
            continue
        b = row["bytes"]
        oom = row.get("out_of_memory")
        out.append(f"| {row['devices']} ({row['target']}) | {_setting(row)} | {_gib(b['teacher_parameters'])} | "
                   f"{_gib(b['student_parameters'] + b['optimizer_state'])} | {_gib(b['batch'])} | "
                   f"{_gib(b.get('temporaries')) if not oom else 'OOM ' + _gib(oom.get('needed'))} | "
                   f"{_gib(b.get('total'))} | {row['compile_s']:.0f} |")
    rows = {r["target"]: r for r in _lines(PERSISTENT)}
    if rows:
        out += ["", "Arguments per device without compiling (fsdp over every chip, 2 rows of 2048 per chip):", "",
                "| chips | target | teacher | student | Adam | batch | arguments GiB/device |",
                "|---|---|---|---|---|---|---|"]
        for r in sorted(rows.values(), key=lambda r: r["devices"]):
            out.append(f"| {r['devices']} | {r['target']} | {_gib(r['teacher'])} | {_gib(r['student'])} | "
                       f"{_gib(r['optimizer'])} | {_gib(r['batch'])} | {_gib(r['arguments'])} |")
    return "\n".join(out)


def ooms(lines: dict[str, dict]) -> str:
    out = []
    for config in CONFIGS:
        line = lines.get(config.key)
        for row in (line or {}).get("tried", []):
            if row.get("out_of_memory"):
                out.append(f"- {config.key}, {_setting(row)}: `{row['out_of_memory']['message']}`")
            elif "error" in row:
                out.append(f"- {config.key}, {_setting(row)}: error `{row['error'][-300:]}`")
    return "\n".join(out)


def report(lines: dict[str, dict]) -> str:
    missing = [c.key for c in CONFIGS if c.key not in lines]
    return "\n\n".join(["### Gemma 7B -> 2B per target (main train step, --precision bf16, --aot-tokens 94e9, "
                        "40% MFU)", table(lines), "### Other teachers (their released student shapes, the same "
                        "settings)", table(lines, "teachers"), "### Bytes per device", breakdown(lines),
                        "### Per-device bytes against chips (2 rows of 2048 per chip, logit KL, remat layers)",
                        scaling(lines), "### What XLA said", ooms(lines) or "(nothing refused)",
                        "Not compiled: " + (", ".join(missing) if missing else "none")])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="compile the configurations the JSONL lacks")
    parser.add_argument("--table", action="store_true", help="print the Markdown tables from the JSONL")
    parser.add_argument("--only", default="", help="comma-separated keys (default: all, in priority order)")
    parser.add_argument("--workers", type=int, default=1, help="configurations compiled at once")
    parser.add_argument("--timeout", type=float, default=1500, help="seconds per compile")
    parser.add_argument("--persistent", default="", help="comma-separated targets: argument bytes per device "
                        "without compiling (bench/results/aot_table_persistent.jsonl)")
    parser.add_argument("--compile", nargs=2, metavar=("KEY", "INDEX"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile:
        row = compile_one(args.compile[0], int(args.compile[1]))
        print(json.dumps(row), flush=True)
        return 0
    if args.persistent:
        for name in args.persistent.split(","):
            row = persistent_bytes(name)
            _append(PERSISTENT, row)
            print(json.dumps(row), flush=True)
        return 0
    if args.run:
        done = load()
        keys = [k for k in (args.only.split(",") if args.only else [c.key for c in CONFIGS]) if k]
        unknown = [k for k in keys if k not in BY_KEY]
        if unknown:
            print(f"unknown keys {unknown}; known: {list(BY_KEY)}", file=sys.stderr)
            return 2
        # not yet run, or ended without a fit before its ladder grew
        todo = [k for k in keys if k not in done or (not done[k]["fits"]
                                                     and len(done[k]["tried"]) < len(BY_KEY[k].ladder))]
        with concurrent.futures.ThreadPoolExecutor(max(1, args.workers)) as pool:
            list(pool.map(lambda k: run_config(k, args.timeout), todo))
    if args.table or not args.run:
        print(report(load(partial=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Surgery from disk: a 7B-shaped teacher (17 GB of bf16) -> a 2B-shaped student with `prune_checkpoint`.

    python bench/prune.py                                   # makes bench/out/ckpt/gemma-7b once (~17 GB)
    python bench/prune.py --teacher DIR --student-shape gemma-2b --repeats 2

The reference is reading the teacher's files once, front to back, into one reused buffer: the I/O floor of any
tool that looks at every teacher byte. It is measured in the same run, alternating with the surgery, and both
start from a cold page cache for the teacher's files (posix_fadvise DONTNEED on those files only; a 17 GB teacher
does not stay cached on a 24 GB machine shared with other jobs anyway).

The plan (`plan_student(teacher, "gemma-2b")`, data-free: uniform depth, weight-magnitude widths, KV heads merged
16 -> 1) is made once in its own process, timed and saved; each surgery process then loads it and runs
`prune_checkpoint(teacher, plan, out)`. Every step is a fresh process, so its peak RSS is its own.
Targets: surgery peak RSS < 3 GB, surgery wall time <= 1.5x the sequential read.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

RSS_TARGET_BYTES = 3 * 10**9
TIME_TARGET = 1.5


def _import(module: str, name: str):
    package = __import__(module.split(".")[0], fromlist=[name])
    return getattr(package, name) if hasattr(package, name) else getattr(__import__(module, fromlist=[name]), name)


def child(args) -> dict:
    if args.child == "read":
        start = time.perf_counter()
        n = common.read_files_sequentially(common.safetensors_files(args.teacher))
        seconds = time.perf_counter() - start
        return {"step": "read", "seconds": seconds, "bytes": n, "gb_per_s": n / seconds / 1e9,
                "peak_rss_bytes": common.peak_rss_bytes()}
    if args.child == "plan":
        plan_student = _import("surgery.planner", "plan_student")
        start = time.perf_counter()
        spec = args.student_shape
        if "," in spec:  # explicit sizes: layers,hidden,intermediate,heads,kv_heads
            spec = _import("surgery.spec", "StudentSpec")(*map(int, spec.split(",")))
        plan = plan_student(args.teacher, spec, depth="uniform", width="magnitude")
        seconds = time.perf_counter() - start
        plan.save(args.plan)
        return {"step": "plan", "seconds": seconds, "peak_rss_bytes": common.peak_rss_bytes(),
                "kept_layers": list(plan.kept_layers), "kv": plan.methods.get("kv")}
    prune_checkpoint = _import("surgery.prune_disk", "prune_checkpoint")
    Plan = _import("surgery.plan", "Plan")
    plan = Plan.load(args.plan)
    start = time.perf_counter()
    prune_checkpoint(args.teacher, plan, args.out_dir)
    seconds = time.perf_counter() - start
    written = common.checkpoint_bytes(args.out_dir)
    return {"step": "prune", "seconds": seconds, "peak_rss_bytes": common.peak_rss_bytes(),
            "student_bytes": written, "student_parameters": plan.student.num_parameters()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", help="teacher folder (default: make --teacher-shape's under bench/out/ckpt)")
    parser.add_argument("--teacher-shape", default="gemma-7b")
    parser.add_argument("--student-shape", default="gemma-2b",
                        help="a named shape, or sizes 'layers,hidden,intermediate,heads,kv_heads'")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--min-free-gib", type=float, default=14.0)
    parser.add_argument("--keep-student", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--child", choices=("read", "plan", "prune"), help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args), default=str))
        return
    teacher = args.teacher
    if not teacher:
        from make_checkpoint import ensure_checkpoint

        teacher = ensure_checkpoint(args.teacher_shape, os.path.join(common.CKPT_DIR, args.teacher_shape))
    files = common.safetensors_files(teacher)
    size = common.checkpoint_bytes(teacher)
    work = os.path.join(common.OUT, "prune")
    os.makedirs(work, exist_ok=True)
    tag = args.student_shape.replace(",", "-")
    plan_path = os.path.join(work, f"plan-{tag}.json")
    student_dir = os.path.join(work, f"student-{tag}")
    base = [sys.executable, os.path.abspath(__file__), "--teacher", teacher, "--student-shape", args.student_shape,
            "--plan", plan_path, "--out-dir", student_dir]
    common.wait_for_memory(args.min_free_gib)
    common.evict_from_page_cache(files)
    plan = common.run_child(base + ["--child", "plan"], timeout=args.timeout)
    common.emit(common.round_floats({**plan, "bench": "prune", "cache": "cold", "teacher_bytes": size}), args.out)
    if "error" in plan:
        raise SystemExit("plan_student failed; see the JSON line above.")
    runs: dict[str, list[dict]] = {"read": [], "prune": []}
    for repeat in range(args.repeats):
        for step in (("read", "prune") if repeat % 2 == 0 else ("prune", "read")):
            common.wait_for_memory(args.min_free_gib)
            common.evict_from_page_cache(files)
            record = common.run_child(base + ["--child", step], timeout=args.timeout)
            record.update(bench="prune", repeat=repeat, cache="cold", teacher_bytes=size)
            common.emit(common.round_floats(record), args.out)
            runs[step].append(record)
    pairs = [(r["seconds"], p["seconds"]) for r, p in zip(runs["read"], runs["prune"])
             if "seconds" in r and "seconds" in p]
    prune_rss = common.median(p["peak_rss_bytes"] for p in runs["prune"] if "peak_rss_bytes" in p)
    summary = {"bench": "prune", "summary": True, "teacher_bytes": size,
               "teacher": os.path.basename(os.path.normpath(teacher)), "student": args.student_shape,
               "read_s": common.median(r for r, _ in pairs), "prune_s": common.median(p for _, p in pairs),
               "plan_s": plan.get("seconds"), "plan_peak_rss_gib": (plan.get("peak_rss_bytes") or 0) / common.GIB,
               "prune_over_read": common.median(p / r for r, p in pairs),
               "plan_plus_prune_over_read": common.median((p + (plan.get("seconds") or 0)) / r for r, p in pairs),
               "prune_peak_rss_gib": None if prune_rss is None else prune_rss / common.GIB,
               "read_gb_per_s": common.median(size / r / 1e9 for r, _ in pairs)}
    if pairs and prune_rss is not None:
        summary["targets_met"] = {"rss_under_3gb": prune_rss < RSS_TARGET_BYTES,
                                  "time_within_1.5x_read": summary["prune_over_read"] <= TIME_TARGET}
    common.emit(common.round_floats(summary), args.out)
    if not args.keep_student:
        shutil.rmtree(student_dir, ignore_errors=True)


if __name__ == "__main__":
    main()

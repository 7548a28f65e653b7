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
import subprocess
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
        plan_student = _import("nnx_surgery.surgery.planning.student_planner", "plan_student")
        start = time.perf_counter()
        spec = args.student_shape
        if "," in spec:  # explicit sizes: layers,hidden,intermediate,heads,kv_heads
            spec = _import("nnx_surgery.surgery.plans.student_spec", "StudentSpec")(*map(int, spec.split(",")))
        plan = plan_student(args.teacher, spec, depth="uniform", width="magnitude")
        seconds = time.perf_counter() - start
        plan.save(args.plan)
        return {"step": "plan", "seconds": seconds, "peak_rss_bytes": common.peak_rss_bytes(),
                "kept_layers": list(plan.kept_layers), "kv": plan.methods.get("kv")}
    prune_checkpoint = _import("nnx_surgery.surgery.pruning.on_disk", "prune_checkpoint")
    Plan = _import("nnx_surgery.surgery.plans.plan_record", "Plan")
    plan = Plan.load(args.plan)
    start = time.perf_counter()
    prune_checkpoint(args.teacher, plan, args.out_dir)
    seconds = time.perf_counter() - start
    written = common.checkpoint_bytes(args.out_dir)
    return {"step": "prune", "seconds": seconds, "peak_rss_bytes": common.peak_rss_bytes(),
            "student_bytes": written, "student_parameters": plan.student.num_parameters()}


def run_watched(cmd: list[str], timeout: float) -> dict:
    """Run a child; at `timeout` stop it and report how far it got (bytes read and written, from /proc/PID/io)."""
    env = dict(os.environ, PYTHONPATH=common.ROOT)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    io = {}
    while proc.poll() is None and time.perf_counter() - started < timeout:
        try:
            with open(f"/proc/{proc.pid}/io") as f:
                io = {k: int(v) for k, v in (line.split(": ") for line in f)}
        except OSError:
            pass
        time.sleep(1.0)
    if proc.poll() is None:
        proc.kill()
        proc.communicate()
        return {"timed_out": True, "seconds": round(time.perf_counter() - started, 1),
                "read_bytes_so_far": io.get("rchar"), "written_bytes_so_far": io.get("wchar"),
                "error": f"stopped after {timeout:.0f} s"}
    out, err = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}", "stderr_tail": err[-2000:]}
    return json.loads(lines[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", help="teacher folder (default: make --teacher-shape's under bench/out/ckpt)")
    parser.add_argument("--teacher-shape", default="gemma-7b")
    parser.add_argument("--student-shape", default="gemma-2b",
                        help="a named shape, or sizes 'layers,hidden,intermediate,heads,kv_heads'")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--readers", default="package", choices=("package",),
                        help="the surgery measured: package (the package's code; the row reader and pipelined "
                             "writer once prototyped in bench/fastload.py are part of it now)")
    parser.add_argument("--package-repeats", type=int, default=None,
                        help="repeats of the 'package' reader (default: --repeats)")
    parser.add_argument("--package-timeout", type=float, default=180,
                        help="stop the package's surgery after this many seconds and report its progress")
    parser.add_argument("--plan-reader", default="package", choices=("package",),
                        help="reader for the (once-made) plan")
    parser.add_argument("--out")
    parser.add_argument("--min-free-gib", type=float, default=14.0)
    parser.add_argument("--keep-student", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--child", choices=("read", "plan", "prune"), help=argparse.SUPPRESS)
    parser.add_argument("--reader", default="package", help=argparse.SUPPRESS)
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
    readers = [r for r in args.readers.split(",") if r]
    common.wait_for_memory(args.min_free_gib)
    common.evict_from_page_cache(files)
    plan = run_watched(base + ["--child", "plan", "--reader", args.plan_reader], args.timeout)
    common.emit(common.round_floats({**plan, "bench": "prune", "step": "plan", "reader": args.plan_reader,
                                     "cache": "cold", "teacher_bytes": size}), args.out)
    if "error" in plan:
        raise SystemExit("plan_student failed; see the JSON line above.")
    runs: dict[str, list[dict]] = {"read": [], **{r: [] for r in readers}}
    for repeat in range(args.repeats):
        steps = ["read"] + [r for r in readers if r != "package" or repeat < (args.package_repeats or args.repeats)]
        if repeat % 2:
            steps = steps[::-1]
        for step in steps:
            common.wait_for_memory(args.min_free_gib)
            common.evict_from_page_cache(files)
            if step == "read":
                record = run_watched(base + ["--child", "read"], args.timeout)
            else:
                limit = args.package_timeout if step == "package" else args.timeout
                record = run_watched(base + ["--child", "prune", "--reader", step], limit)
            record.update(bench="prune", step="read" if step == "read" else "prune", reader=step, repeat=repeat,
                          cache="cold", teacher_bytes=size)
            common.emit(common.round_floats(record), args.out)
            runs[step].append(record)
    reads = [r["seconds"] for r in runs["read"] if "error" not in r]
    read_s = common.median(reads)
    summary = {"bench": "prune", "summary": True, "teacher_bytes": size,
               "teacher": os.path.basename(os.path.normpath(teacher)), "student": args.student_shape,
               "read_s": read_s, "read_gb_per_s": None if not read_s else size / read_s / 1e9,
               "plan_s": plan.get("seconds"), "plan_reader": args.plan_reader,
               "plan_peak_rss_gib": (plan.get("peak_rss_bytes") or 0) / common.GIB, "readers": {}}
    for reader in readers:
        done = [r for r in runs[reader] if "error" not in r]
        stopped = [r for r in runs[reader] if r.get("timed_out")]
        entry = {"runs": len(done), "prune_s": common.median(r["seconds"] for r in done),
                 "peak_rss_gib": common.median(r["peak_rss_bytes"] / common.GIB for r in done)}
        pairs = [(r["seconds"], p["seconds"]) for r, p in zip(runs["read"], runs[reader])
                 if "error" not in r and "error" not in p]
        entry["prune_over_read"] = common.median(p / r for r, p in pairs)
        if stopped:
            entry["stopped_after_s"] = stopped[0]["seconds"]
            entry["read_bytes_when_stopped"] = stopped[0].get("read_bytes_so_far")
            entry["written_bytes_when_stopped"] = stopped[0].get("written_bytes_so_far")
        if entry["prune_s"] is not None:
            entry["targets_met"] = {"rss_under_3gb": entry["peak_rss_gib"] * common.GIB < RSS_TARGET_BYTES,
                                    "time_within_1.5x_read": entry["prune_over_read"] <= TIME_TARGET}
        elif stopped:
            entry["targets_met"] = {"time_within_1.5x_read": False}
        summary["readers"][reader] = common.round_floats(entry)
    common.emit(common.round_floats(summary), args.out)
    if not args.keep_student:
        shutil.rmtree(student_dir, ignore_errors=True)
        for partial in os.listdir(work):
            if partial.startswith(f".student-{tag}.partial-"):
                shutil.rmtree(os.path.join(work, partial), ignore_errors=True)


if __name__ == "__main__":
    main()

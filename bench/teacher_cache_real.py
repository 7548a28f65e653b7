"""The teacher cache on the real Gemma 3 270M, through the recipe (`--teacher-cache`), one run after the other:

    python bench/teacher_cache_real.py --runs runs/cache-bench --out bench/results/teacher-cache-real.jsonl

* Quality and step time: the demo (`--preset gemma3-270m`: the preset's student and steps, MLP 2048 -> 512 and 24
  steps of 4 x 256 tokens when the first records were taken, MLP 768 and 20 steps since) distilled from a cache the
  run writes (`--teacher-cache always`, unquantised) at k = 16, 64 and 128, and online at k = 64 with the teacher
  running; the online full-distribution student is the demo's own (`--demo RUN`, a `make demo` folder); at k = 64
  with the mass outside the top k as one more bucket (`top_k_mode="residual"`); and from caches of k stratified
  draws of the teacher's distribution (`--cache-selection sampled`), or of its top k / 2 and draws of the rest
  (`--cache-selection mixed`). Then `nnx-surgery eval` scores them on the
  demo's held-out sets with paired intervals against the full-distribution student (`--only` a subset).
* A shape search with and without the cache at equal candidates and steps (`--student params=0.5`, 4 candidates,
  3 steps each, top 64; the main run after it is one step): the search's wall time and its rankings.

Each run folder is kept; a finished one is read, not rerun (delete it to measure again). One record per run (and
one for the comparison) to --out. Run it alone on the machine: the step and phase times are the measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import common  # noqa: E402

RECIPE = os.path.join(ROOT, "recipes", "gemma_7b_to_2b.py")
DEMO = ["--preset", "gemma3-270m", "--control", "none"]
SEARCH = ["--preset", "gemma3-270m", "--student", "params=0.5", "--search-candidates", "4", "--search-steps", "3",
          "--top-k", "64", "--steps", "1", "--warmup-steps", "0", "--control", "none", "--eval-prompts", "0",
          "--choice-items", "0", "--eval-tokens", "2048"]
RUNS = {f"cache-k{k}": DEMO + ["--top-k", str(k), "--teacher-cache", "always"] for k in (16, 64, 128)}
RUNS["cache-k64-residual"] = RUNS["cache-k64"] + ["--set", "distill.top_k_mode=residual"]  # top k + a bucket
RUNS["online-k64"] = DEMO + ["--top-k", "64"]
# k stratified draws of the teacher's distribution instead of its top k (--cache-selection sampled)
RUNS.update({f"sampled-k{k}": DEMO + ["--top-k", str(k), "--teacher-cache", "always", "--cache-selection", "sampled"]
             for k in (16, 64, 128)})
# the top k // 2 exactly and k - k // 2 draws of the rest (--cache-selection mixed)
RUNS.update({f"mixed-k{k}": DEMO + ["--top-k", str(k), "--teacher-cache", "always", "--cache-selection", "mixed"]
             for k in (16, 64, 128)})
RUNS.update({f"search-{mode}": SEARCH + ["--teacher-cache", mode] for mode in ("auto", "none")})


def run(folder: str, flags: list[str]) -> float | None:
    """The recipe into `folder` (skipped when it finished there earlier); its wall time."""
    if os.path.isfile(os.path.join(folder, "results.json")):
        return None
    started = time.perf_counter()
    with open(folder + ".log", "w") as log:
        subprocess.run([sys.executable, RECIPE, *flags, "--output", folder], stdout=log, stderr=subprocess.STDOUT,
                       check=True, env={**os.environ, "PYTHONPATH": ROOT})
    return time.perf_counter() - started


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if len(ordered) % 2 else sum(ordered[len(ordered) // 2 - 1:][:2]) / 2


def run_record(name: str, folder: str) -> dict:
    results = json.load(open(os.path.join(folder, "results.json")))
    record = {"run": name, "phase_times_s": results["phase_times_s"], "teacher_cache": results.get("teacher_cache")}
    history = os.path.join(folder, "phases", "stage_b", "history.json")
    if os.path.isfile(history):
        steps = json.load(open(history))["train"][1:]  # the first step compiles
        record["median_step_s"] = round(_median([r["step_time_s"] for r in steps]), 3)
    distilled = next(r for r in results["rows"] if r["model"] == "distilled student")
    record["distilled"] = {key: distilled.get(key) for key in ("loss_per_byte", "general_loss_per_byte",
                                                                "kl_to_teacher", "general_kl")}
    if results.get("search"):
        search = results["search"]
        record["search"] = {"winner": search["winner"], "rankings": search["rankings"],
                            "scores": {c["student"]: c["scores"] for c in search["candidates"]}}
    return record


def compare(runs: str, demo: str, out: str | None, names: list[str]) -> None:
    """nnx-surgery eval of the full-distribution student and the cache-trained ones (`names`), paired against it
    (into RUNS/eval, or RUNS/eval-NAME-NAME... for a subset)."""
    folder = os.path.join(runs, "eval" if names == list(RUNS) else "eval-" + "-".join(names))
    students = {"full": os.path.join(demo, "student")} | {
        name: os.path.join(runs, name, "student") for name in names if not name.startswith("search")}
    if len(students) == 1:
        return  # searches only: their records hold their rankings and times, no student to compare
    if not os.path.isfile(os.path.join(folder, "results.json")):
        full = students["full"]  # every folder is named student/: the table names them by their paths
        compares = [arg for name, path in students.items() if name != "full" for arg in ("--compare", f"{path}:{full}")]
        subprocess.run([sys.executable, "-m", "nnx_surgery.cli", "eval", "--teacher", "gguf:gemma3-270m",
                        *students.values(), *compares, "--eval-tokens", "8192", "--corpus-bytes", "4000000",
                        "--seed", "0", "--eval-prompts", "0", "--choice-items", "0", "--output", folder,
                        "--overwrite"], check=True, env={**os.environ, "PYTHONPATH": ROOT})
    common.emit({"run": "eval", "students": students,
                 "results": json.load(open(os.path.join(folder, "results.json")))}, out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=os.path.join(ROOT, "runs", "cache-bench"), help="where the runs go")
    parser.add_argument("--demo", default=os.path.join(ROOT, "runs", "gemma3-270m"), help="a `make demo` folder")
    parser.add_argument("--out", help="append the records to this JSONL file")
    parser.add_argument("--only", help="these runs only, comma-separated (e.g. cache-k64,sampled-k64); their "
                        "comparison goes to RUNS/eval-NAME-...")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(RUNS)
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"--only {unknown}: not runs of this bench; choose from {', '.join(RUNS)}")
    os.makedirs(args.runs, exist_ok=True)
    for name in names:
        seconds = run(os.path.join(args.runs, name), RUNS[name])
        record = run_record(name, os.path.join(args.runs, name))
        common.emit({**record, "wall_s": None if seconds is None else round(seconds, 1)}, args.out)
    compare(args.runs, args.demo, args.out, names)


if __name__ == "__main__":
    main()

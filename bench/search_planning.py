"""Planning a shape search's candidates on the real Gemma 3 270M: each plan measuring the teacher against one
measurement (`surgery.score_teacher`) shared by every plan.

    python bench/search_planning.py --out bench/results/search-planning.jsonl

The candidates are the recipe's for `--student params=0.5 --search-candidates 4` (the uniform guess, the shape
that keeps every head, and two spread over the shapes within the budget); the calibration rows are 128 rows of 256
teacher tokens of standard-library source (the recipe's default count at the demo's row length). Both ways give
the same plans (checked); the record has both wall times, one after the other in this process, after one
compilation of the calibration passes.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import common  # noqa: E402


def calibration_rows(folder: str, rows: int, length: int):
    """`rows` x `length` teacher tokens of standard-library source, files in sorted order."""
    import numpy as np
    from nnx_surgery.surgery.modeling.generation import TextCodec
    codec, tokens = TextCodec.of(folder), []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        tokens += codec.encode(open(path, encoding="utf-8", errors="replace").read())
        if len(tokens) >= rows * length:
            break
    return np.asarray(tokens[:rows * length], np.int32).reshape(rows, length)


def candidates(config):
    from nnx_surgery import surgery
    from nnx_surgery.recipes.compress.shape_search import Budget, heads_kept_shape, spread
    budget = Budget("params=0.5", "0.5")
    fitting = surgery.candidate_specs(config, params="0.5", counting="non_embedding", tolerance=0.05)
    guess = surgery.uniform_spec(config, params="0.5", counting="non_embedding")
    return spread(fitting, guess, 4, near=heads_kept_shape(config, budget, fitting))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--out", help="append the record to this JSONL file")
    args = parser.parse_args(argv)
    from real_gemma import cached_import
    from nnx_surgery import surgery
    folder = cached_import("float32")
    teacher = surgery.load_pretrained(folder)
    rows = calibration_rows(folder, args.rows, args.length)
    shapes = candidates(teacher.config)
    surgery.score_teacher(teacher, calibration=rows)  # compiles the calibration passes: neither way pays for it
    started = time.perf_counter()
    each = [surgery.plan_student(teacher, c.spec, calibration=rows) for c in shapes]
    each_s = time.perf_counter() - started
    started = time.perf_counter()
    scored = surgery.score_teacher(teacher, calibration=rows)
    score_s = time.perf_counter() - started
    shared = [surgery.plan_student(teacher, c.spec, calibration=rows, scored=scored) for c in shapes]
    shared_s = time.perf_counter() - started
    same = [a.to_dict() for a in each] == [b.to_dict() for b in shared]
    common.emit({"bench": "search_planning", "model": "gemma3-270m", "date": time.strftime("%Y-%m-%d %H:%M"),
                 "calibration_rows": args.rows, "row_length": args.length, "candidates": [c.text for c in shapes],
                 "each_measures_s": round(each_s, 1), "shared_s": round(shared_s, 1),
                 "score_teacher_s": round(score_s, 1), "speedup": round(each_s / shared_s, 2), "same_plans": same,
                 "cpus": os.cpu_count()}, args.out)
    if not same:
        raise SystemExit("the shared measurement gave other plans")


if __name__ == "__main__":
    main()

"""Model quality: the distilled student vs the same shape trained from scratch on the same tokens.

    python bench/quality.py                      # runs the recipe's tiny preset into bench/out/quality
    python bench/quality.py --results runs/tiny/results.json     # or reads a finished run

The recipe (`recipes/gemma_7b_to_2b.py --preset tiny`) trains a small Gemma teacher offline (cached), prunes it to
the 7B:2B shape ratios, distils in stages, trains a control student of the same shape from scratch for the same
number of tokens, and evaluates all of them on held-out data. This script runs it and turns its results.json into
one summary line for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def summarise(results: dict, wall: float | None, command: str) -> dict:
    rows = []
    for row in results.get("rows", []):
        loss = row.get("loss")
        rows.append({"name": row.get("model"), "parameters": row.get("parameters"), "tokens": row.get("tokens"),
                     "ce": loss, "perplexity": row.get("perplexity"), "eval_tokens": row.get("eval_tokens")})
    by_name = {r["name"]: r for r in rows}
    distilled = by_name.get("distilled student")
    scratch = by_name.get("scratch student (same shape)")
    verdict = ""
    gap = None
    if distilled and scratch and distilled["ce"] is not None and scratch["ce"] is not None:
        gap = scratch["ce"] - distilled["ce"]
        verdict = (f"At equal tokens ({distilled['tokens']:,}), the distilled student's held-out cross-entropy is "
                   f"{distilled['ce']:.4f} nats against {scratch['ce']:.4f} for the scratch student: "
                   f"{'better' if gap > 0 else 'NOT better'} by {gap:+.4f} nats/token (perplexity "
                   f"{scratch['perplexity']:.2f} -> {distilled['perplexity']:.2f}).")
    return {"bench": "quality", "summary": True, "rows": rows, "distilled_minus_scratch_ce": gap,
            "distilled_beats_scratch": None if gap is None else gap > 0, "recipe_wall_s": wall,
            "description": f"`{command}`: a small Gemma teacher trained offline on byte tokens, pruned to the "
                           "7B:2B shape ratios, distilled in stages; the control is the same shape from random "
                           "init, trained on the same tokens with hard labels. Held-out loss is next-token "
                           "cross-entropy on held-out text.",
            "verdict": verdict}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", help="results.json of a finished recipe run (skip running it)")
    parser.add_argument("--output", default=os.path.join(common.OUT, "quality"))
    parser.add_argument("--out")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--reuse", action="store_true",
                        help="use --output's results.json when present instead of running the recipe again")
    args = parser.parse_args(argv)
    recipe = os.path.join(common.ROOT, "recipes", "gemma_7b_to_2b.py")
    command = f"python recipes/gemma_7b_to_2b.py --preset tiny --output {os.path.relpath(args.output, common.ROOT)}"
    wall = None
    path = args.results
    existing = os.path.join(args.output, "results.json")
    if not path and args.reuse and os.path.exists(existing):
        path = existing
    if not path:
        start = time.perf_counter()
        env = dict(os.environ, PYTHONPATH=common.ROOT)
        resume = ["--resume"] if os.path.exists(os.path.join(args.output, "run_args.json")) else []
        proc = subprocess.run([sys.executable, recipe, "--preset", "tiny", "--output", args.output, *resume],
                              cwd=common.ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
        wall = time.perf_counter() - start
        if proc.returncode:
            common.emit({"bench": "quality", "summary": True, "error": f"recipe exit {proc.returncode}",
                         "stderr_tail": proc.stderr[-2000:]}, args.out)
            raise SystemExit(1)
        path = os.path.join(args.output, "results.json")
    with open(path) as f:
        results = json.load(f)
    common.emit(common.round_floats(summarise(results, wall, command)), args.out)


if __name__ == "__main__":
    main()

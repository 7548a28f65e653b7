"""Quality against tokens (issue 61): the gemma3-270m-tpu preset's student at 1x, 10x and 100x the CPU demo's
57,344 training tokens, distilled and its CE control, each scale in a folder of its own; then closure per byte
(the share of the pruned-to-teacher gap in CE per byte closed, as results.md's verdicts say it) on the three
held-out sets against tokens, distilled beside control.

    python bench/demo_budget_curve.py run                 # on the chip: each scale not finished yet, in order
    python bench/demo_budget_curve.py run --scales 1,10   # some of them
    python bench/demo_budget_curve.py plot --out budget_curve.png   # from the runs' results.json

Everything but the batch, the steps and the warm-up is the preset's: the same teacher, student, corpus, general
mix, held-out sets and evaluation (with `make demo`'s two lm-eval tasks, so that the 100x run's command is `make
demo`'s on an accelerator and both share runs/gemma3-270m-tpu). Each scale keeps the preset's 256-token rows and
takes the largest batch of 64 / 32 / 16 / 8 / 4 rows that makes its tokens exactly in at least 10 steps: 1x is 14
steps of 16 rows, 10x 35 of 64, 100x the preset's 350 of 64; the warm-up keeps the preset's share (12 of 350, at
least 1). Runs pass --resume: a command that stops (a device call's 10 minutes) is continued by the next, and a
finished scale is skipped. The wall time of each run's phases is in its results.json (`phase_times_s`). The runs
share one persistent compilation cache (ROOT/xla-cache, or JAX_COMPILATION_CACHE_DIR where set): the scales of the
same batch load each other's compiled programs. `--no-lm-eval` leaves the two lm-eval tasks out (a machine
without the lm-eval extra); `--demo-folder` puts the 100x run elsewhere than `make demo`'s folder.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nnx_surgery.recipes.demo_choice import LM_EVAL, RECIPE  # noqa: E402
from nnx_surgery.recipes.compress.reporting import SET_KEYS, gap_closed  # noqa: E402

PRESET = "gemma3-270m-tpu"
CPU_TOKENS = 56 * 4 * 256  # the gemma3-270m preset's training tokens
SEQ, PRESET_BATCH, PRESET_STEPS, PRESET_WARMUP = 256, 64, 350, 12
BATCHES = (64, 32, 16, 8, 4)


def scale_settings(scale: int) -> dict[str, int]:
    """Batch, steps and warm-up that make `scale` x the CPU demo's tokens exactly (module docstring)."""
    rows = scale * CPU_TOKENS // SEQ
    for batch in BATCHES:
        if rows % batch == 0 and rows // batch >= 10:
            steps = rows // batch
            return {"batch": batch, "steps": steps, "warmup": max(1, round(steps * PRESET_WARMUP / PRESET_STEPS)),
                    "tokens": steps * batch * SEQ}
    raise SystemExit(f"scale {scale}: no batch of {BATCHES} rows makes {scale * CPU_TOKENS:,} tokens in 10 or more "
                     "steps; choose a scale of at least 1.")


DEMO_FOLDER = os.path.join(ROOT, "runs", PRESET)


def run_folder(root: str, scale: int, demo_folder: str = DEMO_FOLDER) -> str:
    """The preset's own folder for 100x (`make demo`'s on an accelerator: runs/gemma3-270m-tpu in the checkout,
    unless `demo_folder`), ROOT/<scale>x for the others."""
    settings = scale_settings(scale)
    if (settings["batch"], settings["steps"]) == (PRESET_BATCH, PRESET_STEPS):
        return demo_folder
    return os.path.join(root, f"{scale}x")


def command(root: str, scale: int, python: str = sys.executable, *, lm_eval: bool = True,
            demo_folder: str = DEMO_FOLDER) -> list[str]:
    settings = scale_settings(scale)
    return [python, os.path.join(ROOT, RECIPE), "--preset", PRESET, "--output", run_folder(root, scale, demo_folder),
            "--resume", *(LM_EVAL if lm_eval else ()), "--batch-size", str(settings["batch"]),
            "--steps", str(settings["steps"]), "--warmup-steps", str(settings["warmup"])]


def run(root: str, scales: list[int], *, lm_eval: bool = True, demo_folder: str = DEMO_FOLDER) -> int:
    """Each scale not finished yet (no results.json in its folder), in order, sharing one compilation cache;
    stops at the first that fails."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR")
           or os.path.abspath(os.path.join(root, "xla-cache"))}
    for scale in scales:
        folder = run_folder(root, scale, demo_folder)
        if os.path.exists(os.path.join(folder, "results.json")):
            print(f"[curve] {scale}x: finished in {folder}", flush=True)
            continue
        argv = command(root, scale, lm_eval=lm_eval, demo_folder=demo_folder)
        print(f"[curve] {scale}x: {' '.join(argv[1:])}", flush=True)
        code = subprocess.call(argv, env=env)
        if code:
            print(f"[curve] {scale}x stopped (exit {code}); run the same command again to continue it", flush=True)
            return code
    return 0


def points(folders: dict[int, str]) -> list[dict]:
    """One point per run that has a results.json: its training tokens and gap_closed's shares."""
    out = []
    for scale, folder in sorted(folders.items()):
        path = os.path.join(folder, "results.json")
        if not os.path.exists(path):
            continue
        with open(path) as handle:
            results = json.load(handle)
        tokens = next(r["tokens"] for r in results["rows"] if r["model"] == "distilled student")
        out.append({"scale": scale, "folder": folder, "tokens": tokens, "closed": gap_closed(results),
                    "phase_times_s": results.get("phase_times_s", {}), "wall_time_s": results.get("wall_time_s")})
    return out


def plot(found: list[dict], out: str, title: str = "") -> str:
    """Closure per byte against training tokens (log scale): one panel per held-out set, distilled and control."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not found:
        raise SystemExit("no run has a results.json yet; run `python bench/demo_budget_curve.py run` first.")
    sets = [title for _, title in SET_KEYS]
    figure, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 3.6), sharey=True)
    for axis, name in zip(axes, sets):
        for model, style in (("distilled", "o-"), ("control", "s--")):
            xs = [p["tokens"] for p in found if model in p["closed"].get(name, {})]
            ys = [100 * p["closed"][name][model] for p in found if model in p["closed"].get(name, {})]
            if xs:
                axis.plot(xs, ys, style, label=model)
        axis.set_xscale("log")
        axis.set_title(f"{name} held-out set")
        axis.set_xlabel("training tokens")
        axis.grid(True, alpha=0.3)
    axes[0].set_ylabel("gap closed per byte (%)")
    axes[0].legend()
    figure.suptitle(title or f"{PRESET}: the student's recovery against its token budget")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def table(found: list[dict]) -> str:
    """The points as a markdown table (closure per byte, distilled / control, per set)."""
    sets = [title for _, title in SET_KEYS]
    lines = ["| scale | tokens | " + " | ".join(f"{name} (distilled / control)" for name in sets) + " | wall time |",
             "|---|---|" + "---|" * len(sets) + "---|"]
    for p in found:
        cells = []
        for name in sets:
            shares = p["closed"].get(name, {})
            cells.append(" / ".join(f"{100 * shares[m]:.0f}%" if m in shares else "-" for m in ("distilled", "control")))
        wall = "-" if p["wall_time_s"] is None else f"{p['wall_time_s']:.0f} s"
        lines.append(f"| {p['scale']}x | {p['tokens']:,} | " + " | ".join(cells) + f" | {wall} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("run", "plot"))
    parser.add_argument("--scales", default="1,10,100", help="multiples of the CPU demo's 57,344 tokens")
    parser.add_argument("--root", default=os.path.join("runs", "budget"), help="where the scales below 100x go")
    parser.add_argument("--out", default=None, help="plot: the PNG (default ROOT/budget_curve.png)")
    parser.add_argument("--demo-folder", default=DEMO_FOLDER, help="the 100x run's folder (default make demo's)")
    parser.add_argument("--no-lm-eval", dest="lm_eval", action="store_false",
                        help="leave make demo's two lm-eval tasks out (no lm-eval extra installed)")
    args = parser.parse_args(argv)
    scales = [int(s) for s in args.scales.split(",") if s.strip()]
    if args.action == "run":
        return run(args.root, scales, lm_eval=args.lm_eval, demo_folder=args.demo_folder)
    found = points({scale: run_folder(args.root, scale, args.demo_folder) for scale in scales})
    path = plot(found, args.out or os.path.join(args.root, "budget_curve.png"))
    print(table(found))
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

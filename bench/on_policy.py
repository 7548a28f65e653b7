"""Cost of on-policy distillation: a distillation step with lambda = 0.5 against lambda = 0, in one process.

    python bench/on_policy.py                      # tiny Gemma 3 pair (bench/students.py), batch 4 x 64 tokens
    python bench/on_policy.py --scale 270m --batch 2 --seq 128 --steps 8 --repeats 2 --out bench/results/x.jsonl

Same teacher and student files (bench/students.py), same random token batches, same loss (JSD(0.5) on the
teacher's and student's logits, as GKD), fp32 on this machine's default backend. Each repeat runs lambda = 0 and
lambda = 0.5 (`DistillConfig.on_policy.fraction`) one after the other (the order alternates between repeats),
each for `--warmup` + `--steps` optimizer steps on a fresh copy of the student; a first untimed lambda = 1 run
compiles the step and the sampler (surgery.modeling.generation.make_sampler: KV-cache prefill + decode loop, temperature 1,
prompt = the first half of each row, the second half sampled; no EOS ends a row early with these random weights,
so every sample runs its whole length: the worst case).

A step's cost is the device step (`step_time_s` of the history, synchronous) plus the sampling before it
(`sample_s`, 0 off-policy). Printed and written (JSON lines, `--out`): per lambda the median step cost, the mean
(lambda = 0.5 mixes two kinds of step, so its mean is the cost per step of a run), and for lambda = 0.5 the medians
of its on-policy and off-policy steps, each a median over repeats; then the expected cost per step at lambda = 0.5
(the mean of those two medians: a short run's draws need not be half on-policy) over lambda = 0's median step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def batches(vocab: int, batch: int, seq: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    while True:
        yield {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int32)}


def one_run(teacher, student_folder: str, fraction: float, steps: int, args, sampler) -> dict:
    """Train a fresh student for `steps` steps at on-policy fraction `fraction`; per-step costs from the history."""
    from nnx_surgery.distill.loop.run_config import DistillConfig, GuardConfig, LossWeights, Stage
    from nnx_surgery.distill.loop.on_policy import OnPolicyConfig
    from nnx_surgery.distill.loop.trainer import run
    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained

    student = load_pretrained(student_folder, dtype="float32")
    config = DistillConfig(stages=(Stage(steps=steps, learning_rate=1e-4, min_lr_ratio=1.0,
                                         weights=LossWeights(kl=0.0, jsd=1.0)),),
                           batch_size=args.batch, seq_len=args.seq, guard=GuardConfig(enabled=False), progress=False,
                           plots=False, seed=args.seed, on_policy=OnPolicyConfig(fraction=fraction, temperature=1.0))
    started = time.perf_counter()
    result = run(teacher, student, batches(teacher.config.vocab_size, args.batch, args.seq, args.seed), config,
                 sampler=sampler)
    wall = time.perf_counter() - started
    history = result.history[args.warmup:]
    costs = [h["step_time_s"] + h.get("sample_s", 0.0) for h in history]
    on = [c for c, h in zip(costs, history) if h.get("on_policy")]
    off = [c for c, h in zip(costs, history) if not h.get("on_policy")]
    return {"fraction": fraction, "steps": len(costs), "on_policy_steps": len(on), "median_step_s":
            statistics.median(costs), "mean_step_s": statistics.fmean(costs),
            "median_on_policy_step_s": statistics.median(on) if on else None,
            "median_off_policy_step_s": statistics.median(off) if off else None,
            "median_sample_s": statistics.median([h["sample_s"] for h in history if h.get("on_policy")])
            if on else None, "run_wall_s": wall}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", default="tiny", help="a pair of bench/students.py (tiny, 270m, ...)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of each run's figures")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = parser.parse_args(argv)

    import jax

    from students import ensure_pair
    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained
    from nnx_surgery.surgery.modeling.generation import make_sampler

    teacher_folder, student_folder = ensure_pair(args.scale)
    teacher = load_pretrained(teacher_folder, dtype="float32")
    sampler = make_sampler(stop=())  # no early stop: every sample runs its whole length
    one_run(teacher, student_folder, 1.0, args.warmup + 1, args, sampler)  # compiles the step and the sampler
    runs: dict[float, list[dict]] = {0.0: [], 0.5: []}
    for repeat in range(args.repeats):
        for fraction in ((0.0, 0.5) if repeat % 2 == 0 else (0.5, 0.0)):
            record = one_run(teacher, student_folder, fraction, args.warmup + args.steps, args, sampler)
            runs[fraction].append(record)
            common.emit(common.round_floats({"bench": "on_policy", "scale": args.scale, "repeat": repeat, **record}),
                        args.out)
    summary = {"bench": "on_policy", "summary": True, "scale": args.scale, "batch": args.batch, "seq": args.seq,
               "prompt": args.seq // 2, "new_tokens": args.seq - args.seq // 2, "steps": args.steps,
               "repeats": args.repeats, "backend": jax.default_backend()}
    for fraction, records in runs.items():
        name = f"lambda_{fraction:g}"
        for key in ("median_step_s", "mean_step_s", "median_on_policy_step_s", "median_off_policy_step_s",
                    "median_sample_s"):
            summary[f"{name}_{key}"] = common.median(r[key] for r in records)
        summary[f"{name}_on_policy_share"] = sum(r["on_policy_steps"] for r in records) / sum(r["steps"] for r in
                                                                                              records)
    # the cost per step at lambda = 0.5 from the two kinds of step (a short run's draws need not be half and half)
    summary["lambda_0.5_expected_step_s"] = 0.5 * (summary["lambda_0.5_median_on_policy_step_s"]
                                                   + summary["lambda_0.5_median_off_policy_step_s"])
    summary["expected_step_ratio"] = common.ratio(summary["lambda_0.5_expected_step_s"],
                                                  summary["lambda_0_median_step_s"])
    summary["mean_step_ratio"] = common.ratio(summary["lambda_0.5_mean_step_s"], summary["lambda_0_mean_step_s"])
    summary["on_policy_step_ratio"] = common.ratio(summary["lambda_0.5_median_on_policy_step_s"],
                                                   summary["lambda_0_median_step_s"])
    summary["versions"] = common.versions()
    common.emit(common.round_floats(summary), args.out)
    print(f"\nlambda 0: median step {summary['lambda_0_median_step_s'] * 1e3:.1f} ms | lambda 0.5: mean step "
          f"{summary['lambda_0.5_mean_step_s'] * 1e3:.1f} ms (on-policy steps "
          f"{summary['lambda_0.5_median_on_policy_step_s'] * 1e3:.1f} ms, of which sampling "
          f"{summary['lambda_0.5_median_sample_s'] * 1e3:.1f} ms; off-policy steps "
          f"{summary['lambda_0.5_median_off_policy_step_s'] * 1e3:.1f} ms) -> x{summary['expected_step_ratio']:.2f} "
          f"per step at lambda 0.5 (half of each kind), x{summary['on_policy_step_ratio']:.2f} for an on-policy step",
          file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()

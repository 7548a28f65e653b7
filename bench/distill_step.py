"""Logit-distillation step: tokens/s and peak RSS of ours vs Tunix vs a plain PyTorch loop, same work.

    python bench/distill_step.py --scale tiny            # tiny Gemma 3, dispatch-bound
    python bench/distill_step.py --scale 270m --repeats 3 --warmup 3 --steps 8

Same teacher and student files for every peer (bench/students.py: a synthetic teacher of a real shape and a
student cut from it by our surgery), same batches (`default_rng(0).integers(0, V, (B, T))`, one fresh batch per
step), same loss (forward KL(teacher || student) at temperature 1 over positions 0..T-2, mean over B*(T-1) tokens),
same optimizer (AdamW lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 1e-4 on every parameter, no clipping),
fp32 parameters and compute on CPU. Peers:

* ours   `distill.run(teacher, student, data, DistillConfig(...))`: fused chunked KL, one jitted step; step times
         from its history (`step_time_s`, synchronous: the loss is read back every step).
* tunix  `DistillationTrainer` + `LogitStrategy(temperature=1, alpha=1)` (bench/peers/tunix_peer.py).
* torch  transformers models in a plain PyTorch loop (bench/peers/torch_peer.py).

Each run is a fresh process; peers alternate within each repeat (the first peer rotates). One JSON line per run,
then a summary: medians over repeats of each run's median step, same-run ratios (median of per-repeat ratios),
counted FLOPs (bench/flops.py) and the fraction of the 180 GFLOP/s matmul peak measured on this CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from flops import step_flops  # noqa: E402

PEERS = ("ours", "tunix", "torch")
CPU_PEAK_FLOPS = 180e9  # fp32 matmul peak of this 2-core CPU (peers_270m.md §5: 168.5 GFLOP/s reproduced on 2048^3)
DEFAULTS = {"tiny": dict(batch=4, seq=64, warmup=3, steps=20, repeats=3),
            "270m": dict(batch=2, seq=128, warmup=3, steps=8, repeats=3)}
TARGETS = {"270m": {"speedup_vs_tunix": 1.3, "rss_vs_tunix": 0.6, "speedup_vs_torch": 1.0},
           "tiny": {"speedup_vs_torch": 1.0}}


def batches(vocab: int, batch: int, seq: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    while True:
        yield {"input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int32)}


def child_ours(args) -> dict:
    import jax
    import numpy as np

    from nnx_surgery.distill.loop.run_config import DistillConfig, GuardConfig, LossWeights, OptimizerConfig, Stage
    from nnx_surgery.distill.loop.step_runner import logit_block, logit_chunk
    from nnx_surgery.distill.loop.trainer import run
    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained

    dtype = "float32" if args.dtype == "float32" else "bfloat16"
    teacher = load_pretrained(args.teacher, dtype=args.teacher_dtype or dtype)
    student = load_pretrained(args.student, dtype="float32")
    jax.block_until_ready((teacher, student))
    rss_after_load = common.current_rss_bytes()
    total = args.warmup + args.steps
    stage = Stage(steps=total, learning_rate=args.lr, min_lr_ratio=1.0, weights=LossWeights(kl=1.0))
    extra = {"logit_chunk": args.chunk} if args.chunk else {}
    extra.update({"logit_block": args.block} if args.block else {})
    config = DistillConfig(stages=(stage,), batch_size=args.batch, seq_len=args.seq,
                           optimizer=OptimizerConfig(weight_decay=1e-4, clip_norm=None, decay_matrices_only=False),
                           guard=GuardConfig(enabled=False), progress=False, plots=False,
                           compute_dtype=dtype, **extra)
    start = time.perf_counter()
    result = run(teacher, student, batches(teacher.config.vocab_size, args.batch, args.seq, args.seed), config)
    wall = time.perf_counter() - start
    times = [h["step_time_s"] for h in result.history]
    measured = times[args.warmup:]
    step = float(np.median(measured))
    losses = [h["loss"] for h in result.history]
    stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
    return {**common.device_memory(stats), "peer": "ours", "median_step_s": step, "tokens_per_s": args.batch * args.seq / step,
            "step_times_s": [round(x, 4) for x in measured], "first_step_s": times[0],
            "peak_rss_bytes": common.peak_rss_bytes(), "rss_after_load_bytes": rss_after_load,
            "loss_first": losses[0], "loss_last": losses[-1], "train_wall_s": wall, "batch": args.batch,
            "seq": args.seq, "logit_chunk": logit_chunk(config), "logit_block": logit_block(config),
            "versions": common.versions()}


def peer_command(peer: str, args, teacher: str, student: str) -> list[str]:
    common_args = ["--teacher", teacher, "--student", student, "--batch", str(args.batch), "--seq", str(args.seq),
                   "--warmup", str(args.warmup), "--steps", str(args.steps), "--lr", str(args.lr),
                   "--dtype", args.dtype]
    if peer == "ours":
        extra = ["--chunk", str(args.chunk)] if args.chunk else []
        extra += ["--block", str(args.block)] if args.block else []
        return [sys.executable, os.path.abspath(__file__), "--child", *common_args, *extra]
    if peer == "torch":
        return [sys.executable, os.path.join(common.BENCH, "peers", "torch_peer.py"), "distill", *common_args]
    from tunix_env import ensure_tunix_python

    return [ensure_tunix_python(), os.path.join(common.BENCH, "peers", "tunix_peer.py"), "distill", *common_args]


def summarise(scale: str, runs: dict[str, list[dict]], flops: float, args) -> dict:
    summary = {"bench": "distill_step", "summary": True, "scale": scale, "batch": args.batch, "seq": args.seq,
               "repeats": args.repeats, "warmup": args.warmup, "steps": args.steps,
               "step_gflop": flops / 1e9, "ideal_tokens_per_s": args.batch * args.seq * CPU_PEAK_FLOPS / flops}
    ok = {peer: [r for r in records if "median_step_s" in r] for peer, records in runs.items()}
    for peer, records in ok.items():
        step = common.median(r["median_step_s"] for r in records)
        summary[f"{peer}_tokens_per_s"] = None if step is None else args.batch * args.seq / step
        summary[f"{peer}_step_s"] = step
        summary[f"{peer}_peak_rss_gib"] = common.median(r["peak_rss_bytes"] / common.GIB for r in records)
        summary[f"{peer}_fraction_of_peak"] = None if step is None else flops / step / CPU_PEAK_FLOPS
        summary[f"{peer}_loss_first"] = records[0]["loss_first"] if records else None
        summary[f"{peer}_runs"] = len(records)
        errors = [r.get("error") for r in runs[peer] if "median_step_s" not in r]
        if errors:
            summary[f"{peer}_errors"] = errors
    for peer in ok:
        if peer == "ours":
            continue
        pairs = [(o["median_step_s"], p["median_step_s"], o["peak_rss_bytes"], p["peak_rss_bytes"])
                 for o, p in zip(runs.get("ours", []), runs[peer]) if "median_step_s" in o and "median_step_s" in p]
        summary[f"speedup_vs_{peer}"] = common.median(p / o for o, p, _, _ in pairs)
        summary[f"rss_vs_{peer}"] = common.median(ro / rp for _, _, ro, rp in pairs)
        summary[f"speedup_vs_{peer}_per_repeat"] = [round(p / o, 3) for o, p, _, _ in pairs]
    losses = [summary.get(f"{p}_loss_first") for p in ok if summary.get(f"{p}_loss_first") is not None]
    if len(losses) > 1:
        summary["loss_first_spread"] = max(losses) - min(losses)  # same work: the peers' first losses agree
    targets = TARGETS.get(scale, {})
    met = {}
    for key, bound in targets.items():
        value = summary.get(key)
        if value is not None:
            met[key] = value <= bound if key.startswith("rss") else value >= bound
    summary["targets"] = targets
    summary["targets_met"] = met
    return common.round_floats(summary, 5)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", default="tiny", choices=("tiny", "270m"))
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--teacher")
    parser.add_argument("--student")
    for name in ("batch", "seq", "warmup", "steps", "repeats"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--teacher-dtype", default=None, help="ours only: teacher weights dtype (default --dtype)")
    parser.add_argument("--chunk", type=int, default=None, help="ours: DistillConfig.logit_chunk (rows per chunk)")
    parser.add_argument("--block", type=int, default=None,
                        help="ours: rows per teacher-logits / head-gradient block (default: the trainer's)")
    parser.add_argument("--out")
    parser.add_argument("--min-free-gib", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS.get(args.scale, DEFAULTS["tiny"]).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.child:
        print(json.dumps(child_ours(args), default=str))
        return
    teacher, student = args.teacher, args.student
    if not teacher or not student:
        from students import ensure_pair

        teacher, student = ensure_pair(args.scale)
    flops = step_flops(teacher, student, args.batch, args.seq)
    peers = [p for p in args.peers.split(",") if p]
    commands = {peer: peer_command(peer, args, teacher, student) for peer in peers}
    runs: dict[str, list[dict]] = {peer: [] for peer in peers}
    for repeat in range(args.repeats):
        order = peers[repeat % len(peers):] + peers[:repeat % len(peers)]
        for peer in order:
            if args.min_free_gib:
                common.wait_for_memory(args.min_free_gib)
            record = common.run_child(commands[peer], timeout=args.timeout)
            record.update(bench="distill_step", scale=args.scale, peer=peer, repeat=repeat)
            if "median_step_s" in record:
                record["gflop_per_s"] = flops / record["median_step_s"] / 1e9
            common.emit(common.round_floats(record, 6), args.out)
            runs[peer].append(record)
    common.emit(summarise(args.scale, runs, flops, args), args.out)


if __name__ == "__main__":
    main()

"""Scaling: the same distillation step on 1 vs 8 host CPU devices, meshes (fsdp, tp) = (8,1), (4,2), (2,4).

    python bench/mesh.py                        # a small Gemma 3 pair (all sizes divisible by 8 and by tp=4)

Each configuration runs in its own process with `XLA_FLAGS=--xla_force_host_platform_device_count=N`, loads the
teacher and student sharded (`load_pretrained(..., mesh=)`), trains `--steps` steps with `distill.run` and reports:

* per-device bytes (the largest device) of the student's parameters, of the Adam state (`StepRunner.enter_stage`
  creates it exactly as `run` does, sharded like the parameters), and of the teacher, and their ratio to the
  1-device figure: under FSDP they must fall as 1/N;
* the step time (8 "devices" share this machine's 2 cores, so on CPU it only shows the sharded step runs; it says
  nothing about multi-chip speed) and the first loss (the same on every mesh: same math).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MESHES = ("1", "fsdp=8,tp=1", "fsdp=4,tp=2", "fsdp=2,tp=4")
# teacher: Gemma 3 layout with every sharded size divisible by 8 (fsdp) and 4 (tp, incl. the 4 KV heads)
TEACHER = ("tiny-gemma3", {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
                           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
                           "query_pre_attn_scalar": 32, "num_hidden_layers": 4})
STUDENT = (2, 256, 512, 8, 4)


def per_device_bytes(tree) -> tuple[int, int]:
    """(bytes on the fullest device, bytes summed over devices) of the arrays in `tree`."""
    import jax

    by_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", []):
            by_device[shard.device] = by_device.get(shard.device, 0) + shard.data.nbytes
    return (max(by_device.values()) if by_device else 0), sum(by_device.values())


def child(args) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from nnx_surgery.distill.loop.run_config import DistillConfig, GuardConfig, LossWeights, OptimizerConfig, Stage
    from nnx_surgery.distill.interface import Correspondence
    from nnx_surgery.distill.mesh import make_mesh
    from nnx_surgery.distill.loop.step_runner import StepRunner
    from nnx_surgery.distill.loop.trainer import run
    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained

    mesh = None if args.child == "1" else make_mesh(args.child)
    teacher = load_pretrained(args.teacher, dtype="float32", mesh=mesh)
    student = load_pretrained(args.student, dtype="float32", mesh=mesh)
    stage = Stage(steps=args.warmup + args.steps, learning_rate=1e-4, min_lr_ratio=1.0, weights=LossWeights(kl=1.0))
    config = DistillConfig(stages=(stage,), batch_size=args.batch, seq_len=args.seq, mesh=mesh,
                           optimizer=OptimizerConfig(weight_decay=1e-4, clip_norm=None, decay_matrices_only=False),
                           guard=GuardConfig(enabled=False), progress=False, plots=False)
    session = StepRunner(teacher, student, config, mesh, Correspondence(), {})
    if mesh is not None:
        with jax.set_mesh(mesh):
            session.enter_stage(0, carry=False)
    else:
        session.enter_stage(0, carry=False)
    params_dev, params_all = per_device_bytes(session.params)
    opt_dev, opt_all = per_device_bytes(session.opt)
    teacher_dev, teacher_all = per_device_bytes(nnx.state(teacher))
    del session

    def data():
        rng = np.random.default_rng(0)
        while True:
            yield {"input_ids": rng.integers(0, teacher.config.vocab_size, (args.batch, args.seq)).astype(np.int32)}

    start = time.perf_counter()
    result = run(teacher, student, data(), config)
    wall = time.perf_counter() - start
    times = [h["step_time_s"] for h in result.history][args.warmup:]
    return {"mesh": args.child, "devices": 1 if mesh is None else mesh.size,
            "student_param_bytes_per_device": params_dev, "student_param_bytes_total": params_all,
            "adam_bytes_per_device": opt_dev, "adam_bytes_total": opt_all,
            "teacher_bytes_per_device": teacher_dev, "teacher_bytes_total": teacher_all,
            "median_step_s": float(np.median(times)), "loss_first": result.history[0]["loss"],
            "loss_last": result.history[-1]["loss"], "train_wall_s": wall, "peak_rss_bytes": common.peak_rss_bytes()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--meshes", default=";".join(MESHES), help="';'-separated: '1' or 'fsdp=4,tp=2' ...")
    parser.add_argument("--teacher")
    parser.add_argument("--student")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args), default=str))
        return
    teacher, student = args.teacher, args.student
    if not teacher or not student:
        from make_checkpoint import ensure_checkpoint
        from students import _import

        teacher = ensure_checkpoint(TEACHER[0], os.path.join(common.CKPT_DIR, "mesh-teacher"), overrides=TEACHER[1])
        student = os.path.join(common.CKPT_DIR, "mesh-student")
        if not os.path.exists(os.path.join(student, "config.json")):
            plan = _import("nnx_surgery.surgery.planning.student_planner", "plan_student")(teacher, _import("nnx_surgery.surgery.plans.student_spec", "StudentSpec")(*STUDENT),
                                                              depth="uniform", width="magnitude")
            _import("nnx_surgery.surgery.pruning.on_disk", "prune_checkpoint")(teacher, plan, student, report=False)
    records = []
    for mesh in [m for m in args.meshes.split(";") if m]:
        devices = 1 if mesh == "1" else 1
        for part in mesh.split(","):
            if "=" in part:
                devices *= int(part.split("=")[1])
        env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mesh, "--teacher", teacher, "--student", student,
               "--batch", str(args.batch), "--seq", str(args.seq), "--warmup", str(args.warmup),
               "--steps", str(args.steps)]
        record = common.run_child(cmd, env=env, timeout=args.timeout)
        record.update(bench="mesh", mesh=mesh)
        records.append(record)
    base = next((r for r in records if r.get("devices") == 1), None)
    for record in records:
        if base and "adam_bytes_per_device" in record:
            n = record["devices"]
            for key in ("student_param", "adam", "teacher"):
                record[f"{key}_fraction_of_1_device"] = record[f"{key}_bytes_per_device"] / base[
                    f"{key}_bytes_per_device"]
            record["ideal_fraction"] = 1.0 / n
            record["loss_first_diff_vs_1_device"] = abs(record["loss_first"] - base["loss_first"])
        common.emit(common.round_floats(record, 6), args.out)
    ok = [r for r in records if "adam_fraction_of_1_device" in r and r["devices"] > 1]
    summary = {"bench": "mesh", "summary": True,
               "meshes": {r["mesh"]: {"param_fraction": r["student_param_fraction_of_1_device"],
                                      "adam_fraction": r["adam_fraction_of_1_device"],
                                      "ideal": r["ideal_fraction"]} for r in ok},
               "falls_as_1_over_n": bool(ok) and all(
                   r["adam_fraction_of_1_device"] <= 1.05 * r["ideal_fraction"]
                   and r["student_param_fraction_of_1_device"] <= 1.05 * r["ideal_fraction"] for r in ok),
               "max_loss_first_diff": max((r["loss_first_diff_vs_1_device"] for r in ok), default=None)}
    common.emit(common.round_floats(summary, 6), args.out)


if __name__ == "__main__":
    main()

"""The GPU check (run by bench/gpu.sh): load throughput and distillation steps on one accelerator, < 8 minutes.

On a GPU (full scale): a random Gemma-2-2B-shaped teacher (bf16, 5.2 GB, written by make_checkpoint.py), a ~1B
student cut from it on disk by our surgery (13 of 26 layers, MLP 9216 -> 3072: 1.05B parameters), then

1. load: `load_pretrained(teacher)` onto the device, cold (teacher files evicted from the page cache) and warm;
   GB/s of checkpoint bytes;
2. distill: `distill.run` with a bf16 teacher, bf16 student compute and float32 master weights, forward KL;
   tokens/s and model FLOPs utilisation = counted FLOPs (bench/flops.py) / step time / 989 TFLOP/s (H200 bf16
   dense peak). One process loads both models once and runs a sweep of step settings (batch, logit-chunk rows,
   rematerialisation; `--sweep`), each compiled afresh; a setting that runs out of memory is recorded and skipped
   (the student keeps training from one point to the next, so only the first point's loss starts from the cut);
3. a trace: `--trace-steps` (3) more steps at the fastest point under `jax.profiler.trace`; the perfetto file is
   kept as step_trace.json.gz next to --out and summarised by bench/trace_summary.py (device time per step by
   kind of kernel, busiest kernels) into one record;
4. where the time goes (if time is left): bench/step_parts.py times the step's parts (teacher forward, student
   trunk forward + backward, fused logit loss, AdamW) and a large matmul (the chip's practical peak) at our
   fastest sweep point;
5. peer (if time is left): the plain PyTorch KD step on the same files on the same device, bf16.

On CPU it runs the same code at tiny shapes (a 4-layer Gemma 2 and a 2-layer student), against the 180 GFLOP/s
fp32 peak measured on the 2-core development machine, so the script is tested where no GPU is. One JSON line per
measurement (also appended to --out).
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

H200_BF16_PEAK = 989e12
CPU_PEAK = 180e9
BUDGET_S = 8 * 60


def backend() -> tuple[str, str]:
    import jax

    device = jax.devices()[0]
    return jax.default_backend(), getattr(device, "device_kind", str(device))


def child_load(folder: str) -> dict:
    import jax
    from flax import nnx

    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained

    jax.devices()
    start = time.perf_counter()
    model = load_pretrained(folder)
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - start
    return {"load_s": seconds, "peak_rss_bytes": common.peak_rss_bytes()}


# (batch, logit_chunk rows or None for the package default, remat) per sweep point, in order of priority
SWEEPS = {"gpu": "8:2048:none,16:4096:none", "tiny": "2:0:none,4:64:dots"}


def parse_sweep(text: str) -> list[dict]:
    points = []
    for item in filter(None, text.split(",")):
        batch, chunk, remat = item.split(":")
        points.append({"batch": int(batch), "chunk": int(chunk) or None, "remat": None if remat == "none" else remat})
    return points


def child_sweep(args) -> dict:
    """Ours: load both models once, then one `distill.run` per sweep point; each point's record is emitted as
    soon as it is measured, so a timeout loses only the point in progress."""
    import jax
    import numpy as np

    from nnx_surgery.distill.loop.step_runner import logit_chunk
    from nnx_surgery.distill.loop.trainer import run
    from distill_step import batches
    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained

    deadline = time.perf_counter() + args.child_budget
    teacher = load_pretrained(args.teacher, dtype=args.dtype)
    student = load_pretrained(args.student, dtype="float32")
    jax.block_until_ready((teacher, student))
    peak = H200_BF16_PEAK if jax.default_backend() == "gpu" else CPU_PEAK
    done, last_cost, best, best_point = 0, 0.0, {}, None
    for point in parse_sweep(args.sweep):
        if done and time.perf_counter() + 1.2 * last_cost > deadline:
            common.emit({"bench": "gpu", "event": "skipped", "peer": "ours", **point, "reason": "time budget"},
                        args.out)
            continue
        began = time.perf_counter()
        config = point_config(point, args.seq, args.dtype, args.warmup + args.steps)
        chunk = logit_chunk(config)
        record = {"bench": "gpu", "event": "distill", "peer": "ours", "seq": args.seq, "dtype": args.dtype,
                  "logit_chunk": chunk, **point}
        try:
            result = run(teacher, student, batches(teacher.config.vocab_size, point["batch"], args.seq, 0), config)
        except Exception as error:  # out of memory (or anything else) at one point must not lose the others
            text = f"{type(error).__name__}: {error}"
            record.update(error=text[:2000], oom="RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower())
            common.emit(record, args.out)
            continue
        times = [h["step_time_s"] for h in result.history]
        step = float(np.median(times[args.warmup:]))
        flops = step_flops(args.teacher, args.student, point["batch"], args.seq)
        record.update(median_step_s=step, tokens_per_s=point["batch"] * args.seq / step, first_step_s=times[0],
                      step_times_s=[round(t, 4) for t in times[args.warmup:]], step_tflop=flops / 1e12,
                      tflop_per_s=flops / step / 1e12, mfu=flops / step / peak,
                      loss_first=result.history[0]["loss"], loss_last=result.history[-1]["loss"],
                      point_wall_s=time.perf_counter() - began)
        stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
        record.update(common.device_memory(stats))
        if not done:  # the first point: the device's peak so far is this step's (later points only raise it)
            record.update(compiled_step_bytes(teacher, student, config, record.get("peak_device_bytes"),
                                              (stats or {}).get("bytes_limit")))
        common.emit(common.round_floats(record, 6), args.out)
        done, last_cost = done + 1, time.perf_counter() - began
        if record["tokens_per_s"] > best.get("best_tokens_per_s", 0.0):
            best = {"best_batch": point["batch"], "best_chunk": chunk, "best_tokens_per_s": record["tokens_per_s"], "best_mfu": record["mfu"]}
            best_point = point
        del result
    if args.trace_steps and done and time.perf_counter() + 0.8 * last_cost < deadline:
        trace_point(teacher, student, best_point, args)
    return {"points_done": done, **best, "peak_rss_bytes": common.peak_rss_bytes()}


def compiled_step_bytes(teacher, student, config, peak: int | None, device_bytes: int | None = None) -> dict:
    """What `--aot` would say of this point's train step: XLA's memory analysis of the same step compiled apart for
    this device (abstract arguments, `distill.loop.lowering`), beside the device's measured peak (which also holds
    the loaded models' copies the step does not use, so it reads at or above the compiled total)."""
    from nnx_surgery.distill.loop.lowering import train_step_program
    from nnx_surgery.distill.mesh import make_mesh

    began = time.perf_counter()
    try:
        # device_bytes: the logit chunk the run picks on this device (logit_term.logit_chunk sizes it from the
        # device's memory), so the analysis is of the program the run executes
        program = train_step_program(teacher, student, config, make_mesh("fsdp=1", devices=1), 0,
                                     device_bytes=device_bytes)
        analysis = program.lower().compile().memory_analysis()
    except Exception as error:  # noqa: BLE001  (the timed point stands without it)
        return {"compiled_error": f"{type(error).__name__}: {error}"[:500]}
    total = (analysis.argument_size_in_bytes + analysis.temp_size_in_bytes + analysis.output_size_in_bytes
             - analysis.alias_size_in_bytes)
    found = {"compiled_total_bytes": int(total), "compiled_temp_bytes": int(analysis.temp_size_in_bytes),
             "compile_for_analysis_s": round(time.perf_counter() - began, 1)}
    if peak:
        found["peak_to_compiled"] = round(peak / total, 4)
    return found


def point_config(point: dict, seq: int, dtype: str, steps: int):
    from nnx_surgery.distill.loop.run_config import DistillConfig, GuardConfig, LossWeights, OptimizerConfig, Stage

    stage = Stage(steps=steps, learning_rate=1e-4, min_lr_ratio=1.0, weights=LossWeights(kl=1.0))
    extra = {"logit_chunk": point["chunk"]} if point["chunk"] else {}
    return DistillConfig(stages=(stage,), batch_size=point["batch"], seq_len=seq,
                         optimizer=OptimizerConfig(weight_decay=1e-4, clip_norm=None, decay_matrices_only=False),
                         guard=GuardConfig(enabled=False), progress=False, plots=False,
                         compute_dtype=dtype, remat=point["remat"], **extra)


def trace_point(teacher, student, point: dict, args) -> None:
    """`--trace-steps` more steps at `point` under `jax.profiler.trace`: the perfetto trace is kept next to the
    results (step_trace.json.gz) and summarised (bench/trace_summary.py) into one record."""
    import glob
    import shutil
    import tempfile

    import jax

    from nnx_surgery.distill.loop.trainer import run
    from distill_step import batches
    from trace_summary import summarize

    record = {"bench": "gpu", "event": "trace", "peer": "ours", "seq": args.seq, **point}
    config = point_config(point, args.seq, args.dtype, args.trace_steps)
    with tempfile.TemporaryDirectory() as folder:
        try:
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0  # no event per Python call: device kernels and XLA's host events only
            with jax.profiler.trace(folder, create_perfetto_trace=True, profiler_options=options):
                run(teacher, student, batches(teacher.config.vocab_size, point["batch"], args.seq, 1), config)
            found = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
            kept = os.path.join(os.path.dirname(os.path.abspath(args.out)), "step_trace.json.gz")
            shutil.copyfile(found[0], kept)
            record.update(file=kept, bytes=os.path.getsize(kept), **summarize(kept, steps=args.trace_steps))
        except Exception as error:  # the trace is a diagnostic: its failure must not lose the sweep's records
            record["error"] = f"{type(error).__name__}: {error}"[:2000]
    common.emit(record, args.out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=("auto", "gpu", "tiny"), default="auto")
    parser.add_argument("--root", default=os.environ.get("BENCH_GPU_ROOT", os.path.join(common.OUT, "gpu-ckpt")))
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peers", default="ours,parts,torch")
    parser.add_argument("--sweep", help="ours: batch:chunk:remat,... (chunk 0: default; remat none|dots|full)")
    parser.add_argument("--out", default=os.path.join(common.OUT, "gpu.jsonl"))
    parser.add_argument("--child-load", help=argparse.SUPPRESS)
    parser.add_argument("--child-sweep", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--teacher", help=argparse.SUPPRESS)
    parser.add_argument("--student", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--child-budget", type=float, default=BUDGET_S, help=argparse.SUPPRESS)
    parser.add_argument("--trace-steps", type=int, default=3,
                        help="ours: steps traced with jax.profiler at the fastest point (0: no trace)")
    args = parser.parse_args(argv)
    if args.child_load:
        print(json.dumps(child_load(args.child_load)))
        return
    if args.child_sweep:
        print(json.dumps(child_sweep(args)))
        return
    started = time.perf_counter()
    kind, device = backend()
    scale = ("gpu" if kind == "gpu" else "tiny") if args.scale == "auto" else args.scale
    batch = args.batch or (8 if scale == "gpu" else 2)
    seq = args.seq or (1024 if scale == "gpu" else 32)
    peak = H200_BF16_PEAK if kind == "gpu" else CPU_PEAK
    dtype = "bfloat16" if scale == "gpu" else "float32"
    common.emit({"bench": "gpu", "event": "start", "backend": kind, "device": device, "scale": scale,
                 "peak_flops": peak, "machine": common.machine(), "versions": common.versions()}, args.out)

    from students import ensure_pair

    t0 = time.perf_counter()
    teacher, student = ensure_pair("2b" if scale == "gpu" else "tiny2", root=args.root)
    size = common.checkpoint_bytes(teacher)
    common.emit({"bench": "gpu", "event": "checkpoints", "teacher_bytes": size,
                 "student_bytes": common.checkpoint_bytes(student), "seconds": time.perf_counter() - t0}, args.out)

    # 1. load throughput (cold, then warm), each in a fresh process
    for cache in ("cold", "warm"):
        if cache == "cold":
            common.evict_from_page_cache(common.safetensors_files(teacher))
        record = common.run_child([sys.executable, os.path.abspath(__file__), "--child-load", teacher], timeout=300)
        if "load_s" in record:
            record["gb_per_s"] = size / record["load_s"] / 1e9
        common.emit(common.round_floats({"bench": "gpu", "event": "load", "cache": cache, **record}), args.out)

    # 2. distillation steps: ours (a sweep of settings in one process), then the torch peer if time allows
    sweep = args.sweep or SWEEPS[scale]
    if args.batch:  # an explicit batch replaces the sweep's batches
        sweep = ",".join(f"{args.batch}:{p.split(':', 1)[1]}" for p in sweep.split(","))
    best = {"batch": batch}
    for peer in [p for p in args.peers.split(",") if p]:
        elapsed = time.perf_counter() - started
        if peer == "ours":
            budget = BUDGET_S * (0.55 if "parts" in args.peers else 0.75 if "torch" in args.peers else 0.95) - elapsed
            cmd = [sys.executable, os.path.abspath(__file__), "--child-sweep", "--teacher", teacher, "--student",
                   student, "--seq", str(seq), "--warmup", str(args.warmup), "--steps", str(args.steps), "--dtype",
                   dtype, "--sweep", sweep, "--out", args.out, "--child-budget", str(max(30.0, budget - 20)),
                   "--trace-steps", str(args.trace_steps)]
            record = common.run_child(cmd, timeout=max(60, budget + 30))
            record.pop("versions", None)
            common.emit(common.round_floats({"bench": "gpu", "event": "sweep_end", "peer": peer, **record}),
                        args.out)
            if record.get("best_batch"):
                best = {"batch": record["best_batch"], "chunk": record.get("best_chunk")}
            continue
        if peer == "parts":
            if elapsed > BUDGET_S * 0.7:
                common.emit({"bench": "gpu", "event": "skipped", "peer": peer, "reason": "time budget"}, args.out)
                continue
            cmd = [sys.executable, os.path.join(common.BENCH, "step_parts.py"), "--teacher", teacher, "--student",
                   student, "--batch", str(best["batch"]), "--seq", str(seq), "--dtype", dtype,
                   "--matmul", "8192" if kind == "gpu" else "512"]
            cmd += ["--chunk", str(best["chunk"])] if best.get("chunk") else []  # else the package's default
            record = common.run_child(cmd, timeout=max(60, BUDGET_S * 0.9 - elapsed))
            record.pop("bench", None)
            common.emit(common.round_floats({"bench": "gpu", "event": "parts", **record}, 6), args.out)
            continue
        if elapsed > BUDGET_S * 0.85:
            common.emit({"bench": "gpu", "event": "skipped", "peer": peer, "reason": "time budget"}, args.out)
            continue
        b = best["batch"]  # the peer runs the batch of our fastest point (halved on out-of-memory)
        while b >= 1:
            cmd = _distill_command(peer, teacher, student, b, seq, args, dtype, kind)
            record = common.run_child(cmd, timeout=max(60, BUDGET_S - (time.perf_counter() - started)))
            oom = "RESOURCE_EXHAUSTED" in record.get("stderr_tail", "") or "out of memory" in record.get(
                "stderr_tail", "").lower()
            if oom and b > 1:
                common.emit({"bench": "gpu", "event": "oom", "peer": peer, "batch": b}, args.out)
                b //= 2
                continue
            break
        if "median_step_s" in record:
            flops = step_flops(teacher, student, b, seq)
            record["step_tflop"] = flops / 1e12
            record["mfu"] = flops / record["median_step_s"] / peak
            record["tflop_per_s"] = flops / record["median_step_s"] / 1e12
        record.pop("versions", None)
        common.emit(common.round_floats({"bench": "gpu", "event": "distill", "peer": peer, "batch": b, "seq": seq,
                                         "dtype": dtype, **record}, 6), args.out)
    common.emit({"bench": "gpu", "event": "end", "seconds": round(time.perf_counter() - started, 1)}, args.out)


def _distill_command(peer, teacher, student, batch, seq, args, dtype, kind) -> list[str]:
    base = ["--teacher", teacher, "--student", student, "--batch", str(batch), "--seq", str(seq),
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--dtype", dtype]
    if peer == "ours":
        # On an accelerator the fused KL works on big chunks (2048 rows: 2 GB of f32 logits per model per chunk);
        # on CPU the default (32 rows) is the measured best.
        chunk = ["--chunk", "2048"] if kind == "gpu" else []
        return [sys.executable, os.path.join(common.BENCH, "distill_step.py"), "--child", *base, *chunk]
    return [sys.executable, os.path.join(common.BENCH, "peers", "torch_peer.py"), "distill", *base,
            "--device", "cuda" if kind == "gpu" else "cpu"]


if __name__ == "__main__":
    main()

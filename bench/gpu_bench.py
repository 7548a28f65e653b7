"""The GPU check (run by bench/gpu.sh): load throughput and distillation steps on one accelerator, < 8 minutes.

On a GPU (full scale): a random Gemma-2-2B-shaped teacher (bf16, 5.2 GB, written by make_checkpoint.py), a ~1B
student cut from it on disk by our surgery (13 of 26 layers, MLP 9216 -> 3072: 1.05B parameters), then

1. load: `load_pretrained(teacher)` onto the device, cold (teacher files evicted from the page cache) and warm;
   GB/s of checkpoint bytes;
2. distill: `distill.run` with a bf16 teacher, bf16 student compute and float32 master weights, forward KL;
   tokens/s and model FLOPs utilisation = counted FLOPs (bench/flops.py) / step time / 989 TFLOP/s (H200 bf16
   dense peak); the batch halves on out-of-memory;
3. peer (if time is left): the plain PyTorch KD step on the same files on the same device, bf16.

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

    from surgery.checkpoint import load_pretrained

    jax.devices()
    start = time.perf_counter()
    model = load_pretrained(folder)
    jax.block_until_ready(nnx.state(model))
    seconds = time.perf_counter() - start
    return {"load_s": seconds, "peak_rss_bytes": common.peak_rss_bytes()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=("auto", "gpu", "tiny"), default="auto")
    parser.add_argument("--root", default=os.environ.get("BENCH_GPU_ROOT", os.path.join(common.OUT, "gpu-ckpt")))
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peers", default="ours,torch")
    parser.add_argument("--out", default=os.path.join(common.OUT, "gpu.jsonl"))
    parser.add_argument("--child-load", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_load:
        print(json.dumps(child_load(args.child_load)))
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

    # 2. distillation steps: ours, then the torch peer if time allows; the batch halves on out-of-memory
    for peer in [p for p in args.peers.split(",") if p]:
        if peer != "ours" and time.perf_counter() - started > BUDGET_S * 0.6:
            common.emit({"bench": "gpu", "event": "skipped", "peer": peer, "reason": "time budget"}, args.out)
            continue
        b = batch
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

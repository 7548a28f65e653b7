"""The distillation step on one TPU chip, in one device call: speed with MFU, the chip's memory against XLA's
compiled figure, compile times, and the fused loss's own temporaries. JSON lines to --out; bench/report_tpu.py
renders them for BENCHMARKS.md.

    python bench/tpu_bench.py --points 270m:8:none:xla,270m:8:none:splash --out $OUT/tpu.jsonl

A point is PAIR:BATCH:REMAT:ATTENTION[:CHUNK[:BLOCK]][@LOGIT_IMPL] (DistillConfig.logit_impl: fused, the
default, is the Pallas kernels on a TPU; fused_xla XLA's chunked loss). Pairs (bench/students.py's shapes, synthetic weights made on the chip):
`270m` Gemma 3 270M -> its 9-layer student (640, MLP 2048, 4 heads, 1 KV head), `1b` Gemma 3 1B -> (13 layers,
1152, MLP 3456, 4 heads, 1 KV head). bf16 compute, float32 master weights, forward KL, AdamW, seq 2048.

FLOPs are bench/flops.py's count (6 N_student + 2 N_teacher per token, the tied head once, attention as the full
T x T block for both models, whatever the kernel skips), MFU of the chip's 197 TFLOP/s bf16 peak. Memory: the
chip's `bytes_in_use + bytes_reserved` (XLA reserves a program's temporaries apart from the allocator's buffers)
after the timed steps, beside XLA's memory analysis of the step the run compiled (`compiled_bytes`, from the
run's own compile: no second compile). Each process opens the chip once; points run in order and each is emitted
as soon as it is measured, so a time limit loses only the point in progress.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from flops import step_flops  # noqa: E402
from make_checkpoint import shape_config  # noqa: E402

V5E_PEAK = 197e12
SEQ = int(os.environ.get("TPU_BENCH_SEQ", 2048))  # 128 for the CPU smoke run of the tiny pair
PAIRS = {"270m": ("gemma-3-270m", {"num_hidden_layers": 9}),
         "1b": ("gemma-3-1b", {"num_hidden_layers": 13, "intermediate_size": 3456}),
         "tiny": ("tiny-gemma3", {"num_hidden_layers": 3})}  # a CPU smoke run of this script (--seq 128)


def parse_points(text: str) -> list[dict]:
    points = []
    for item in filter(None, text.split(",")):
        item, _, impl = item.partition("@")  # PAIR:...@LOGIT_IMPL (DistillConfig.logit_impl; default fused)
        impl = impl or "fused"
        pair, batch, remat, attention, *chunking = item.split(":")
        if pair not in PAIRS or attention not in ("xla", "splash", "auto") or len(chunking) > 2:
            raise SystemExit(f"--points {item}: PAIR:BATCH:REMAT:ATTENTION[:CHUNK[:BLOCK]] with PAIR in "
                             f"{sorted(PAIRS)} and ATTENTION xla, splash or auto")
        chunk, block = (list(map(int, chunking)) + [0, 0])[:2]
        points.append({"pair": pair, "batch": int(batch), "remat": None if remat == "none" else remat,
                       "attention": attention, "logit_chunk": chunk or None, "logit_block": block or None,
                       "logit_impl": impl})
    return points


def make_pair(pair: str):
    """(teacher bf16, student float32) with random weights made on the device, and their HF config dicts."""
    import jax.numpy as jnp

    from nnx_surgery.surgery.modeling.causal_lm import create_model

    shape, student_sizes = PAIRS[pair]
    teacher_config, student_config = shape_config(shape), shape_config(shape, student_sizes)
    teacher = create_model(teacher_config, dtype=jnp.bfloat16, seed=0)
    student = create_model(student_config, dtype=jnp.float32, seed=1)
    return teacher, student, teacher_config.to_hf_dict(), student_config.to_hf_dict()


def point_config(point: dict, steps: int):
    from nnx_surgery.distill.loop.run_config import DistillConfig, GuardConfig, LossWeights, OptimizerConfig, Stage

    stage = Stage(steps=steps, learning_rate=1e-4, min_lr_ratio=1.0, weights=LossWeights(kl=1.0))
    return DistillConfig(stages=(stage,), batch_size=point["batch"], seq_len=SEQ,
                         optimizer=OptimizerConfig(weight_decay=1e-4, clip_norm=None, decay_matrices_only=False),
                         guard=GuardConfig(enabled=False), progress=False, plots=False, compute_dtype="bfloat16",
                         remat=point["remat"], attention_kernel=point["attention"],
                         logit_chunk=point.get("logit_chunk"), logit_block=point.get("logit_block"),
                         logit_impl=point.get("logit_impl", "fused"))


def measure(point: dict, models: tuple, args) -> dict:
    """One point: `distill.run` for warm-up + timed steps; speed, MFU, the chip's memory and the compiled figure."""
    import jax
    import numpy as np

    from distill_step import batches
    from nnx_surgery.distill.loop.trainer import run

    teacher, student, teacher_hf, student_hf = models
    record = {"bench": "tpu", "event": "step", **point, "seq": SEQ, "tokens": point["batch"] * SEQ}
    began = time.perf_counter()
    try:
        result = run(teacher, student, batches(teacher_hf["vocab_size"], point["batch"], SEQ, 0),
                     point_config(point, args.warmup + args.steps))
    except Exception as error:  # noqa: BLE001  (an out-of-memory point is itself a result)
        text = f"{type(error).__name__}: {error}"
        return {**record, "error": text[:1500], "oom": "RESOURCE_EXHAUSTED" in text}
    history = result.history
    if not point.get("logit_chunk"):  # the run's default: record the chunk it chose (logit_term.logit_chunk)
        from nnx_surgery.distill.losses.logit_term import logit_chunk
        record["logit_chunk"] = logit_chunk(point_config(point, 1))
    times = [h["step_time_s"] for h in history][args.warmup:]
    step = float(np.median(times))
    flops = step_flops(teacher_hf, student_hf, point["batch"], SEQ)
    first = history[0]
    stats = jax.devices()[0].memory_stats()
    record.update(median_step_s=step, step_times_s=[round(t, 4) for t in times], tokens_per_s=record["tokens"] / step,
                  step_tflop=flops / 1e12, tflop_per_s=flops / step / 1e12, mfu=flops / step / V5E_PEAK,
                  first_step_s=first["step_time_s"], compile_s=first.get("compile_s"),
                  compiled_bytes=first.get("compiled_bytes"), compiled_temp_bytes=first.get("compiled_temp_bytes"),
                  loss_first=history[0]["loss"], loss_last=history[-1]["loss"], **common.device_memory(stats),
                  point_wall_s=time.perf_counter() - began)
    # XLA keeps the largest reservation a process made: the chip's figure is this step's at a process's first point
    record["first_in_process"] = args.first
    args.first = False
    if record.get("compiled_bytes") and record.get("peak_device_bytes") and record["first_in_process"]:
        record["chip_to_compiled"] = record["peak_device_bytes"] / record["compiled_bytes"]
    del result
    return record


def loss_temporaries(rows_per_batch: int, batch: int, impl: str = "fused_xla") -> dict:
    """XLA's temporaries of the logit loss alone (value and gradient for the 270M pair's head shapes at
    batch x 2048 tokens), compiled for this chip: XLA's chunked loss with the chunk the run picks (`fused_xla`),
    or the Pallas kernels (`kernel`)."""
    import jax
    import jax.numpy as jnp

    from nnx_surgery.distill.losses.divergence import LogitLossSettings, fused_logit_loss
    from nnx_surgery.distill.losses.logit_term import DEFAULT_LOGIT_BLOCK, accelerator_logit_chunk
    from nnx_surgery.distill.losses.tpu_kernel import kernel_logit_loss

    vocab, width = 262144, 640
    chunk = accelerator_logit_chunk(jax.devices()[0].memory_stats().get("bytes_limit"))
    spec = LogitLossSettings(kl=True, chunk=chunk, block=max(chunk, DEFAULT_LOGIT_BLOCK), unit_temperature=True)

    def logits(hidden, head):
        z = jnp.einsum("...D,VD->...V", hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)
        return jnp.tanh(z / 30.0) * 30.0

    def loss(hs, head_s, ht, head_t, labels, weights):
        coeffs = {"kl": 1.0, "ce": 0.0, "temperature": 1.0}
        if impl == "kernel":
            return kernel_logit_loss(hs, head_s, ht, head_t, labels, weights, coeffs, caps=(30.0, 30.0),
                                     spec=spec)[0]
        return fused_logit_loss(hs, head_s, ht, head_t, labels, weights, coeffs, student_logits=logits,
                                teacher_logits=logits, spec=spec)[0]

    shapes = ((batch, rows_per_batch, width), jnp.bfloat16), ((vocab, width), jnp.float32), \
        ((batch, rows_per_batch, width), jnp.bfloat16), ((vocab, width), jnp.bfloat16), \
        ((batch, rows_per_batch), jnp.int32), ((batch, rows_per_batch), jnp.float32)
    arguments = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    memory = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*arguments).compile().memory_analysis()
    return {"bench": "tpu", "event": "loss_memory", "logit_impl": impl, "tokens": batch * rows_per_batch,
            "logit_chunk": chunk if impl == "fused_xla" else None,
            "temp_bytes": int(memory.temp_size_in_bytes), "argument_bytes": int(memory.argument_size_in_bytes),
            "output_bytes": int(memory.output_size_in_bytes)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default="270m:8:none:xla,270m:8:none:splash,1b:4:none:xla,1b:4:none:splash")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--loss-batches", default="8", help="batches (x 2048 tokens) for the loss-alone compile")
    parser.add_argument("--loss-impls", default="fused_xla,kernel", help="logit losses for the loss-alone compile")
    parser.add_argument("--trace", default="", help="a point to trace with jax.profiler (bench/trace_summary.py)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--xla-cache", help="JAX's persistent compilation cache here (a later process reuses it)")
    args = parser.parse_args(argv)
    args.first = True
    import jax

    if args.xla_cache:
        jax.config.update("jax_compilation_cache_dir", args.xla_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

    device = jax.devices()[0]
    common.emit({"bench": "tpu", "event": "device", "kind": device.device_kind, "platform": device.platform,
                 "jax": jax.__version__, **common.device_memory(device.memory_stats())}, args.out)
    for batch in filter(None, args.loss_batches.split(",")):
        for impl in filter(None, args.loss_impls.split(",")):
            common.emit(common.round_floats(loss_temporaries(SEQ, int(batch), impl), 6), args.out)
    models, loaded = None, None
    for point in parse_points(args.points):
        if loaded != point["pair"]:
            models, loaded = None, None
            models, loaded = make_pair(point["pair"]), point["pair"]
        common.emit(common.round_floats(measure(point, models, args), 6), args.out)
    if args.trace:
        trace(parse_points(args.trace)[0], args)


def trace(point: dict, args) -> None:
    """Three steps of `point` under jax.profiler, summarised by device op kind (bench/trace_summary.py)."""
    import glob
    import shutil
    import tempfile

    import jax

    from distill_step import batches
    from nnx_surgery.distill.loop.trainer import run
    from trace_summary import summarize

    teacher, student, teacher_hf, _ = make_pair(point["pair"])
    record = {"bench": "tpu", "event": "trace", **point}
    with tempfile.TemporaryDirectory() as folder:
        try:
            run(teacher, student, batches(teacher_hf["vocab_size"], point["batch"], SEQ, 1),
                dataclasses.replace(point_config(point, 1)))  # compiled outside the trace
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            with jax.profiler.trace(folder, create_perfetto_trace=True, profiler_options=options):
                run(teacher, student, batches(teacher_hf["vocab_size"], point["batch"], SEQ, 2),
                    point_config(point, 3))
            found = glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
            kept = os.path.join(os.path.dirname(os.path.abspath(args.out)), "tpu_trace.json.gz")
            shutil.copyfile(found[0], kept)
            record.update(file=os.path.basename(kept), **summarize(kept, steps=3))
        except Exception as error:  # noqa: BLE001  (a diagnostic: the sweep's records stand without it)
            record["error"] = f"{type(error).__name__}: {error}"[:1500]
    common.emit(record, args.out)


if __name__ == "__main__":
    main()

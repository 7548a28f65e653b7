"""Rematerialisation of the student: step time on the CPU and compiled memory on a TPU slice, per remat setting.

    python bench/remat_layers.py cpu [--repeats 5]        a small teacher/student pair, the jitted grad step
    python bench/remat_layers.py tpu [--remat none,layers,full] [--chunk 2048]
                                                          the train step of a Gemma 7B teacher and a gemma-2b-shaped
                                                          student, 8 x 2048 tokens, compiled for a v5e-8 (fsdp=8)

`cpu`: each setting's loss-and-gradient function (`distill.loop.train_step.make_grad_fn`, forward KL + CE) jitted, then the
median wall time of `--repeats` calls (after one warm-up), and its compiled temporaries. Settings alternate within
each repeat (the machine is shared). `tpu`: `bench/tpu_compile.py`'s `distill_step_compile`, one compile per
setting (minutes each). One JSON line per measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpu_compile  # noqa: E402

SMALL = dict(model_type="gemma2", vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
             sliding_window=256, tie_word_embeddings=True)


def cpu(remats: list[str], repeats: int, batch: int = 4, seq: int = 512) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from nnx_surgery.distill.loop import train_step as step_lib
    from nnx_surgery.distill.loop.run_config import LossWeights, Stage
    from nnx_surgery.distill.loop.freeze import split_trainable
    from nnx_surgery.distill.losses.divergence import LogitLossSettings
    from nnx_surgery.surgery.modeling.model_config import ModelConfig
    from nnx_surgery.surgery.modeling.causal_lm import create_model

    teacher = create_model(ModelConfig.from_hf_dict(SMALL), seed=0)
    student = create_model(ModelConfig.from_hf_dict(dict(SMALL, num_hidden_layers=4)), seed=1)
    graph, trainable, rest = split_trainable(student, None, None)
    teacher_graph, teacher_state = nnx.split(teacher)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, SMALL["vocab_size"], (batch, seq)), jnp.int32)
    counts = step_lib.token_counts({"input_ids": ids[None]})
    hyper = step_lib.hyper_values(Stage(steps=1, weights=LossWeights(kl=1.0, ce=0.5)), 0, 0.0)
    args = ({"student": trainable, "proj": {}}, rest, teacher_state, {"input_ids": ids}, counts, hyper)
    runs, times = {}, {r: [] for r in remats}
    for remat in remats:
        settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True, ce=True, chunk=128, block=256),
                                         remat=None if remat == "none" else remat)
        compiled = jax.jit(step_lib.make_grad_fn(graph, teacher_graph, settings)).lower(*args).compile()
        runs[remat] = (compiled, compiled.memory_analysis().temp_size_in_bytes)
        jax.block_until_ready(compiled(*args))
    for _ in range(repeats):
        for remat in remats:
            start = time.perf_counter()
            jax.block_until_ready(runs[remat][0](*args))
            times[remat].append(time.perf_counter() - start)
    out = []
    for remat in remats:
        out.append({"bench": "remat_cpu", "remat": remat, "tokens": batch * seq, "layers": 4,
                    "median_s": statistics.median(times[remat]), "times_s": times[remat],
                    "temp_bytes": runs[remat][1]})
        print(json.dumps(out[-1]), flush=True)
    return out


def tpu(remats: list[str], chunk: int) -> list[dict]:
    mesh = tpu_compile.tpu_mesh("v5e:2x4")
    out = []
    for remat in remats:
        start = time.time()
        figures = tpu_compile.distill_step_compile(mesh, tpu_compile.GEMMA_7B, tpu_compile.GEMMA_2B, batch=8,
                                                   seq=2048, remat=None if remat == "none" else remat, chunk=chunk)
        figures.pop("compiled", None)
        out.append({"bench": "remat_tpu", "target": "v5e:2x4", "remat": remat, "chunk": chunk, **figures,
                    "compile_s": round(time.time() - start)})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("where", choices=("cpu", "tpu"))
    parser.add_argument("--remat", default="none,layers,layers_dots,full")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=2048, help="tpu: rows per chunk of the fused logit loss")
    args = parser.parse_args()
    remats = args.remat.split(",")
    results = cpu(remats, args.repeats) if args.where == "cpu" else tpu(remats, args.chunk)
    for r in results:
        time_s = f"{r['median_s']:.3f} s" if "median_s" in r else "-"
        temp = r.get("temp_bytes", r.get("temp"))
        print(f"{r['remat']:>12}  step {time_s:>9}  temporaries {tpu_compile.gib(temp)} GiB")


if __name__ == "__main__":
    main()

"""What does training from a teacher cache save per step (distill.loop.cache_replay)? Measured on a small Gemma 2
shaped teacher and a student with a third of its layers (CPU by default).

    python bench/teacher_cache_training.py --out bench/results/teacher-cache-training.jsonl

The teacher's cache is written once (`write_cache`, q8 and exact: its time is recorded), then the same student
trains `--steps` steps on the same rows four ways: online with the full distribution (forward KL), online with the
top k, from the exact cache and from the q8 cache (both top k). One record per way: the median `step_time_s` of
`distill.run`'s step records after the first (which compiles), and the loop's data fraction (reading and decoding
the cache is data time). The cache saves the teacher's forward and its (B, T, V) logits per step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import numpy as np
from flax import nnx

from nnx_surgery.distill import TokenBatches
from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, Stage
from nnx_surgery.distill.inputs.topk_cache import CacheSettings, write_cache
from nnx_surgery.distill.loop.trainer import run
from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.modeling.causal_lm import create_model


def _config(layers: int, vocab: int, width: int) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(
        model_type="gemma2", vocab_size=vocab, hidden_size=width, intermediate_size=4 * width,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=width // 4,
        query_pre_attn_scalar=width // 4, sliding_window=64, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0))


def _student(teacher, layers: int, args) -> nnx.Module:
    student = create_model(_config(layers, args.vocab, args.width), seed=1)
    source, target = nnx.to_pure_dict(nnx.state(teacher)), nnx.to_pure_dict(nnx.state(student))
    target["embed_tokens"], target["norm"] = source["embed_tokens"], source["norm"]
    state = nnx.state(student)
    nnx.replace_by_pure_dict(state, target)
    nnx.update(student, state)
    return student


def _data(args) -> TokenBatches:
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, args.vocab, size=int(n)) for n in rng.integers(20, 400, size=args.documents)]
    return TokenBatches.from_arrays(docs, eos_id=1, bos_id=2, seq_len=args.seq_len, batch_size=args.batch, seed=3)


def _timed_run(teacher, args, **changes) -> dict:
    config = DistillConfig(stages=(Stage(steps=args.steps, learning_rate=1e-3, weights=LossWeights.mixed(1.0)),),
                           batch_size=args.batch, seq_len=args.seq_len, progress=False, plots=False, **changes)
    result = run(teacher, _student(teacher if teacher is not None else args.teacher, args.student_layers, args),
                 _data(args), config)
    times = [record["step_time_s"] for record in result.history[1:]]
    return {"median_step_s": statistics.median(times), "min_step_s": min(times),
            "data_fraction": result.utilisation.get("data_fraction")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--teacher-layers", type=int, default=6)
    parser.add_argument("--student-layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--top-k", type=int, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()
    args.teacher = create_model(_config(args.teacher_layers, args.vocab, args.width), seed=0)
    shape = {k: getattr(args, k) for k in ("vocab", "width", "teacher_layers", "student_layers", "seq_len", "batch",
                                           "steps", "top_k")}
    rows = []
    with tempfile.TemporaryDirectory() as root:
        caches = {}
        for encoding in ("exact", "q8"):
            start = time.perf_counter()
            write_cache(args.teacher, _data(args), f"{root}/{encoding}", CacheSettings(top_k=args.top_k,
                        encoding=encoding), identity={"teacher": {"config_sha256": "bench"}})
            caches[encoding] = f"{root}/{encoding}"
            rows.append({"way": f"write cache ({encoding})", "seconds": time.perf_counter() - start, **shape})
        ways = (("online, full distribution", args.teacher, {}),
                ("online, top k", args.teacher, {"top_k": args.top_k}),
                ("cache, exact", None, {"teacher_cache": caches["exact"]}),
                ("cache, q8", None, {"teacher_cache": caches["q8"]}))
        for name, teacher, changes in ways:
            rows.append({"way": name, **_timed_run(teacher, args, **changes), **shape,
                         "device": jax.devices()[0].device_kind})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()

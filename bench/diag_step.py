"""Where the distillation step's memory goes: XLA's own accounting of the compiled step (no training).

    python bench/diag_step.py --scale 270m [--teacher-dtype bfloat16]

Builds the step exactly as `distill.run` does (`distill.loop.step_runner.StepRunner.enter_stage`) for a bench teacher/student
pair, compiles it for one batch and prints one JSON line with `compiled.memory_analysis()`: bytes of the
arguments (teacher, student parameters, Adam state, batch), outputs, aliased (donated) buffers and the temporaries
XLA allocates inside the step, plus the host RSS after loading. Peak step memory is about
arguments + temporaries + outputs - aliased.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", default="270m")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--teacher-dtype", default="float32")
    parser.add_argument("--chunk", type=int, default=None)
    parser.add_argument("--block", type=int, default=None, help="rows per teacher-logits / head-gradient block")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from nnx_surgery.distill.loop.run_config import DistillConfig, GuardConfig, LossWeights, OptimizerConfig, Stage
    from nnx_surgery.distill.interface import Correspondence
    from nnx_surgery.distill.mesh import put_batch
    from nnx_surgery.distill.loop.train_step import hyper_values
    from nnx_surgery.distill.loop.step_runner import StepRunner, logit_block, logit_chunk
    from students import ensure_pair
    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained

    teacher_dir, student_dir = ensure_pair(args.scale)
    teacher = load_pretrained(teacher_dir, dtype=args.teacher_dtype)
    student = load_pretrained(student_dir, dtype="float32")
    stage = Stage(steps=1, learning_rate=1e-4, min_lr_ratio=1.0, weights=LossWeights(kl=1.0))
    extra = {"logit_chunk": args.chunk} if args.chunk else {}
    extra.update({"logit_block": args.block} if args.block else {})
    config = DistillConfig(stages=(stage,), batch_size=args.batch, seq_len=args.seq,
                           optimizer=OptimizerConfig(weight_decay=1e-4, clip_norm=None, decay_matrices_only=False),
                           guard=GuardConfig(enabled=False), progress=False, plots=False, **extra)
    session = StepRunner(teacher, student, config, None, Correspondence(), {})
    session.enter_stage(0, carry=False)
    ids = np.random.default_rng(0).integers(0, teacher.config.vocab_size, (1, args.batch, args.seq)).astype(np.int32)
    batch = put_batch({"input_ids": ids}, None, leading=1)
    hyper = hyper_values(stage, 0, 1e-4)
    step = session._compiled[0]
    step = step[0] if isinstance(step, tuple) else step  # (train, eval) in older versions
    compiled = step.lower(session.params, session.opt, session.frozen, session.teacher_state, batch, hyper).compile()
    memory = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    record = {"bench": "diag_step", "scale": args.scale, "teacher_dtype": args.teacher_dtype,
              "logit_chunk": logit_chunk(config), "logit_block": logit_block(config),
              "rss_after_load_gib": common.current_rss_bytes() / common.GIB}
    for field in fields:
        value = getattr(memory, field, None)
        if value is not None:
            record[field.replace("_size_in_bytes", "_gib")] = value / common.GIB
    if all(k in record for k in ("argument_gib", "temp_gib", "output_gib", "alias_gib")):
        record["step_peak_estimate_gib"] = (record["argument_gib"] + record["temp_gib"] + record["output_gib"]
                                            - record["alias_gib"])
    print(json.dumps(common.round_floats(record, 3)))


if __name__ == "__main__":
    main()

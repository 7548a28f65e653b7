"""Where a distillation step's time goes: each part of the step jitted and timed on its own (used by gpu_bench.py).

    python bench/step_parts.py --teacher T --student S --batch 8 --seq 1024 --dtype bfloat16 --chunk 2048

Parts, each with its own counted FLOPs (bench/flops.py's rules) and achieved FLOP/s:

* teacher_forward  the teacher's trunk up to the final norm (no logits), bf16 weights;
* student_trunk    the student's trunk forward + backward (no logits) in the compute dtype from float32 master
                   weights, with a linear stand-in loss `sum(final_hidden * r)`;
* logit_loss       the fused chunked KL (teacher and student logits, loss, gradients for the student's hidden
                   states and head), given both models' final hidden states;
* adamw            one AdamW update of the student's float32 parameters;
* head_gradients   the fused loss's two head-gradient matmuls (dz @ head, dz^T @ hidden) for every chunk of a
                   step, on compute-dtype operands as the step makes them; `head_gradients_f32_operands` the same
                   on float32 operands, as the step made them before 2026-11-30 (the difference is that fix's
                   saving per step);
* matmul_peak      one (M x M) @ (M x M) product in the compute dtype (M = --matmul, 8192 on a GPU): the chip's
                   practical peak.

The parts add up to less than a full step (no fusion across them, no casts of the master weights inside the trunk
part's measurement start); the difference is reported by the caller against the measured full step.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from flops import _config, attention_flops_per_token, trunk_parameters  # noqa: E402


def measure(teacher_dir: str, student_dir: str, batch: int, seq: int, dtype: str, chunk: int,
            repeats: int = 5, matmul: int = 8192) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from nnx_surgery.distill.losses.logit_grad import head_gradient, hidden_gradient
    from nnx_surgery.distill.losses.divergence import LogitLossSettings, fused_logit_loss
    from nnx_surgery.distill.labels import labels_and_weights
    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained

    compute = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    teacher = load_pretrained(teacher_dir, dtype=dtype)
    student = load_pretrained(student_dir, dtype="float32")
    t_graph, t_state = nnx.split(teacher)
    s_graph, s_state = nnx.split(student)
    t_cfg, s_cfg = _config(teacher_dir), _config(student_dir)
    tokens = batch * seq
    ids = jnp.asarray(np.random.default_rng(0).integers(0, t_cfg["vocab_size"], (batch, seq)), jnp.int32)
    cast = lambda tree: jax.tree.map(lambda x: x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                     tree)
    results = {}

    @jax.jit
    def teacher_forward(state, ids):
        model = nnx.merge(t_graph, state)
        return model(ids, return_logits=False).final_hidden, model.head_matrix()

    seconds = common.median_seconds(teacher_forward, t_state, ids, repeats=repeats)
    results["teacher_forward"] = (seconds, tokens * (2 * trunk_parameters(t_cfg)
                                                     + attention_flops_per_token(t_cfg, seq)))
    t_hidden, t_head = teacher_forward(t_state, ids)

    def trunk_loss(params, ids, r):
        model = nnx.merge(s_graph, cast(params))
        return jnp.sum(model(ids, return_logits=False).final_hidden.astype(jnp.float32) * r)

    trunk = jax.jit(jax.value_and_grad(trunk_loss))
    r = jnp.ones((batch, seq, s_cfg["hidden_size"]), jnp.float32) / tokens
    seconds = common.median_seconds(trunk, s_state, ids, r, repeats=repeats)
    results["student_trunk"] = (seconds, tokens * (6 * trunk_parameters(s_cfg)
                                                   + 3 * attention_flops_per_token(s_cfg, seq)))

    s_model = nnx.merge(s_graph, s_state)
    s_hidden = jnp.asarray(np.random.default_rng(1).standard_normal((batch, seq, s_cfg["hidden_size"])), compute)
    s_head = s_model.head_matrix().astype(compute)
    labels, weights = labels_and_weights(ids, None, None)
    weights = weights / weights.sum()
    coeffs = {"temperature": 1.0, "kl": 1.0, "reverse_kl": 0.0, "jsd": 0.0, "ce": 0.0}
    spec = LogitLossSettings(kl=True, chunk=chunk, unit_temperature=True)

    def logit_objective(h_s, head_s):
        loss, _ = fused_logit_loss(h_s, head_s, t_hidden, t_head, labels, weights, coeffs,
                                   student_logits=s_model.logits_from_hidden,
                                   teacher_logits=teacher.logits_from_hidden, spec=spec)
        return loss

    logit = jax.jit(jax.value_and_grad(logit_objective, argnums=(0, 1)))
    seconds = common.median_seconds(logit, s_hidden, s_head, repeats=repeats)
    vocab = t_cfg["vocab_size"]
    results["logit_loss"] = (seconds, tokens * vocab * (2 * t_cfg["hidden_size"] + 6 * s_cfg["hidden_size"]))

    adamw = optax.adamw(1e-4, weight_decay=1e-4)
    params = jax.tree.map(lambda x: x + 0, s_state)
    opt = adamw.init(params)
    grads = jax.tree.map(lambda x: x * 1e-3, params)

    @jax.jit
    def update(params, opt, grads):
        updates, opt = adamw.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    results["adamw"] = (common.median_seconds(update, params, opt, grads, repeats=repeats), 0)

    # The fused loss's two head-gradient matmuls for one chunk, on compute-dtype operands (what the step does) and
    # on float32 operands (what it did before 2026-11-30: a float32 loss gradient meeting bf16 weights upcasts both)
    rows = min(chunk, tokens)
    dz = jnp.asarray(np.random.default_rng(3).standard_normal((rows, vocab)), jnp.float32) * 1e-3
    hidden_rows = s_hidden.reshape(tokens, -1)[:rows]

    def head_gradients(dz, hidden, head, operand):  # the step's own matmuls, on `operand`-dtype operands
        hidden, head = hidden.astype(operand), head.astype(operand)
        return hidden_gradient(dz, head), head_gradient(dz, hidden, None)

    grad_flops = 4 * rows * vocab * s_cfg["hidden_size"] * -(-tokens // rows)  # per step: every chunk
    for name, operand in (("head_gradients", compute), ("head_gradients_f32_operands", jnp.float32)):
        fn = jax.jit(functools.partial(head_gradients, operand=operand))
        seconds = common.median_seconds(fn, dz, hidden_rows, s_head, repeats=repeats) * -(-tokens // rows)
        results[name] = (seconds, grad_flops)

    a = jnp.asarray(np.random.default_rng(2).standard_normal((matmul, matmul)), compute)
    seconds = common.median_seconds(jax.jit(lambda a: a @ a), a, repeats=repeats)
    results["matmul_peak"] = (seconds, 2 * matmul ** 3)
    return {name: {"seconds": s, "tflop": f / 1e12, "tflop_per_s": f / s / 1e12 if f else None}
            for name, (s, f) in results.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--student", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--chunk", type=int, default=None,
                        help="logit rows per chunk (default: the package's, distill.loop.trainer.logit_chunk)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--matmul", type=int, default=8192, help="side of the square matmul of the peak part")
    args = parser.parse_args(argv)
    if args.chunk is None:
        from nnx_surgery.distill.loop.run_config import DistillConfig
        from nnx_surgery.distill.loop.step_runner import logit_chunk

        args.chunk = logit_chunk(DistillConfig())
    parts = measure(args.teacher, args.student, args.batch, args.seq, args.dtype, args.chunk, args.repeats,
                    args.matmul)
    print(json.dumps(common.round_floats({"bench": "step_parts", "batch": args.batch, "seq": args.seq,
                                         "dtype": args.dtype, "chunk": args.chunk,
                                         **{f"{k}_{m}": v for k, p in parts.items() for m, v in p.items()}}, 6)))


if __name__ == "__main__":
    main()

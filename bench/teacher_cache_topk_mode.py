"""Which top-k form should a cached teacher take (distill.losses.topk_teacher)? "renormalised" (the teacher's top k
renormalised, what the online top-k path does) or "residual" (the top k plus one bucket for the rest)?

    python bench/teacher_cache_topk_mode.py --out bench/results/teacher-cache-topk-mode.jsonl

On a tiny teacher (2 layers, a 4096-piece vocabulary, logits scaled until its distribution is about as peaked
as a trained LM's: the mean top-k mass is printed) and a student made from it with one layer dropped, over a few
batches of random tokens: the loss and the gradient with respect to the student's parameters of forward KL at
temperature 1, full vocabulary (the reference), and of each top-k form at k = 4, 16, 64, 256. Per (mode, k): the
loss's relative difference to the full KL, the cosine between the gradients and the gradient's relative L2 error.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_surgery.distill.losses.divergence import LogitLossSettings, reference_logit_loss
from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.modeling.causal_lm import create_model

VOCAB, LENGTH, BATCH = 4096, 64, 4


def _config(layers: int) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(
        model_type="gemma2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=32,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0))


def models(scale: float, sharpen: float):
    """The teacher's weights times `scale`, its final norm's gain times `sharpen` (its logits, before the
    soft-cap, that much larger: a peaked distribution); the student: its embedding, final norm and last layer."""
    teacher = create_model(_config(2), seed=0)
    nnx.update(teacher, jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, nnx.state(teacher, nnx.Param)))
    teacher.norm.scale[...] = (1.0 + teacher.norm.scale[...]) * sharpen - 1.0
    student = create_model(_config(1), seed=1)
    source, target = nnx.to_pure_dict(nnx.state(teacher)), nnx.to_pure_dict(nnx.state(student))
    target["embed_tokens"], target["norm"], target["layers"][0] = (source["embed_tokens"], source["norm"],
                                                                   source["layers"][1])
    state = nnx.state(student)
    nnx.replace_by_pure_dict(state, target)
    nnx.update(student, state)
    return teacher, student


def measure(teacher, student, ids, spec):
    t_logits = jax.lax.stop_gradient(teacher(ids).logits.astype(jnp.float32))
    labels = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)
    weights = jnp.ones(ids.shape, jnp.float32) / ids.size
    graph, params = nnx.split(student, nnx.Param)

    def loss(p):
        logits = nnx.merge(graph, p)(ids).logits.astype(jnp.float32)
        return reference_logit_loss(logits, t_logits, labels, weights, {"temperature": 1.0, "kl": 1.0, "ce": 0.0,
                                                                        "jsd": 0.0, "reverse_kl": 0.0}, spec)[0]

    value, grads = jax.value_and_grad(loss)(params)
    return float(value), jnp.concatenate([g.ravel() for g in jax.tree.leaves(grads)]), t_logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=6.0, help="teacher weight scale")
    parser.add_argument("--sharpen", type=float, default=8.0, help="teacher logit scale (peakedness)")
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    teacher, student = models(args.scale, args.sharpen)
    rng = np.random.default_rng(0)
    rows = []
    for batch in range(args.batches):
        ids = jnp.asarray(rng.integers(0, VOCAB, size=(BATCH, LENGTH)), jnp.int32)
        full, g_full, t_logits = measure(teacher, student, ids, LogitLossSettings(kl=True))
        p = jax.nn.softmax(t_logits, -1)
        for k in (4, 16, 64, 256):
            mass = float(jnp.mean(jnp.sum(jax.lax.top_k(p, k)[0], -1)))
            for mode in ("renormalised", "residual"):
                value, g, _ = measure(teacher, student, ids, LogitLossSettings(kl=True, top_k=k, top_k_mode=mode))
                cosine = float(jnp.dot(g, g_full) / (jnp.linalg.norm(g) * jnp.linalg.norm(g_full)))
                rows.append(dict(batch=batch, k=k, mode=mode, topk_mass=mass, full_kl=full,
                                 loss_rel_diff=abs(value - full) / full, grad_cosine=cosine,
                                 grad_rel_error=float(jnp.linalg.norm(g - g_full) / jnp.linalg.norm(g_full))))
    print("| k | top-k mass | mode | loss vs full KL | gradient cosine | gradient rel. error |\n"
          "|---|---|---|---|---|---|")
    for k in (4, 16, 64, 256):
        for mode in ("renormalised", "residual"):
            sel = [r for r in rows if r["k"] == k and r["mode"] == mode]
            med = {key: float(np.median([r[key] for r in sel])) for key in
                   ("topk_mass", "loss_rel_diff", "grad_cosine", "grad_rel_error")}
            print(f"| {k} | {med['topk_mass']:.3f} | {mode} | {med['loss_rel_diff']:.3f} | {med['grad_cosine']:.4f} "
                  f"| {med['grad_rel_error']:.3f} |")
    if args.out:
        with open(args.out, "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()

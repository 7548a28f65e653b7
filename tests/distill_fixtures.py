"""Tiny models and batches shared by the distillation tests: a 4-layer Gemma 2 teacher with confident random
weights, the depth-pruned student a surgery would make of it, batches sampled from the teacher, and the minimal
data interface."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_surgery.distill.loop.freeze import path_string
from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.modeling.causal_lm import create_model

VOCAB, LENGTH, BATCH = 96, 16, 4
FAST_COMPILE = {"xla_backend_optimization_level": 0}  # halves XLA:CPU compile time of these tiny programs
KEPT_LAYERS = (0, 3)


def tiny_config(layers: int) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(
        model_type="gemma2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, query_pre_attn_scalar=12, sliding_window=5,
        attn_logit_softcapping=20.0, final_logit_softcapping=15.0))


def tiny_teacher(seed: int = 0, dtype=jnp.float32):
    """Random weights scaled up so the teacher has confident, learnable next-token preferences."""
    teacher = create_model(tiny_config(4), seed=seed)
    state = nnx.state(teacher, nnx.Param)
    nnx.update(teacher, jax.tree.map(lambda x: x * 12.0 if x.ndim >= 2 else x, state))
    if dtype != jnp.float32:
        nnx.update(teacher, jax.tree.map(lambda x: x.astype(dtype), nnx.state(teacher)))
    return teacher


def student_from(teacher, kept=KEPT_LAYERS):
    """What a depth-pruning surgery produces: the kept teacher layers, embedding and final norm copied."""
    student = create_model(tiny_config(len(kept)), seed=99)
    source = nnx.to_pure_dict(nnx.state(teacher))
    target = nnx.to_pure_dict(nnx.state(student))
    target["embed_tokens"], target["norm"] = source["embed_tokens"], source["norm"]
    for j, i in enumerate(kept):
        target["layers"][j] = source["layers"][i]
    state = nnx.state(student)
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), target))
    nnx.update(student, state)
    return student


def teacher_samples(teacher, count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`count` batches of (BATCH, LENGTH) token sequences sampled from the teacher (temperature 1)."""
    graph, state = nnx.split(teacher)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def sample(state, key):
        model = nnx.merge(graph, state)
        key, first = jax.random.split(key)
        ids = jnp.zeros((count * BATCH, LENGTH), jnp.int32).at[:, 0].set(
            jax.random.randint(first, (count * BATCH,), 0, VOCAB))

        def body(t, carry):
            ids, key = carry
            key, sub = jax.random.split(key)
            logits = model(ids).logits[:, t - 1]
            return ids.at[:, t].set(jax.random.categorical(sub, logits).astype(jnp.int32)), key

        return jax.lax.fori_loop(1, LENGTH, body, (ids, key))[0]

    ids = np.asarray(sample(state, jax.random.key(seed)))
    return [{"input_ids": ids[i * BATCH:(i + 1) * BATCH]} for i in range(count)]


def params_numpy(model) -> dict[str, np.ndarray]:
    return {path_string(p): np.array(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


class ArrayBatches:
    """The minimal data interface: next_batch() plus a resumable position."""

    def __init__(self, batches):
        self.batches, self.position = batches, 0

    def next_batch(self):
        batch = self.batches[self.position % len(self.batches)]
        self.position += 1
        return batch

    def state(self):
        return {"position": self.position}

    def restore(self, state):
        self.position = state["position"]


def step_gradients(teacher, student, settings, ids):
    """One train step's loss, metrics and student gradients (no update) for (B, LENGTH) `ids` under
    `settings` (a `StepSettings`), at KL 1 and CE 0.5, temperature 2: (loss, {metric: float}, {path: array})."""
    import nnx_surgery.distill.loop.train_step as step_lib
    from nnx_surgery.distill.loop.freeze import split_trainable
    from nnx_surgery.distill.loop.run_config import LossWeights, Stage

    hyper = step_lib.hyper_values(Stage(steps=1, weights=LossWeights(kl=1.0, ce=0.5), temperature=2.0), 0, 0.0)
    rows = ids.shape[0]
    counts = {"tokens": jnp.float32(rows * (LENGTH - 1)), "positions": jnp.float32(rows * LENGTH)}
    graph, trainable, rest = split_trainable(student, None, None)
    teacher_graph, teacher_state = nnx.split(teacher)
    grad_fn = jax.jit(step_lib.make_grad_fn(graph, teacher_graph, settings), compiler_options=FAST_COMPILE)
    (loss, metrics), grads = grad_fn({"student": trainable, "proj": {}}, rest, teacher_state, {"input_ids": ids},
                                     counts, hyper)
    flat = {path_string(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads["student"])}
    return float(loss), {k: float(v) for k, v in metrics.items()}, flat

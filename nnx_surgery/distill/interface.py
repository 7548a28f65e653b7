"""What distillation needs from a model, and the teacher -> student correspondence, as plain data.

`distill` never imports a model class. A teacher or student is anything shaped like `DistillModel` (the NNX
`surgery.modeling.causal_lm.Gemma` is one): a callable NNX module returning an object with `final_hidden`, and on request the
captures the loss terms name (`LossTerm.captures`), e.g. `residual` (embeddings, then each layer's output) and
`attention_probs` (per layer, (B, N, T, S) probabilities), as attributes of that name.

The layer map says which teacher layer output a student layer output should imitate. A student made by the
surgery keeps teacher layers `kept_layers` in order, so student layer j is teacher layer `kept_layers[j]`; a width
pruned student keeps the teacher hidden channels `kept_hidden`. `correspondence_from_plan` reads both from any
object or dict that has them (duck typing: `surgery.plans.plan_record.Plan` or its JSON form).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp

from .labels import labels_and_weights


@runtime_checkable
class DistillModelOutput(Protocol):
    final_hidden: jax.Array  # (B, T, D), input of the LM head (after the final norm)
    residual: tuple[jax.Array, ...] | None  # L + 1 entries: embeddings, then each layer's output
    attention_probs: tuple[jax.Array, ...] | None  # per layer (B, N, T, S)


@runtime_checkable
class DistillModel(Protocol):
    """The only surface of a model that `distill` uses.

    `logits_from_hidden(hidden, head)` must return float32 logits (soft-cap applied) and must depend on trainable
    parameters only through `head` when `head` is given: the fused logit loss differentiates it with respect to
    `hidden` and `head` only.

    Optional, for meshes: `shardings(mesh) -> nnx.State`, the tree of `nnx.state(model)` with a `NamedSharding`
    for every array; `distill.mesh.shard_model` places the model with it. A model without it is replicated on
    every device of the mesh (`NamedSharding(mesh, PartitionSpec())`). `check_mesh_fits` reads each parameter's
    `mesh_axes` metadata (the mesh axis of each dimension; else `out_sharding`) to refuse a mesh axis that cannot
    split a dimension it shards.

    Optional, for the tied-embedding fold of the train step: `embed(ids)` and `config.tie_word_embeddings`;
    `config.scales_embeddings` (default True) says whether `embed` multiplies rows by sqrt(hidden_size).
    """

    def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 capture: Iterable[str] = (), return_logits: bool = True,
                 inputs_embeds: jax.Array | None = None) -> DistillModelOutput:
        """`positions` (B, T) int: RoPE positions (restarting at 0 in each packed document); `segment_ids`
        (B, T) int: which packed document a token belongs to (0: padding), attention stays inside a document;
        `inputs_embeds` (B, T, D): replaces the embedding lookup. `positions` and `segment_ids` are passed only
        when the batch has them, `inputs_embeds` only by the train step's tied-embedding fold. Optional:
        `remat` ("layers" or "layers_dots", `distill.loop.train_step.LAYER_REMAT`), each layer rematerialised in the backward
        pass; passed only to a student trained with that `DistillConfig.remat`."""
        ...

    def head_matrix(self) -> jax.Array: ...

    def logits_from_hidden(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array: ...


@runtime_checkable
class Sampler(Protocol):
    """How on-policy distillation (`DistillConfig.on_policy`, nnx_surgery/distill/loop/on_policy.py) gets the student's own samples:
    a callable passed as `distill.run(..., sampler=)`, so `distill` needs no generation code of its own (the
    surgery's is `surgery.make_sampler()`, over its jitted KV-cache prefill and decode loop).

    `model`: the student as it is at this step (a module sharing the training arrays; do not keep it).
    `prompt_ids`, `prompt_mask`: (B, P) int32, left padded (mask 0 on padding). `key`: a JAX PRNG key, the only
    source of randomness (the run derives it from its seed and step, so a resumed run samples the same).
    Returns host arrays `tokens` (B, max_new_tokens) int32, the new tokens of each row, and `valid`
    (B, max_new_tokens) bool, True for the tokens up to and including the one that stopped the row (an EOS),
    False after it. Shapes are the same at every step, so an implementation compiles once. It runs outside the
    differentiated step: the samples are data, no gradient flows through sampling."""

    def __call__(self, model: Any, prompt_ids: Any, prompt_mask: Any, *, max_new_tokens: int, temperature: float,
                 key: jax.Array) -> tuple[Any, Any]: ...


# Batch keys a forward takes, beyond input_ids; a batch of packed documents has positions and segment_ids.
FORWARD_KEYS = ("attention_mask", "positions", "segment_ids")


def kernel_inputs(model: Any, kernel: str) -> dict[str, Any]:
    """`{"attention_kernel": kernel}` for a model whose `__call__` takes it (the package's `CausalLM`), when the
    step asks for another kernel than XLA's; nothing otherwise (another model keeps its own attention)."""
    if kernel == "xla" or "attention_kernel" not in inspect.signature(type(model).__call__).parameters:
        return {}
    return {"attention_kernel": kernel}


def forward_inputs(model: Any, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `model(input_ids, ...)` that `batch` supplies (attention_mask, positions,
    segment_ids when present). A batch of packed documents given to a model whose `__call__` cannot take
    `positions`/`segment_ids` is an error: without them attention would cross document boundaries."""
    present = {key: batch[key] for key in FORWARD_KEYS if batch.get(key) is not None}
    wanted = set(present) - {"attention_mask"}
    if wanted:
        parameters = inspect.signature(type(model).__call__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        missing = sorted(k for k in wanted if k not in parameters and not takes_any)
        if missing:
            raise TypeError(f"the batch has {missing} (packed documents) but {type(model).__name__}.__call__ "
                            f"does not take them; give the model those keywords (see DistillModel in "
                            "nnx_surgery/distill/interface.py) or build the data with TokenBatches(return_segments=False).")
    return present


def next_token_targets(batch: Mapping[str, Any]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(labels, weights, real) of a (B, T) batch. `weights[b, t]` scores the prediction at t of token t + 1:
    0 in the last column, where `loss_mask` is 0, at padding (attention_mask 0 at t or t + 1) and, with
    `segment_ids`, where token t + 1 starts another document or is padding (segment 0), so a packed row scores
    each document exactly as it would be scored alone. `real` (float32) marks non-padding positions."""
    input_ids, attention_mask, segments = batch["input_ids"], batch.get("attention_mask"), batch.get("segment_ids")
    labels, weights = labels_and_weights(input_ids, batch.get("loss_mask"), attention_mask)
    real = (jnp.ones(input_ids.shape, jnp.float32) if attention_mask is None
            else attention_mask.astype(jnp.float32))
    if segments is not None:
        same_next = jnp.concatenate([segments[:, 1:] == segments[:, :-1],
                                     jnp.zeros_like(segments[:, :1], bool)], axis=1)
        inside = segments > 0
        weights = weights * (same_next & inside).astype(jnp.float32)
        real = real * inside.astype(jnp.float32)
    return labels, weights, real


def check_model(model: Any, role: str) -> None:
    """Fail early, naming what is missing, instead of deep inside a traced step."""
    missing = [name for name in ("head_matrix", "logits_from_hidden") if not callable(getattr(model, name, None))]
    if not callable(model):
        missing.insert(0, "__call__")
    if missing:
        raise TypeError(f"The {role} ({type(model).__name__}) lacks {missing}; distill needs the DistillModel "
                        "interface of nnx_surgery/distill/interface.py (the surgery's Gemma has it).")


@dataclasses.dataclass(frozen=True)
class Correspondence:
    """Teacher -> student mapping used by the feature and attention losses.

    `layer_map`: pairs (teacher_layer, student_layer) of layer outputs to match (0-based decoder layers).
    `kept_hidden`: teacher hidden channels the student kept, in student channel order, or None (same width).
    `head_map`: optional, per pair of `layer_map`, the teacher query heads kept by the student layer, in order.
    """

    layer_map: tuple[tuple[int, int], ...] = ()
    kept_hidden: tuple[int, ...] | None = None
    head_map: tuple[tuple[int, ...] | None, ...] | None = None

    def __post_init__(self):
        pairs = tuple((int(t), int(s)) for t, s in self.layer_map)
        object.__setattr__(self, "layer_map", pairs)
        if self.kept_hidden is not None:
            object.__setattr__(self, "kept_hidden", tuple(int(c) for c in self.kept_hidden))
        if self.head_map is not None:
            if len(self.head_map) != len(pairs):
                raise ValueError(f"head_map has {len(self.head_map)} entries but layer_map has {len(pairs)}; "
                                 "give one list of teacher heads (or None) per mapped layer pair.")
            object.__setattr__(self, "head_map", tuple(None if h is None else tuple(int(i) for i in h)
                                                       for h in self.head_map))

    def validate(self, teacher_layers: int, student_layers: int) -> None:
        for teacher_layer, student_layer in self.layer_map:
            if not 0 <= teacher_layer < teacher_layers or not 0 <= student_layer < student_layers:
                raise ValueError(f"layer_map pair ({teacher_layer}, {student_layer}) is out of range: the teacher "
                                 f"has {teacher_layers} layers and the student {student_layers}.")


def _field(plan: Any, name: str) -> Any:
    if isinstance(plan, dict):
        return plan.get(name)
    return getattr(plan, name, None)


def correspondence_from_plan(plan: Any, *, layer_map: Sequence[tuple[int, int]] | None = None) -> Correspondence:
    """Read `kept_layers` (teacher layer index of each student layer) and `kept_hidden` from a surgery plan.

    Optional `kept_heads` (per student layer, the teacher query heads kept, flat or grouped per student KV head
    as `surgery.plans.plan_record.Plan` stores them) becomes `head_map`. `layer_map`
    overrides the pairs (e.g. to match only a few layers) while `kept_hidden` still comes from the plan.
    """
    kept_layers = _field(plan, "kept_layers")
    if kept_layers is None and layer_map is None:
        raise ValueError("The plan has no 'kept_layers' (teacher layer of each student layer); pass layer_map= "
                         "explicitly, e.g. [(0, 0), (2, 1)].")
    pairs = tuple(layer_map) if layer_map is not None else tuple((int(t), s) for s, t in enumerate(kept_layers))
    kept_hidden = _field(plan, "kept_hidden")
    kept_heads = _field(plan, "kept_heads")
    head_map = None
    if kept_heads is not None and layer_map is None:
        head_map = tuple(_flat_heads(kept_heads[s]) for _, s in pairs)
    return Correspondence(layer_map=pairs, kept_hidden=None if kept_hidden is None else tuple(kept_hidden),
                          head_map=head_map)


def _flat_heads(heads: Any) -> tuple[int, ...] | None:
    """Teacher query heads of one student layer in student head order. A plan stores them per student KV head
    (`kept_heads[s][j]`); student query head n belongs to KV head n // groups, so the flat order is the order."""
    if heads is None:
        return None
    return tuple(int(h) for entry in heads for h in (entry if isinstance(entry, (list, tuple)) else [entry]))


__all__ = ["DistillModel", "DistillModelOutput", "Sampler",
           "FORWARD_KEYS", "forward_inputs", "kernel_inputs", "next_token_targets",
           "Correspondence", "correspondence_from_plan", "check_model"]

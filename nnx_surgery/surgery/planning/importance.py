"""Importance scores: what `plan_student` ranks when it decides what a student keeps.

Activation-based (Minitron, arXiv 2407.14679): run the teacher on calibration sequences with `capture=` inside one
jitted function that reduces every intermediate to per-axis sums right away, so memory stays at one forward pass.
Each sequence gives a per-channel mean over its positions; sequences are combined with an L2 norm (Minitron's
"batch = L2, seq = mean"):

    MLP neuron f of layer l     |gelu(gate) * up|          (input of down_proj)
    query head n of layer l     ||attention output of n||  (before o_proj, over head_dim)
    hidden channel d            |input_layernorm output| summed over layers, plus the final norm's output
    block influence of layer l  1 - cos(residual_in, residual_out), mean over tokens (ShortGPT / Minitron BI)
    layer-removal loss of l     calibration LM loss with layer l skipped, minus the full model's loss

It also measures, for every RMSNorm, the share of its input's energy carried by each channel: when hidden channels
are removed, a norm averages over fewer of them, and these shares give the factor that restores its output scale.

Magnitude (data-free): weight norms read one tensor at a time through the same `read` used by the surgery, so it
works from a checkpoint on disk without ever holding the teacher.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..storage.hf_checkpoint import gathered
from ..modeling.model_config import ModelConfig
from ..modeling.causal_lm import CausalLM
from nnx_surgery.surgery.families.schema import bound_tensors, hf_shape_of, norm_tensors
from nnx_surgery.surgery.storage.tensor_readers import Reader

CAPTURE = ("residual", "mid_residual", "attention_outputs", "mlp_outputs", "head_outputs", "mlp_activations",
           "normed_inputs")


@dataclasses.dataclass
class ActivationStats:
    """Calibration statistics of a teacher, summed over all sequences (numpy, float64)."""

    mlp: np.ndarray  # (L, F) L2 over sequences of mean |activation|
    heads: np.ndarray  # (L, N)
    hidden: np.ndarray  # (D,)
    block_influence: np.ndarray  # (L,) mean 1 - cos over tokens
    norm_energy: dict  # norm name -> (L, D) mean energy share per channel; "final" -> (D,)
    sequences: int
    tokens: int


def calibration_batches(calibration, batch_size: int = 8, num_samples: int | None = None,
                        seed: int = 0) -> list[np.ndarray]:
    """Token ids as a list of (B, T) int32 batches. `calibration` is an (N, T) array or an iterable of (B, T)
    arrays of equal length; with `num_samples` < N, a seeded random subset of the sequences is used."""
    if isinstance(calibration, np.ndarray) or hasattr(calibration, "__array__"):
        sequences = np.asarray(calibration)
    else:
        parts = [np.asarray(b) for b in calibration]
        if not parts:
            raise ValueError("calibration is empty; pass token ids of shape (num_sequences, length).")
        if len({p.shape[-1] for p in parts}) != 1:
            raise ValueError("calibration batches have different lengths; pad or cut them to one length.")
        sequences = np.concatenate([p.reshape(-1, p.shape[-1]) for p in parts])
    if sequences.ndim == 1:
        sequences = sequences[None]
    if sequences.ndim != 2 or sequences.shape[0] == 0 or sequences.shape[1] < 2:
        raise ValueError(f"calibration token ids must have shape (num_sequences, length >= 2); got "
                         f"{sequences.shape}.")
    if not np.issubdtype(sequences.dtype, np.integer):
        raise ValueError(f"calibration must hold integer token ids; got dtype {sequences.dtype}.")
    if num_samples is not None and num_samples < len(sequences):
        order = np.random.default_rng(seed).permutation(len(sequences))[:num_samples]
        sequences = sequences[np.sort(order)]
    sequences = sequences.astype(np.int32)
    return [sequences[i:i + batch_size] for i in range(0, len(sequences), batch_size)]


def check_calibration_ids(batches: list[np.ndarray], config: ModelConfig) -> None:
    top = max(int(b.max()) for b in batches)
    low = min(int(b.min()) for b in batches)
    if low < 0 or top >= config.vocab_size:
        raise ValueError(f"calibration token ids span [{low}, {top}], outside the teacher's vocabulary "
                         f"[0, {config.vocab_size}); tokenise with the teacher's tokenizer.")


# ------------------------------------------------------------------------------------------------ activations
@nnx.jit
def _batch_stats(model: CausalLM, ids: jax.Array) -> dict:
    out = model(ids, capture=CAPTURE, return_logits=False)
    residual = _captured(out.residual, "residual")
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731

    def seq_mean_sq(x):  # (B, T, ...) -> sum over sequences of (mean over positions)^2
        return jnp.sum(jnp.mean(x, axis=1) ** 2, axis=0)

    def energy_share(x):  # (B, T, D) -> sum over tokens of x_d^2 / sum_d x^2
        x2 = f32(x) ** 2
        return jnp.sum(x2 / (jnp.sum(x2, axis=-1, keepdims=True) + 1e-30), axis=(0, 1))

    stats: dict[str, jax.Array | dict[str, jax.Array]] = {
        "mlp": jnp.stack([seq_mean_sq(jnp.abs(f32(a))) for a in _captured(out.mlp_activations, "mlp_activations")]),
        "heads": jnp.stack([seq_mean_sq(jnp.linalg.norm(f32(h), axis=-1))
                            for h in _captured(out.head_outputs, "head_outputs")]),
        "hidden": jnp.stack([seq_mean_sq(jnp.abs(f32(x))) for x in _captured(out.normed_inputs, "normed_inputs")]
                            + [seq_mean_sq(jnp.abs(f32(out.final_hidden)))])}
    influence = []
    for i in range(len(model.layers)):
        before, after = f32(residual[i]), f32(residual[i + 1])
        cos = jnp.sum(before * after, -1) / (jnp.linalg.norm(before, axis=-1) * jnp.linalg.norm(after, axis=-1)
                                             + 1e-30)
        influence.append(jnp.sum(1.0 - cos))
    # every norm's input is a captured stream the schema names (`Tensor.reads`)
    streams = {"residual": residual[:-1], "mid_residual": _captured(out.mid_residual, "mid_residual"),
               "attention_outputs": _captured(out.attention_outputs, "attention_outputs"),
               "mlp_outputs": _captured(out.mlp_outputs, "mlp_outputs")}
    energy = {t.at(0).module: jnp.stack([energy_share(x) for x in streams[t.reads]])
              for t in norm_tensors(model.config)}
    stats["block_influence"] = jnp.stack(influence)
    energy["final"] = energy_share(residual[-1])
    stats["energy"] = energy
    return stats


def _captured(values: tuple[jax.Array, ...] | None, name: str) -> tuple[jax.Array, ...]:
    """A stream the forward was asked to capture (CAPTURE)."""
    if values is None:
        raise ValueError(f"the teacher's forward captured no {name}; CAPTURE must name it.")
    return values


def activation_stats(teacher: CausalLM, batches: list[np.ndarray]) -> ActivationStats:
    """Forward passes over the calibration batches, reduced on device, summed on the host in float64."""
    check_calibration_ids(batches, teacher.config)
    total = None
    for ids in batches:
        # gathered: on a multi-host mesh the statistics may be sharded over processes
        stats = jax.tree.map(lambda x: np.asarray(gathered(x), dtype=np.float64),
                             _batch_stats(teacher, jnp.asarray(ids)))
        total = stats if total is None else jax.tree.map(np.add, total, stats)
    sequences = sum(len(b) for b in batches)
    tokens = sum(b.size for b in batches)
    energy = {name: value / tokens for name, value in total["energy"].items()}
    return ActivationStats(mlp=np.sqrt(total["mlp"]), heads=np.sqrt(total["heads"]),
                           hidden=np.sqrt(total["hidden"]).sum(axis=0),
                           block_influence=total["block_influence"] / tokens, norm_energy=energy,
                           sequences=sequences, tokens=tokens)


# ------------------------------------------------------------------------------------------------ depth by loss
@nnx.jit
def _skip_loss(model: CausalLM, ids: jax.Array, skip: jax.Array) -> jax.Array:
    """Summed next-token cross-entropy with layer `skip` replaced by the identity (-1: the full model)."""
    logits = model(ids, skip_layers=jnp.arange(len(model.layers)) == skip).logits[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


def layer_removal_loss(teacher: CausalLM, batches: list[np.ndarray]) -> tuple[float, np.ndarray]:
    """(mean calibration LM loss of the teacher, (L,) increase of that loss when each layer is removed)."""
    check_calibration_ids(batches, teacher.config)
    num_layers = teacher.config.num_hidden_layers
    sums = np.zeros(num_layers + 1)
    for batch in batches:
        ids = jnp.asarray(batch)
        for skip in range(-1, num_layers):
            sums[skip + 1] += float(_skip_loss(teacher, ids, jnp.asarray(skip, jnp.int32)))
    count = sum(b.shape[0] * (b.shape[1] - 1) for b in batches)
    losses = sums / count
    return float(losses[0]), losses[1:] - losses[0]


# ------------------------------------------------------------------------------------------------ magnitude
def magnitude_scores(config: ModelConfig, read: Reader, chunk_bytes: int = 16 << 20) -> dict[str, np.ndarray]:
    """Data-free scores from weight norms, one tensor (or row block) at a time, for any family: every matrix of
    the schema contributes along its named axes.

    MLP neuron: sqrt of the product of its row/column squared norms in every matrix with an `mlp` axis (gate row,
    up row, down column); query head: the same over `heads` (q rows, o columns); hidden channel: its share of
    squared norm in every matrix that reads or writes the residual stream (`embed`), summed (each tensor counts
    equally, whatever its scale). LM heads are left out: the embedding already speaks for the vocabulary side."""
    num_layers, h = config.num_hidden_layers, config.head_dim
    mlp = np.ones((num_layers, config.intermediate_size))
    heads = np.ones((num_layers, config.num_attention_heads))
    hidden = np.zeros(config.hidden_size)
    for tensor in bound_tensors(config):
        decl = tensor.decl
        if len(decl.groups) != 2 or decl.role == "head":
            continue  # norms, biases and the untied head
        nrows, ncols = hf_shape_of(config, tensor)
        for group, sq in zip(decl.groups, _sq_norms(read, tensor.hf_name, nrows, ncols, chunk_bytes)):
            if group == ("embed",):
                hidden += sq / max(sq.sum(), 1e-30)
            elif group == ("mlp",):
                mlp[tensor.layer] *= sq
            elif group[0] == "heads":
                heads[tensor.layer] *= sq.reshape(-1, h).sum(1)
    return {"mlp": np.sqrt(mlp), "heads": np.sqrt(heads), "hidden": hidden}


def _sq_norms(read: Reader, name: str, nrows: int, ncols: int, chunk_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Squared L2 norms of every row and every column of a 2-D teacher tensor, read in row blocks."""
    rows_sq, cols_sq = np.zeros(nrows), np.zeros(ncols)
    step = max(1, chunk_bytes // (4 * ncols))
    for start in range(0, nrows, step):
        index = np.arange(start, min(nrows, start + step))
        block = read(name, index if len(index) < nrows else None, None).astype(np.float32) ** 2
        rows_sq[start:start + len(index)] = block.sum(axis=1)
        cols_sq += block.sum(axis=0)
    return rows_sq, cols_sq


# ------------------------------------------------------------------------------------------------ the registry
@dataclasses.dataclass
class ScoreInputs:
    """What a score may read: the teacher's config, a Reader over its tensors, the model (None when planning
    from disk) and calibration batches (None without calibration). `stats` runs the calibration forward passes
    once, however many scores use them."""

    config: ModelConfig
    read: Reader
    model: CausalLM | None = None
    batches: list[np.ndarray] | None = None
    _stats: ActivationStats | None = None

    @property
    def stats(self) -> ActivationStats:
        if self._stats is None:
            self._stats = activation_stats(*self.calibration())
        return self._stats

    def calibration(self) -> tuple[CausalLM, list[np.ndarray]]:
        """(the teacher model, the calibration batches), which scores that need calibration read."""
        if self.model is None or self.batches is None:
            raise ValueError("this score runs the teacher on calibration batches: give ScoreInputs a model and "
                             "batches.")
        return self.model, self.batches


@dataclasses.dataclass(frozen=True)
class Score:
    """An importance score the planner can use by name.

    `kind` "width": `compute` returns {"mlp": (L, F), "heads": (L, N), "hidden": (D,)} (higher = keep). `kind`
    "depth": it returns per-layer arrays (and scalars) to record in the plan, `ranks_by` naming the (L,) entry whose
    highest values are kept. `needs_calibration`: it reads `inputs.stats` / `inputs.batches`."""

    name: str
    kind: str
    compute: Callable[[ScoreInputs], dict[str, Any]]
    needs_calibration: bool
    ranks_by: str = ""


SCORES: dict[str, Score] = {}


def register_score(score: Score) -> Score:
    if score.kind not in ("width", "depth") or (score.kind == "depth" and not score.ranks_by):
        raise ValueError(f"score {score.name!r}: kind must be 'width' or 'depth' (a depth score names ranks_by).")
    SCORES[score.name] = score
    return score


def _activation_widths(inputs: ScoreInputs) -> dict[str, np.ndarray]:
    stats = inputs.stats
    return {"mlp": stats.mlp, "heads": stats.heads, "hidden": stats.hidden}


def _layer_removal(inputs: ScoreInputs) -> dict[str, Any]:
    base, increase = layer_removal_loss(*inputs.calibration())
    return {"base_loss": base, "loss_increase": increase}


register_score(Score("activation", "width", _activation_widths, needs_calibration=True))
register_score(Score("magnitude", "width", lambda inputs: magnitude_scores(inputs.config, inputs.read),
                     needs_calibration=False))
register_score(Score("block_influence", "depth", lambda inputs: {"block_influence": inputs.stats.block_influence},
                     needs_calibration=True, ranks_by="block_influence"))
register_score(Score("loss", "depth", _layer_removal, needs_calibration=True, ranks_by="loss_increase"))


__all__ = ["ActivationStats", "calibration_batches", "activation_stats", "layer_removal_loss",
           "magnitude_scores", "Score", "ScoreInputs", "SCORES", "register_score"]

"""`refit_mlp`: after a cut, each narrowed MLP's down projection refitted by least squares to the teacher's MLP.

A cut MLP keeps some of the teacher's neurons and drops the rest; the kept neurons' slice of `down_proj` was fitted
together with the dropped ones, so alone it misses their contribution. Given the student's own activations `H`
(tokens x kept neurons) on calibration rows, the refit solves

    W = argmin ||H W - Y||^2 + ridge * mean(diag(H^T H)) * ||W||^2

where `Y` is what the teacher's whole MLP (same layer, every neuron, the student's residual channels) writes for the
same input. Layers are refitted in order and each sees the student's inputs after the layers before it were
refitted, so a layer also corrects what the earlier cuts changed upstream. Only `down_proj` changes: gate and up
keep the teacher's rows, so `H` is exactly the kept columns of the teacher MLP's activations on that input, and the
layer's error can be written from two accumulated products (`H^T H`, `H^T Y`) and `||Y||^2`.

Cost: two passes of each student layer over the rows, plus the teacher MLP's gate/up/down at full width, one
layer at a time; the teacher's other weights are never run. The rows are in the student's tokens (a trimmed
vocabulary's student reads its own). Layers whose MLP keeps every neuron are left as they are (their slice is
already the exact solution)."""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..modeling.model_config import ConfigError
from nnx_surgery.surgery.plans.plan_record import Plan
from ..storage.hf_checkpoint import gathered

HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class LayerRefit:
    """One student layer: its teacher layer, neurons kept, and the relative error ||H W - Y||^2 / ||Y||^2 on the
    calibration rows with the sliced weights (`before`) and the refitted ones (`after`)."""

    layer: int
    teacher_layer: int
    kept: int
    before: float
    after: float


@dataclasses.dataclass(frozen=True)
class RefitReport:
    rows: int
    tokens: int
    ridge: float
    layers: tuple[LayerRefit, ...]
    seconds: float

    def to_dict(self) -> dict:
        return {"rows": self.rows, "tokens": self.tokens, "ridge": self.ridge, "seconds": round(self.seconds, 1),
                "layers": [dataclasses.asdict(layer) for layer in self.layers]}

    def summary(self) -> str:
        if not self.layers:
            return "MLP refit: no layer's MLP was narrowed, nothing refitted"
        before = np.mean([layer.before for layer in self.layers])
        after = np.mean([layer.after for layer in self.layers])
        return (f"MLP refit: {len(self.layers)} narrowed MLPs' down projections fitted to the teacher's on "
                f"{self.tokens:,} tokens ({self.rows} rows) in {self.seconds:.0f} s; relative error of their "
                f"output {before:.3f} -> {after:.3f} (mean over layers)")


def refit_mlp(student, source, plan: Plan, rows, *, ridge: float = 1e-2, batch_size: int = 8,
              log=None) -> RefitReport:
    """Refit, in place, the down projection of every MLP of `student` that `plan` narrowed, against `source` (the
    model the plan cut `student` from: its config is the plan's teacher config). `rows` (N, T) are token ids in
    the student's vocabulary. `ridge` is relative to the mean of H^T H's diagonal. `log`: a callable given one
    line per layer. Returns what each layer's error was before and after."""
    _check(student, source, plan, rows, ridge, batch_size)
    started = time.perf_counter()
    rows = np.asarray(rows, dtype=np.int32)
    narrowed = [s for s, kept in enumerate(plan.kept_mlp) if len(kept) < source.config.intermediate_size]
    last = narrowed[-1] if narrowed else -1  # no pass at all when nothing was narrowed, none past the last narrowed
    inputs = [_layer_inputs(student, jnp.asarray(rows[i:i + batch_size]))
              for i in range(0, len(rows), batch_size)] if narrowed else []
    hidden = np.asarray(plan.kept_hidden)
    done = []
    for s, layer in enumerate(student.layers[:last + 1]):
        if s in narrowed:
            teacher_mlp = source.layers[plan.kept_layers[s]].mlp
            full = (teacher_mlp.gate_proj.weight[...][:, hidden], teacher_mlp.up_proj.weight[...][:, hidden],
                    teacher_mlp.down_proj.weight[...][hidden, :])
            done.append(_refit_layer(s, plan.kept_layers[s], layer, full, inputs, ridge))
            if log is not None:
                log(f"[refit] layer {s}: {len(plan.kept_mlp[s])} of {len(full[2][0])} neurons, relative error "
                    f"{done[-1].before:.4f} -> {done[-1].after:.4f}")
        if s < last:
            inputs = [(_layer_output(layer, x, positions, mask[layer.attention_type]), positions, mask)
                      for x, positions, mask in inputs]
    return RefitReport(rows=len(rows), tokens=int(rows.size), ridge=ridge, layers=tuple(done),
                       seconds=time.perf_counter() - started)


def _check(student, source, plan: Plan, rows, ridge: float, batch_size: int) -> None:
    if student.config != plan.student:
        raise ConfigError("refit_mlp: the student's config is not the plan's student config; pass the student "
                          "apply_plan made from this plan.")
    if source.config != plan.teacher_config:
        raise ConfigError("refit_mlp: `source` must be the model the plan was made on (its config differs from "
                          "the plan's teacher config).")
    shape = np.shape(rows)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"refit_mlp: rows must be a non-empty (N, T) array of token ids, got shape {shape}.")
    if np.min(rows) < 0 or np.max(rows) >= student.config.vocab_size:
        raise ValueError(f"refit_mlp: rows hold ids outside the student's vocabulary [0, "
                         f"{student.config.vocab_size}); give rows in the student's own tokens.")
    if not ridge > 0 or batch_size < 1:
        raise ValueError(f"refit_mlp: ridge must be > 0 (got {ridge}) and batch_size >= 1 (got {batch_size}).")


def _refit_layer(index: int, teacher_layer: int, layer, full, inputs, ridge: float) -> LayerRefit:
    """Accumulate H^T H, H^T Y and ||Y||^2 over the batches (float64 on the host), solve, set down_proj."""
    gram = cross = None
    target = 0.0
    for x, positions, mask in inputs:
        # gathered: on a multi-host mesh the products may be sharded over processes (as importance.py's)
        products = _layer_products(layer, x, positions, mask[layer.attention_type], *full)
        g, c, t = (np.asarray(gathered(value), np.float64) for value in products)
        gram, cross = g + (0 if gram is None else gram), c + (0 if cross is None else cross)
        target += float(t)
    if gram is None or cross is None:
        raise ValueError("refit_mlp: no calibration batches to fit the layer on.")
    down = layer.mlp.down_proj.weight
    sliced = np.asarray(gathered(down[...]), np.float64).T  # (kept, D)
    damped = gram.copy()  # the ridge on the diagonal in place: no identity matrix (2 GiB at a 2B's 16,384 neurons)
    damped[np.diag_indices_from(damped)] += ridge * max(float(np.mean(np.diag(gram))), np.finfo(np.float64).tiny)
    fitted = np.linalg.solve(damped, cross)
    down.set_value(jax.device_put(jnp.asarray(fitted.T, down[...].dtype), down[...].sharding))

    def error(w):
        return float((np.sum(w * (gram @ w)) - 2 * np.sum(w * cross) + target) / max(target, 1e-30))
    return LayerRefit(layer=index, teacher_layer=teacher_layer, kept=len(gram), before=error(sliced),
                      after=error(fitted))


@nnx.jit
def _layer_inputs(model, ids):
    return model.layer_inputs(ids)


@nnx.jit
def _layer_output(layer, x, positions, mask):
    return layer(x, positions, mask, None)


@nnx.jit
def _layer_products(layer, x, positions, mask, gate, up, down) -> tuple[jax.Array, jax.Array, jax.Array]:
    """H^T H and H^T Y of one batch (float32, full-precision products), and ||Y||^2: H the student layer's MLP
    activations, Y the teacher MLP's output for the same MLP input."""
    captured: dict = {"mlp_inputs": [], "mlp_activations": []}
    layer(x, positions, mask, captured)
    f32 = jnp.float32
    mlp_in = captured["mlp_inputs"][0].astype(f32)
    gates = jnp.einsum("btd,fd->btf", mlp_in, gate.astype(f32), precision=HIGHEST)
    ups = jnp.einsum("btd,fd->btf", mlp_in, up.astype(f32), precision=HIGHEST)
    act = jax.nn.silu(gates) if layer.mlp.silu else jax.nn.gelu(gates, approximate=True)
    y = jnp.einsum("btf,df->btd", act * ups, down.astype(f32), precision=HIGHEST).reshape(-1, down.shape[0])
    h = captured["mlp_activations"][0].astype(f32).reshape(y.shape[0], -1)
    return (jnp.matmul(h.T, h, precision=HIGHEST), jnp.matmul(h.T, y, precision=HIGHEST),
            jnp.sum(jnp.square(y)))

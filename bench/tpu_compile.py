"""Compiling for a TPU slice without one: libtpu's compiler on an abstract topology, and the memory figures of
what it compiles (used by remat_layers.py and fused_loss_memory.py).

libtpu lives in a side folder (`.venv/libtpu`, not importable, so ordinary runs never try to start a TPU);
`tpu_mesh` points `TPU_LIBRARY_PATH` at it and builds a mesh over `get_topology_desc(topology)`'s devices. An
argument given as a `jax.ShapeDtypeStruct` with a `NamedSharding` on that mesh makes `jax.jit(...).lower(...)
.compile()` run the TPU compiler; nothing is allocated. A program over the chip's memory is refused with
RESOURCE_EXHAUSTED: `compile_memory` then reads the figures from the message instead.

`distill_step_compile` lowers the package's train step (`distill.loop.train_step.build_train_step`) for an abstract teacher
and student as `distill.loop.step_runner.StepRunner` assembles its arguments: float32 master weights and Adam moments
sharded like the parameters, a bf16 teacher, one micro-batch split over the data axis.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBTPU = os.path.join(ROOT, ".venv", "libtpu", "libtpu", "libtpu.so")
GIB = 2**30
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

GEMMA_7B = dict(model_type="gemma", vocab_size=256000, hidden_size=3072, intermediate_size=24576,
                num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16, head_dim=256,
                tie_word_embeddings=True)
GEMMA_2B = dict(GEMMA_7B, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18, num_attention_heads=8,
                num_key_value_heads=1)


def tpu_mesh(topology: str = "v5e:2x4", axis: str = "fsdp"):
    """A one-axis mesh over the devices of an abstract TPU topology (e.g. "v5e:2x4", "v5p:2x2x1")."""
    os.environ["TPU_LIBRARY_PATH"] = LIBTPU
    import jax
    import numpy as np
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    return jax.sharding.Mesh(np.array(devices), (axis,), axis_types=(jax.sharding.AxisType.Auto,))


def _bytes(text: str) -> int:
    number, unit = re.fullmatch(r"([\d.]+)([KMGT]?)", text).groups()
    return int(float(number) * _UNITS.get(unit, 1))


def compile_memory(lower: Callable[[], Any]) -> dict[str, Any]:
    """Per-device bytes of `lower().compile()`: arguments, temporaries, outputs, aliased, and XLA's peak
    (arguments + temporaries + outputs - aliased). Over the chip's memory: `fits` False and the figures XLA's
    RESOURCE_EXHAUSTED message gives: the temporaries it needed and the chip's capacity)."""
    lowered = lower()
    try:
        compiled = lowered.compile()
    except Exception as error:  # noqa: BLE001 - only the compiler's out-of-memory refusal is read
        text = str(error)
        if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
            raise
        found = re.search(r"HLO temporaries \(([\d.]+[KMGT]?)\) exceeds available HBM \(([\d.]+[KMGT]?)\)", text)
        return {"fits": False, "temp": _bytes(found.group(1)) if found else None,
                "capacity": _bytes(found.group(2)) if found else None, "message": " ".join(text.split())[:400]}
    memory = compiled.memory_analysis()
    figures = {"fits": True, "argument": memory.argument_size_in_bytes, "temp": memory.temp_size_in_bytes,
               "output": memory.output_size_in_bytes, "alias": memory.alias_size_in_bytes}
    figures["peak"] = figures["argument"] + figures["temp"] + figures["output"] - figures["alias"]
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    figures["flops"] = float((cost or {}).get("flops", 0.0))
    figures["compiled"] = compiled
    return figures


def distill_step_compile(mesh, teacher: dict, student: dict, *, batch: int, seq: int, remat: str | None,
                         chunk: int, block: int | None = None, compute_dtype: str = "bfloat16") -> dict[str, Any]:
    """`compile_memory` of the train step (forward KL, one micro-batch of `batch` x `seq` tokens) for abstract
    models of HF configs `teacher` (bf16) and `student` (float32 masters) on `mesh`."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from nnx_surgery.distill.loop import train_step as step_lib
    from nnx_surgery.distill.loop.run_config import LossWeights, Stage
    from nnx_surgery.distill.loop.freeze import split_trainable
    from nnx_surgery.distill.losses.divergence import LogitLossSettings
    from nnx_surgery.distill.mesh import batch_spec
    from nnx_surgery.surgery.modeling.model_config import ModelConfig
    from nnx_surgery.surgery.modeling.causal_lm import abstract_model

    replicated = NamedSharding(mesh, PartitionSpec())
    graph, trainable, frozen = split_trainable(
        abstract_model(ModelConfig.from_hf_dict(student), dtype=jnp.float32, mesh=mesh), None, None)
    teacher_graph, teacher_state = nnx.split(
        abstract_model(ModelConfig.from_hf_dict(teacher), dtype=jnp.bfloat16, mesh=mesh))
    params = {"student": trainable, "proj": {}}
    opt = optax.ScaleByAdamState(count=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), mu=params,
                                 nu=params)
    ids = jax.ShapeDtypeStruct((1, batch, seq), jnp.int32,
                               sharding=NamedSharding(mesh, batch_spec(mesh, batch, leading=1)))
    stage = Stage(steps=1, weights=LossWeights(kl=1.0))
    hyper = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=replicated)
             for k, v in step_lib.hyper_values(stage, 0, 0.0).items()}
    settings = step_lib.StepSettings(logit=LogitLossSettings(kl=True, chunk=chunk, block=block),
                                     compute_dtype=jnp.dtype(compute_dtype), remat=remat)
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    out = (shardings(params), shardings(opt), replicated)
    train_step = step_lib.build_train_step(graph, teacher_graph, settings, step_lib.AdamSettings(), out)
    with jax.set_mesh(mesh):
        return compile_memory(lambda: train_step.lower(params, opt, frozen, teacher_state, {"input_ids": ids},
                                                       hyper))


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


if __name__ == "__main__":  # a smoke check: python bench/tpu_compile.py [topology]
    mesh = tpu_mesh(sys.argv[1] if len(sys.argv) > 1 else "v5e:2x4")
    print(mesh)

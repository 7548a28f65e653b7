"""`apply_plan`: a new NNX student initialised from slices of an in-memory teacher (which is left untouched).

Kept slices are gathered on the teacher's devices (`surgery.pruning.tensor_readers.MemoryReader`), brought to the host, finished
by the recipes of `surgery.pruning.tensor_slices` (the same numpy float32 arithmetic `prune_checkpoint` uses) and placed with
the sharding the student's parameters get on the teacher's mesh.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..storage.hf_checkpoint import read_nnx_block, save_pretrained
from ..modeling.model_config import ConfigError, ModelConfig
from ..modeling.causal_lm import CausalLM, abstract_model, parameter_sharding
from nnx_surgery.surgery.plans.plan_record import Plan, PlanError
from nnx_surgery.surgery.storage.tensor_readers import MemoryReader
from nnx_surgery.surgery.plans.plan_report import student_files
from .tensor_slices import build_tensor, recipes
from nnx_surgery.surgery.pruning.tokenizer_files import student_tokenizer

HOST_CHUNK_BYTES = 256 << 20  # float32 rows worked on at once (bounds host memory beside the output tensor)


def teacher_mesh(model: CausalLM):
    """The mesh the model's parameters are sharded over, or None when they are not NamedSharding-placed."""
    for _, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        sharding = getattr(variable[...], "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return None


def apply_plan(teacher: CausalLM, plan: Plan, *, mesh=None, check_weights: bool = True) -> CausalLM:
    """The student `plan` describes, as a new NNX model in the teacher's dtype, sharded like the teacher.

    `mesh` defaults to the teacher's own (read from its parameters' NamedSharding). The teacher must have the
    plan's config and, with `check_weights`, the weights fingerprinted in the plan (PlanError otherwise); pass
    `check_weights=False` to apply a plan to another model of the same shape on purpose (e.g. the undistilled
    version of the model it was made for)."""
    read = MemoryReader(teacher)
    plan.check_teacher(teacher.config, read=read if check_weights else None)
    plan.validate()
    mesh = mesh if mesh is not None else teacher_mesh(teacher)
    dtype = teacher.dtype
    student = abstract_model(plan.student, dtype=dtype, mesh=mesh)
    graphdef, state = nnx.split(student)
    variables = dict(nnx.to_flat_state(state))
    for recipe in recipes(plan):
        variable = variables[recipe.path]
        hf_array = build_tensor(recipe, read, dtype, HOST_CHUNK_BYTES)
        value = read_nnx_block(hf_array, recipe.layout, tuple(variable.shape), ())
        variable.set_value(jax.device_put(np.ascontiguousarray(value), parameter_sharding(variable, mesh)))
    return nnx.merge(graphdef, state)


def save_student(student: CausalLM, plan: Plan, out_dir: str | os.PathLike, *, source: str | None = None,
                 dtype=None, max_shard_size: int | str = "5GB", report: bool = True,
                 extra_files: Mapping[str, object] | None = None, overwrite: bool = False) -> str:
    """`save_pretrained` with the plan (and its report) written next to the weights. `source` defaults to the
    plan's teacher source (for tokenizer files) when that is a local folder holding that teacher (its config
    equals the plan's: a plan's paths are not trusted otherwise). `extra_files` and `overwrite` as in
    save_pretrained. A plan with `kept_vocab` gets the teacher's tokenizer trimmed to those pieces
    (`surgery.storage.tokenizer_files`) instead of a copy."""
    if source is None:
        source = _plan_teacher_folder(plan)
    source, tokenizer_files = student_tokenizer(plan, source)
    return save_pretrained(student, out_dir, source=source, dtype=dtype, max_shard_size=max_shard_size,
                           extra_files={**student_files(plan, report), **tokenizer_files, **(extra_files or {})},
                           overwrite=overwrite)


def _plan_teacher_folder(plan: Plan) -> str | None:
    folder = plan.teacher.get("source")
    if not isinstance(folder, str) or not os.path.isfile(os.path.join(folder, "config.json")):
        return None
    try:
        plan.check_teacher(ModelConfig.from_file(folder))
    except (ConfigError, PlanError):
        return None
    return folder


def logit_distance(teacher: CausalLM, student: CausalLM, batches) -> dict[str, float]:
    """Mean KL(teacher || student) per token and mean squared logit difference on `batches` of token ids."""
    kl_sum = mse_sum = 0.0
    count = 0
    for ids in batches:
        ids = jnp.asarray(ids)
        kl, mse = _distance(teacher, student, ids)
        kl_sum, mse_sum, count = kl_sum + float(kl), mse_sum + float(mse), count + ids.size
    return {"kl": kl_sum / count, "logit_mse": mse_sum / count}


@nnx.jit
def _distance(teacher: CausalLM, student: CausalLM, ids):
    t = teacher(ids).logits
    s = student(ids).logits
    assert t is not None and s is not None  # a forward returns logits unless asked not to
    t_logp, s_logp = jax.nn.log_softmax(t, -1), jax.nn.log_softmax(s, -1)
    kl = jnp.sum(jnp.exp(t_logp) * (t_logp - s_logp))
    return kl, jnp.sum(jnp.mean((t - s) ** 2, axis=-1))


def compensation_effect(teacher: CausalLM, plan: Plan, batches) -> dict[str, dict[str, float]]:
    """How far the student starts from the teacher with the plan's compensation and without it. A plan that trims
    the vocabulary is measured keeping every piece: the compensation does not depend on it, and the calibration
    ids are the teacher's, some of them pieces the student does not have."""
    plan = _whole_vocabulary(plan)
    with_comp = logit_distance(teacher, apply_plan(teacher, plan), batches)
    without = logit_distance(teacher, apply_plan(teacher, plan.without_compensation()), batches)
    return {"compensated": with_comp, "plain": without}


def _whole_vocabulary(plan: Plan) -> Plan:
    """`plan` keeping the teacher's whole vocabulary (its config's special ids and size) instead of kept_vocab."""
    if plan.kept_vocab is None:
        return plan
    teacher = plan.teacher_config
    special = {key: value for key, value in teacher.raw.items() if key.endswith("_token_id")}
    return dataclasses.replace(plan, kept_vocab=None, student_config={**plan.student_config, **special,
                                                                      "vocab_size": teacher.vocab_size})

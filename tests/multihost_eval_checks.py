"""The evaluation half of a multi-host test process (tests/multihost_worker.py calls `evaluate` after its
distillation, when its ARGS ask for it; the checks are in tests/distill/test_multihost.py).

Each process holds its own rows of the held-out batches (TokenBatches with process_index / process_count). It
scores test_suite's tiny teacher and student with `evaluation.evaluate_suite` on one global mesh, `heldout_loss` /
`agreement_and_kl` on a mesh whose devices interleave the processes (every batch row on another process than its
owner's) and on models left on each process's own device (no mesh), and cuts a student from disk with
`prune_checkpoint`. The suite writes into `suite{process}/` under `out` (only process 0 may), the student into
`pruned/` (process 0 writes it). Imported only after the process has started JAX's multi-controller runtime."""
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from nnx_surgery import surgery
import nnx_surgery.surgery.pruning.on_disk  # noqa: F401
from nnx_surgery.distill.inputs.batches import TokenBatches
from nnx_surgery.distill.distributed import to_host
from nnx_surgery.evaluation.perplexity import agreement_and_kl, batch_arrays, heldout_loss, model_mesh
from nnx_surgery.distill.mesh import make_mesh, shard_model
from nnx_surgery.evaluation.suite_scoring import evaluate_suite
from nnx_surgery.distill.inputs.byte_tokenizer import save_byte_tokenizer
from nnx_surgery.surgery.storage.hf_checkpoint import save_pretrained
from nnx_surgery.surgery.planning.student_planner import plan_student
from nnx_surgery.surgery.plans.student_spec import StudentSpec
from suite_fixtures import DOCUMENTS, SETTINGS, surgery_greedy, tiny_gemma

GLOBAL_BATCH = 8


def interleaved_mesh() -> Mesh:
    """fsdp over every device, alternating processes: batch row i lives on process i % 2, not on its owner."""
    devices = sorted(jax.devices(), key=lambda d: d.id)
    half = len(devices) // 2
    order = [d for pair in zip(devices[:half], devices[half:]) for d in pair]
    return Mesh(np.array(order), ("fsdp",), axis_types=(AxisType.Auto,))


def layouts(teacher_seed_models, batches) -> dict:
    """heldout_loss and agreement_and_kl of the student against the teacher, placed in two more ways."""
    out = {}
    for name, mesh in (("interleaved", interleaved_mesh()), ("unplaced", None)):
        teacher, student = (nnx.clone(m) for m in teacher_seed_models)
        if mesh is not None:
            shard_model(teacher, mesh), shard_model(student, mesh)
        assert (model_mesh(student) is None) == (mesh is None)
        out[name] = {"loss": heldout_loss(student, batches)["loss"],
                     **agreement_and_kl(student, teacher, batches, vocab_chunk=96)}
    return out


def pruned_from_disk(teacher, out: str) -> dict:
    """prune_checkpoint on every process into one shared folder: process 0 writes, everyone returns after."""
    source = save_pretrained(teacher, os.path.join(out, "teacher"), overwrite=True)
    writes = []
    real = surgery.pruning.on_disk.write_hf_folder

    def counting(*args, **kwargs):
        writes.append(args[0])
        return real(*args, **kwargs)

    surgery.pruning.on_disk.write_hf_folder = counting
    plan = plan_student(source, StudentSpec(2, 32, 32, 2, 1), width="magnitude", depth="uniform")
    folder = surgery.pruning.on_disk.prune_checkpoint(source, plan, os.path.join(out, "pruned"), overwrite=True)
    complete = sorted(os.listdir(folder))  # right after the return: process 0's folder is whole for everyone
    return {"pruned_writes": len(writes), "pruned_files": complete}


def evaluate(out: str, mesh_text: str) -> dict:
    """This process's part of the multi-host evaluation, into `out`; returns what the test compares."""
    os.makedirs(out, exist_ok=True)
    index, count = jax.process_index(), jax.process_count()
    tokenizer = save_byte_tokenizer(os.path.join(out, f"tokenizer{index}"))
    data = TokenBatches.from_records(DOCUMENTS * 2, tokenizer, seq_len=48, batch_size=GLOBAL_BATCH,
                                     eval_documents=4, eval_batch_size=GLOBAL_BATCH, seed=3, process_index=index,
                                     process_count=count)
    batches = data.eval_batches()
    models = tiny_gemma(3, seed=0), tiny_gemma(2, seed=1)
    result = {"local_rows": int(len(batches[0]["input_ids"])), "batches": len(batches)}
    result["layouts"] = layouts(models, batches)
    mesh = make_mesh(mesh_text)
    teacher, student = (shard_model(nnx.clone(m), mesh) for m in models)
    result["sharded_over_processes"] = not student.embed_tokens.get_value().is_fully_addressable
    result["global_ids"] = to_host(batch_arrays(batches[0], mesh)["input_ids"]).tolist()  # the whole global batch
    result["suite"] = evaluate_suite({"teacher": teacher, "student": student}, batches, data.eval_texts(),
                                     tokenizer=tokenizer, generate=surgery_greedy, settings=SETTINGS,
                                     out_path=os.path.join(out, f"suite{index}", "suite.md"))
    result.update(pruned_from_disk(teacher, out))
    return result

"""One process of the multi-host tests (tests/distill/test_multihost.py), run as `python tests/multihost_worker.py ARGS`
(ARGS: JSON). A tiny distillation (test_distill_train's teacher and depth-pruned student) over one global mesh:
with `num_processes` > 1 it starts JAX's multi-controller runtime (distill.initialize_distributed), and each
process feeds its rows of every global batch (TokenBatches with process_index / process_count). It writes
`result{process}.json` (losses, evaluations, events) and the final student as an HF folder (`save_pretrained`:
gathered tensor by tensor, written by process 0); with `suite` in ARGS it then runs the multi-host evaluation
(tests/multihost_eval_checks.py) under `evaluation/`, its results under "evaluation"."""
import json
import os
import signal
import sys
import time

ARGS = json.loads(sys.argv[1])
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", ARGS["devices"])
TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]

from nnx_surgery.distill.distributed import (DistributedSettings, failure_note, initialize_distributed, local_rows,  # noqa: E402
                                 to_host)

SETTINGS = DistributedSettings(coordinator=ARGS.get("coordinator"), num_processes=ARGS.get("num_processes"),
                               process_id=ARGS.get("process_id"), heartbeat_timeout_s=ARGS.get("heartbeat_timeout_s", 100))
if initialize_distributed(SETTINGS):  # before anything touches devices
    print(failure_note(SETTINGS), file=sys.stderr, flush=True)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_surgery.distill.loop.checkpointing import from_snapshot, host_snapshot  # noqa: E402
from nnx_surgery.distill.inputs.batches import TokenBatches, load_tokenizer, tokenize_records  # noqa: E402
from nnx_surgery.distill.inputs.host_shards import tokenize_shared  # noqa: E402
from nnx_surgery.distill.inputs.byte_tokenizer import save_byte_tokenizer  # noqa: E402
from nnx_surgery.distill.loop.run_config import (CheckpointConfig, DistillConfig, GuardConfig, LossWeights, Stage)  # noqa: E402
from nnx_surgery.distill.loop.trainer import run  # noqa: E402
from nnx_surgery.distill.mesh import MeshError, make_mesh, put_batch  # noqa: E402
from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained, save_pretrained  # noqa: E402
from distill_fixtures import FAST_COMPILE, KEPT_LAYERS, student_from, teacher_samples, tiny_teacher  # noqa: E402

GLOBAL_BATCH = 8


class Batches(TokenBatches):
    """The real data pipeline: every process walks the same global row order and keeps its share of each
    batch's rows; a checkpoint's data position is the same on every process. Optionally SIGKILLs this process."""

    def next_batch(self):
        self.taken = getattr(self, "taken", 0) + 1
        if self.taken == ARGS.get("kill_at_batch") and jax.process_index() == ARGS.get("kill_process"):
            with open(os.path.join(ARGS["out"], "killed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)  # dies while the other process runs the step's collectives
        return super().next_batch()

    def eval_batches(self):
        return super().eval_batches() if ARGS.get("evaluate", True) else []


def shared_tokenisation() -> dict:
    """Each process tokenises every other text (its share) and all end up with every text's tokens."""
    texts = [f"document {i}: " + "abc " * (i % 7) for i in range(11)]
    tokenizer = load_tokenizer(save_byte_tokenizer(os.path.join(ARGS["out"], f"tokenizer{jax.process_index()}")))
    seen = []

    def counting(records, tok):
        seen.extend(records)
        return tokenize_records(records, tok)

    shared = tokenize_shared(texts, tokenizer, counting, jax.process_count())
    whole = tokenize_records(texts, tokenizer)
    return {"tokenised_here": len(seen), "shared_equal": len(shared) == len(whole) and all(
        np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(shared, whole))}


def main():
    os.makedirs(ARGS["out"], exist_ok=True)
    documents = np.concatenate([b["input_ids"] for b in teacher_samples(tiny_teacher(), 10, seed=3)])
    data = Batches.from_arrays(list(documents), eos_id=1, seq_len=16, batch_size=GLOBAL_BATCH, seed=0,
                               eval_documents=6, process_index=jax.process_index(),
                               process_count=jax.process_count())
    checkpoint = CheckpointConfig(ARGS["checkpoint"], every=1, keep=4) if ARGS.get("checkpoint") else \
        CheckpointConfig()
    weights = LossWeights(kl=1.0, ce=0.3, attention=0.2, feature=0.1)
    config = DistillConfig(
        stages=(Stage(steps=ARGS.get("steps", 3), learning_rate=1e-2, weights=weights, temperature=(2.0, 1.0)),),
        plan={"kept_layers": list(KEPT_LAYERS)}, progress=False, logit_chunk=32, feature_projection=True,
        compiler_options=FAST_COMPILE, mesh=ARGS["mesh"], seq_len=16, batch_size=GLOBAL_BATCH, eval_every=2, eval_batches=1,
        checkpoint=checkpoint, guard=GuardConfig(enabled=ARGS.get("guard", True)), run_dir=ARGS.get("run_dir"))
    teacher, student = tiny_teacher(), student_from(tiny_teacher(seed=ARGS.get("student_seed", 0)))
    result = run(teacher, student, data, config)
    out = {"losses": [r["loss"] for r in result.full_history], "steps": result.steps,
           "evals": [r["student_ce"] for r in result.full_evals], "events": [e["event"] for e in result.events],
           "process": jax.process_index(), "process_count": jax.process_count(), "devices": jax.device_count()}
    state = nnx.state(student)  # the in-memory rollback copy of the sharded state round-trips exactly
    back = from_snapshot(host_snapshot(state))
    out["snapshot_equal"] = all(getattr(b, "sharding", a.sharding) == a.sharding and
                                bool(np.array_equal(to_host(a), to_host(b)))
                                for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)))
    out["sharded_over_processes"] = not student.embed_tokens.get_value().is_fully_addressable
    mine = data.next_batch()["input_ids"]  # a global batch's rows read back where they were put
    put = put_batch({"input_ids": mine[None]}, make_mesh(ARGS["mesh"]), leading=1)
    out["local_rows_equal"] = bool(np.array_equal(local_rows(put["input_ids"], axis=1)[0], mine))
    try:  # a mesh without a data axis would replicate each process's different rows as if they were everyone's
        put_batch({"input_ids": mine[None]}, make_mesh("tp=8"), leading=1)
        out["rows_without_data_axis"] = "accepted"
    except MeshError as error:
        out["rows_without_data_axis"] = str(error)
    out["data_state"] = result.data_state
    out.update(shared_tokenisation())
    folder = save_pretrained(student, os.path.join(ARGS["out"], "student"), overwrite=True)
    # every process reads only the blocks its own devices hold, onto the global mesh
    loaded = load_pretrained(folder, dtype="float32", mesh=make_mesh(ARGS["mesh"]))
    want, got = nnx.state(student, nnx.Param), nnx.state(loaded, nnx.Param)
    out["reload_equal"] = all(a.sharding == b.sharding and bool(np.array_equal(to_host(a), to_host(b)))
                              for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)))
    if ARGS.get("suite"):  # the multi-host evaluation on this runtime too (tests/multihost_eval_checks.py)
        from multihost_eval_checks import evaluate
        out["evaluation"] = evaluate(os.path.join(ARGS["out"], "evaluation"), ARGS["mesh"])
    with open(os.path.join(ARGS["out"], f"result{jax.process_index()}.json"), "w") as f:
        json.dump(out, f)


main()

"""Interrupting a distillation run: real signals sent to a subprocess running a tiny two-stage `distill.run`.

* SIGINT: the step in flight finishes, is checkpointed, and the run raises RunInterrupted naming the saved step
  and how to resume; the same call resumes it and ends with the parameters and losses of an uninterrupted run.
* A second SIGINT while that checkpoint is being written (just before orbax commits it) stops the run at once:
  the unfinished write is never resumed from; the next run removes it and continues from the last complete one.
* SIGKILL in the middle of a checkpoint write: the same.
* A complete checkpoint damaged afterwards is reported and skipped for the one before.

This file is also the child script: `python tests/distill/loop/test_interrupt.py MODE CHECKPOINT_DIR OUT`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from recipe_env import compile_cache_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STEPS = (4, 4)  # two stages: the second freezes the embedding, so a resume may land on either side of the switch
SIGNAL_AT_BATCH = 5  # the parent signals when the child has taken this batch (the prefetch during step 5)
UNFINISHED = ".orbax-checkpoint-tmp"


# ---------------------------------------------------------------------------------------------- the child
def _stop_requested() -> bool:
    """Whether the run's SIGINT handler (distill.interruption.StopSignals) has noted a signal."""
    return getattr(getattr(signal.getsignal(signal.SIGINT), "__self__", None), "received", None) is not None


class Batches:
    """Random token batches with a resumable position; announces each batch it hands out. With `wait_at`, it
    holds that batch until the run has noted the parent's signal, so the signal always lands during one step."""

    def __init__(self, wait_at: int | None):
        rng = np.random.default_rng(7)
        self.ids = rng.integers(0, 64, (16, 2, 16)).astype(np.int32)
        self.position, self.wait_at = 0, wait_at

    def next_batch(self):
        batch = {"input_ids": self.ids[self.position % len(self.ids)]}
        self.position += 1
        print(f"BATCH {self.position}", flush=True)
        if self.position == self.wait_at:
            deadline = time.time() + 60
            while not _stop_requested() and time.time() < deadline:
                time.sleep(0.01)
        return batch

    def eval_batches(self):
        return [{"input_ids": ids} for ids in self.ids[-2:]]

    def state(self):
        return {"position": self.position}

    def restore(self, state):
        self.position = state["position"]


def _kill_at(step: int, where: str) -> None:
    """SIGKILL this process while orbax writes checkpoint `step`: in the middle (its JSON item) or at its commit."""
    from orbax.checkpoint._src.handlers import json_checkpoint_handler
    from orbax.checkpoint._src.path import atomicity

    def is_target(path) -> bool:
        return f"{os.sep}{step}{UNFINISHED}" in str(path)

    if where == "mid-write":
        original = json_checkpoint_handler.JsonCheckpointHandler._save_fn

        async def save_fn(self, x, directory):
            if is_target(directory):
                os.kill(os.getpid(), signal.SIGKILL)
            return await original(self, x, directory)

        json_checkpoint_handler.JsonCheckpointHandler._save_fn = save_fn
    else:
        commit = atomicity.on_commit_callback

        def on_commit(tmpdir, *args, **kwargs):
            if is_target(tmpdir.get()):
                os.kill(os.getpid(), signal.SIGKILL)
            return commit(tmpdir, *args, **kwargs)

        atomicity.on_commit_callback = on_commit


def _second_sigint_before_commit() -> None:
    """Once the run has noted a SIGINT, send another just before orbax commits the checkpoint it then writes."""
    from orbax.checkpoint._src.path import atomicity

    commit = atomicity.on_commit_callback

    def on_commit(tmpdir, *args, **kwargs):
        if _stop_requested():
            os.kill(os.getpid(), signal.SIGINT)
        return commit(tmpdir, *args, **kwargs)

    atomicity.on_commit_callback = on_commit


def child(mode: str, checkpoint_dir: str, out: str) -> None:

    from nnx_surgery.distill.loop.run_config import CheckpointConfig, DistillConfig, LossWeights, Stage
    from nnx_surgery.distill.loop.freeze import path_string
    from nnx_surgery.distill.loop.trainer import RunInterrupted, run
    from flax import nnx
    from nnx_surgery.surgery.modeling.model_config import ModelConfig
    from nnx_surgery.surgery.modeling.causal_lm import create_model

    def config(layers):
        return ModelConfig.from_hf_dict(dict(model_type="gemma", vocab_size=64, hidden_size=16,
                                             intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                             num_key_value_heads=1, head_dim=8))

    teacher, student = create_model(config(3), seed=0), create_model(config(2), seed=1)
    if mode.startswith("kill-"):
        _kill_at(4, mode[len("kill-"):])
    if mode == "double":
        _second_sigint_before_commit()
    stages = (Stage(steps=STEPS[0], learning_rate=1e-2, weights=LossWeights.mixed(0.7)),
              Stage(steps=STEPS[1], learning_rate=5e-3, frozen=["embed_tokens"], weights=LossWeights(kl=1.0)))
    settings = DistillConfig(stages=stages, batch_size=2, seq_len=16, progress=False, logit_chunk=32,
                             checkpoint=CheckpointConfig(checkpoint_dir, every=2), plots=False, eval_every=2,
                             compiler_options={"xla_backend_optimization_level": 0})
    data = Batches(SIGNAL_AT_BATCH if mode in ("sigint", "double") else None)
    try:
        result = run(teacher, student, data, settings)
    except RunInterrupted as stop:
        print(json.dumps({"checkpoint_step": stop.checkpoint_step, "step": stop.step, "message": str(stop)}))
        sys.exit(130)
    params = {path_string(p): np.asarray(v.get_value(), np.float32)
              for p, v in nnx.to_flat_state(nnx.state(student, nnx.Param))}
    np.savez(out, **params)
    with open(out + ".json", "w") as handle:
        json.dump({"losses": [r["loss"] for r in result.full_history],
                   "steps": [r["step"] for r in result.full_history],
                   "evals": [(r["step"], r["loss"]) for r in result.full_evals],
                   "events": [e["event"] for e in result.events]}, handle)


# ---------------------------------------------------------------------------------------------- the tests
def child_env(compile_cache) -> dict[str, str]:
    """CPU, and a persistent compilation cache shared by the children (a resumed run compiles what the first run
    compiled: loading it instead saves most of a tiny child's time, with the same executables)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), **compile_cache_env(compile_cache)}


COMPILE_CACHE: list[str] = []  # set by the module fixture


pytestmark = pytest.mark.usefixtures("default_signal_handlers")  # tests/conftest.py: children see no ignored signal


def _start(mode: str, checkpoint_dir, out) -> subprocess.Popen:
    env = child_env(COMPILE_CACHE[0])
    return subprocess.Popen([sys.executable, "-u", __file__, mode, str(checkpoint_dir), str(out)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, signal_at: int | None = None) -> tuple[int, list[str], str]:
    """Read the child's output; send SIGINT when it announces batch `signal_at`."""
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if signal_at is not None and line.strip() == f"BATCH {signal_at}":
            proc.send_signal(signal.SIGINT)
    stderr = proc.stderr.read()
    return proc.wait(timeout=300), lines, stderr


def _run(mode: str, checkpoint_dir, out, signal_at: int | None = None) -> tuple[int, list[str], str]:
    return _finish(_start(mode, checkpoint_dir, out), signal_at)


def _load(out) -> tuple[dict[str, np.ndarray], dict]:
    with np.load(str(out) + ".npz") as arrays:
        params = dict(arrays)
    with open(str(out) + ".npz.json") as handle:
        return params, json.load(handle)


def _steps_on_disk(folder) -> tuple[list[int], list[str]]:
    names = os.listdir(folder)
    return sorted(int(n) for n in names if n.isdigit()), sorted(n for n in names if UNFINISHED in n)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run, uninterrupted."""
    base = tmp_path_factory.mktemp("interrupt")
    COMPILE_CACHE[:] = [str(base / "compile-cache")]
    code, lines, stderr = _run("plain", base / "ckpt", base / "ref.npz")
    assert code == 0, stderr[-3000:]
    return (*_load(base / "ref"), base / "ckpt")


def _assert_same_as_reference(reference, out) -> dict:
    want, want_log = reference[:2]
    got, got_log = _load(out)
    assert set(got) == set(want)
    differing = [k for k in want if not np.array_equal(want[k], got[k])]
    assert not differing, f"parameters differ from the uninterrupted run's: {differing[:5]}"
    assert got_log["steps"] == list(range(1, sum(STEPS) + 1))  # the whole history, across the resume
    assert got_log["losses"] == want_log["losses"]
    assert got_log["evals"] == want_log["evals"] and [s for s, _ in want_log["evals"]] == [0, 2, 4, 6, 8]
    return got_log


def test_stop_signals_note_the_first_signal_raise_on_the_second_and_restore_the_handlers():
    from nnx_surgery.distill.interruption import StopSignals

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGTERM"  # noted, nothing raised: the loop acts at its next step boundary
        with pytest.raises(KeyboardInterrupt, match="SIGINT again"):
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals():  # a signal the process ignores (nohup, a background job) stays ignored
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, ignored)


def test_sigint_checkpoints_the_step_says_how_to_resume_and_resumes_exactly(reference, tmp_path):
    code, lines, stderr = _run("sigint", tmp_path / "ckpt", tmp_path / "out.npz", signal_at=SIGNAL_AT_BATCH)
    assert code == 130, stderr[-3000:]
    report = json.loads(lines[-1])
    # batch 5 is taken (prefetched) while step 4 runs: that step finishes and is saved
    assert report["step"] == report["checkpoint_step"] == SIGNAL_AT_BATCH - 1
    message = report["message"]
    assert message.startswith("SIGINT: saved step 4 of 8;") and "--resume" in message
    assert str(tmp_path / "ckpt") in message and "continue from step 4" in message
    assert "finishing the current step" in stderr
    assert _steps_on_disk(tmp_path / "ckpt") == ([2, 4], [])

    code, _, stderr = _run("plain", tmp_path / "ckpt", tmp_path / "out.npz")
    assert code == 0, stderr[-3000:]
    log = _assert_same_as_reference(reference, tmp_path / "out")
    assert log["events"][0] == "resume"


def test_second_sigint_during_the_save_keeps_the_last_complete_checkpoint(reference, tmp_path):
    code, lines, stderr = _run("double", tmp_path / "ckpt", tmp_path / "out.npz", signal_at=SIGNAL_AT_BATCH)
    assert code == 130, stderr[-3000:]
    report = json.loads(lines[-1])
    # Step 4 is a regular checkpoint step: the signal arrives before its save, so the regular save is the one
    # the second SIGINT cuts; the run then names step 2, the last complete checkpoint.
    assert report["step"] == 4 and report["checkpoint_step"] == 2, report
    assert report["message"].startswith("SIGINT again: stopped at once after step 4 of 8, before its checkpoint")
    assert "continue from step 2" in report["message"]
    complete, unfinished = _steps_on_disk(tmp_path / "ckpt")
    assert complete == [0, 2] and len(unfinished) == 1 and unfinished[0].startswith("4.")

    code, _, stderr = _run("plain", tmp_path / "ckpt", tmp_path / "out.npz")
    assert code == 0, stderr[-3000:]
    log = _assert_same_as_reference(reference, tmp_path / "out")
    assert log["events"][:2] == ["cleanup", "resume"]
    assert _steps_on_disk(tmp_path / "ckpt")[1] == []  # the unfinished write was removed


def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous_one(reference, tmp_path):
    """(The second-SIGINT test above covers a write cut just before its commit.)"""
    code, _, stderr = _run("kill-mid-write", tmp_path / "ckpt", tmp_path / "out.npz")
    assert code == -signal.SIGKILL, stderr[-3000:]
    complete, unfinished = _steps_on_disk(tmp_path / "ckpt")
    assert complete == [0, 2] and len(unfinished) == 1 and unfinished[0].startswith("4."), (complete, unfinished)

    code, _, stderr = _run("plain", tmp_path / "ckpt", tmp_path / "out.npz")
    assert code == 0, stderr[-3000:]
    _assert_same_as_reference(reference, tmp_path / "out")
    assert _steps_on_disk(tmp_path / "ckpt") == ([6, 8], [])


def test_a_checkpoint_damaged_after_it_was_written_is_skipped_for_the_previous_one(reference, tmp_path):
    """A complete checkpoint whose files were damaged later (a bad disk, a partial copy): resume reports it and
    continues from the one before."""
    shutil.copytree(reference[2], tmp_path / "ckpt")  # checkpoints 6 and 8 of the finished run
    for folder, _, names in os.walk(tmp_path / "ckpt" / "8" / "student"):
        for name in names:
            os.truncate(os.path.join(folder, name), 0)
    code, _, stderr = _run("plain", tmp_path / "ckpt", tmp_path / "out.npz")
    assert code == 0, stderr[-3000:]
    log = _assert_same_as_reference(reference, tmp_path / "out")  # steps 7 and 8 redone from checkpoint 6
    assert log["events"][:2] == ["checkpoint_unreadable", "resume"]


if __name__ == "__main__":
    child(*sys.argv[1:4])

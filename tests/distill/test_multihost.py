"""Multi-host runs on JAX's multi-controller runtime, as separate processes on localhost (tests/multihost_worker.py):
2 processes x 4 CPU devices give the losses and the final student of 1 process x 8 devices; a checkpoint the
2 processes wrote resumes in 1 process on another mesh with the uninterrupted run's losses; a killed process ends
the other with JAX's error naming it, within the heartbeat timeout. The recipe's multi-host flags become
`jax.distributed.initialize` arguments.

The same processes then evaluate (tests/multihost_eval_checks.py): each holding only its rows of the held-out
batches, the 2 processes give the held-out CE, agreement, KL, the suite's metrics and its greedy samples of the
1 process, the same on every process, on a mesh whose data axes keep each process's rows on its own devices, on
one that interleaves the processes and with models on no mesh; only process 0 writes the suite's files and the
student `prune_checkpoint` cuts from disk."""
import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

import multihost_launch
from multihost_launch import free_port
from recipe_env import compile_cache_env

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(TESTS, "multihost_worker.py")
TIMEOUT_S = 600  # per run: a run that hangs fails the test instead of blocking it (a guard, not a time bound:
# the runs beside the other test worker take 2-3x their time alone)


def launch(processes: int, devices: int, mesh: str, out: str, env: dict, **options) -> list[subprocess.Popen]:
    """`processes` workers, each with `devices` CPU devices, over one global mesh; output in files under `out`
    (XLA:CPU without backend optimisation, like every process the tests start: tests/conftest.py)."""
    return multihost_launch.launch(WORKER, processes, devices, out, env=env, mesh=mesh, **options)


def finish(procs: list[subprocess.Popen], out: str, timeout: float = TIMEOUT_S) -> list[dict]:
    multihost_launch.wait_all(procs, timeout, out)
    return multihost_launch.results(procs, out)


def student_tensors(folder: str) -> dict[str, np.ndarray]:
    return load_file(os.path.join(folder, "student", "model.safetensors"))


@pytest.fixture(scope="module")
def worker_env(tmp_path_factory) -> dict:
    """The workers' environment: this module's own persistent compilation cache, so the killed-process runs (the
    2 x 4 run's programs) and the resumed run load what the first runs compiled (the module 92 s -> 77 s alone).
    Not the session's shared cache: a process killed by a test could leave an entry half-written."""
    cache = tmp_path_factory.mktemp("multihost-compile-cache")
    return {**os.environ, "PYTHONUNBUFFERED": "1", **compile_cache_env(cache)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, worker_env):
    """The 2 x 4 run (checkpointing every step) and the 1 x 8 reference, started together; each then evaluates."""
    root = tmp_path_factory.mktemp("multihost")
    two = launch(2, 4, "fsdp=4,tp=2", str(root / "two"), worker_env, checkpoint=str(root / "two_ckpt"),
                 run_dir=str(root / "two_run"), suite=True)
    one = launch(1, 8, "fsdp=4,tp=2", str(root / "one"), worker_env, suite=True)
    return {"root": root, "two": finish(two, str(root / "two")), "one": finish(one, str(root / "one"))[0]}


@pytest.mark.slow
def test_two_processes_give_the_losses_and_student_of_one(runs):
    one, (first, second) = runs["one"], runs["two"]
    assert (first["process_count"], first["devices"], one["devices"]) == (2, 8, 8)
    assert first["sharded_over_processes"] and not one["sharded_over_processes"]
    assert first["losses"] == second["losses"] and len(first["losses"]) == 3  # every process sees the same
    assert first["data_state"] == second["data_state"] == one["data_state"]  # one global position
    assert (first["tokenised_here"], second["tokenised_here"], one["tokenised_here"]) == (6, 5, 11)  # shares
    assert first["shared_equal"] and second["shared_equal"]  # ... and every process has every text's tokens
    np.testing.assert_allclose(first["losses"], one["losses"], rtol=0, atol=1e-5)  # measured within 3e-7
    np.testing.assert_allclose(first["evals"], one["evals"], rtol=0, atol=1e-5)
    assert first["snapshot_equal"] and second["snapshot_equal"]  # rollback copy of arrays spanning processes
    assert first["local_rows_equal"] and second["local_rows_equal"]  # a process reads back its own batch rows
    assert "hold 8 rows of a 8-row global batch but it has 4" in first["rows_without_data_axis"], first
    assert one["rows_without_data_axis"] == "accepted"  # one process: its rows are the whole batch
    assert first["reload_equal"] and second["reload_equal"]  # the saved student loads back onto the 2-process mesh
    records = [json.loads(line) for line in open(runs["root"] / "two_run" / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r and not r.get("eval")] == [1, 2, 3]  # process 0 logs alone
    two, single = student_tensors(runs["root"] / "two"), student_tensors(runs["root"] / "one")
    assert sorted(two) == sorted(single) and len(two) > 10
    for name, value in single.items():  # measured within 3e-6 (Adam on near-zero gradients, lr 1e-2)
        np.testing.assert_allclose(two[name], value, rtol=0, atol=1e-4, err_msg=name)


@pytest.mark.slow
def test_checkpoint_of_two_processes_resumes_in_one_on_another_mesh(runs, worker_env):
    """The 2-process run's step-2 checkpoint resumes in 1 process on 4 devices (fsdp=2,tp=2) with a student of
    other weights: step 3 and the final student equal the uninterrupted run's."""
    root = runs["root"]
    resume_dir = root / "resume_ckpt"
    shutil.copytree(root / "two_ckpt" / "2", resume_dir / "2")  # as if the run had stopped after step 2
    result = finish(launch(1, 4, "fsdp=2,tp=2", str(root / "resumed"), worker_env, checkpoint=str(resume_dir),
                           student_seed=5), str(root / "resumed"))[0]
    assert result["events"][0] == "resume" and result["steps"] == 3
    np.testing.assert_allclose(result["losses"], runs["two"][0]["losses"], rtol=0, atol=1e-5)
    two, resumed = student_tensors(root / "two"), student_tensors(root / "resumed")
    for name, value in two.items():
        np.testing.assert_allclose(resumed[name], value, rtol=0, atol=1e-4, err_msg=name)


def close(got, want, path=""):
    """Every number of `got` within 1e-5 of `want` (relative for perplexity, which is exp of the loss); every
    string, count and None equal."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), path
        for key in want:
            close(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            close(a, b, f"{path}[{i}]")
    elif isinstance(want, float):
        tolerance = 1e-5 * max(1.0, abs(want)) if path.endswith("perplexity") else 1e-5
        assert abs(got - want) <= tolerance, (path, got, want)
    else:
        assert got == want, (path, got, want)


@pytest.mark.slow
def test_two_processes_evaluate_the_global_batches_of_one(runs):
    one, (first, second) = runs["one"]["evaluation"], (r["evaluation"] for r in runs["two"])
    assert (first["local_rows"], one["local_rows"], first["batches"]) == (4, 8, 2)  # each holds half the rows
    assert first["sharded_over_processes"] and not one["sharded_over_processes"]
    assert first["global_ids"] == second["global_ids"] == one["global_ids"]  # batch_arrays: the global batch
    for key in ("suite", "layouts"):
        assert first[key] == second[key], key  # every process computes the same numbers ...
        close(first[key], one[key], key)  # ... the one-process numbers (measured within 6e-7)
    rows = one["suite"]["models"]
    assert rows["student"]["eval_tokens"] == rows["teacher"]["eval_tokens"] == one["layouts"]["unplaced"]["tokens"]
    assert rows["student"]["eval_tokens"] > 300  # all held-out tokens, not one process's share
    assert first["suite"]["samples"] == one["suite"]["samples"]  # greedy continuations token for token
    assert len(one["suite"]["samples"]) == 3 and 0 < rows["student"]["kl"] and rows["student"]["mc_accuracy"] >= 0


@pytest.mark.slow
def test_only_process_0_writes(runs):
    (first, second), one = (r["evaluation"] for r in runs["two"]), runs["one"]["evaluation"]
    two_out, one_out = runs["root"] / "two" / "evaluation", runs["root"] / "one" / "evaluation"
    assert sorted(os.listdir(two_out / "suite0")) == ["suite.json", "suite.md"]
    assert not os.path.exists(two_out / "suite1")  # process 1's out_path: nothing, not even the folder
    written = json.load(open(two_out / "suite0" / "suite.json"))
    assert written["models"] == first["suite"]["models"]
    # prune_checkpoint: process 0 writes the shared folder, and it is complete when process 1 returns
    assert (first["pruned_writes"], second["pruned_writes"], one["pruned_writes"]) == (1, 0, 1)
    assert second["pruned_files"] == first["pruned_files"] and "model.safetensors" in first["pruned_files"]
    two, single = (load_file(str(folder / "pruned" / "model.safetensors")) for folder in (two_out, one_out))
    assert sorted(two) == sorted(single) and len(single) > 5
    for name, value in single.items():
        np.testing.assert_array_equal(two[name], value, err_msg=name)  # same teacher, same plan, same bytes


@pytest.mark.slow
def test_a_killed_process_ends_the_other_with_a_clear_error_in_bounded_time(tmp_path, worker_env):
    """Two runs at once. In each, one process is SIGKILLed inside the loop (fetching batch 2 while step 1 runs)
    and the other waits in the step's collectives. Process 1 killed: JAX's coordination service (in process 0)
    misses its heartbeats and stops process 0 within `heartbeat_timeout_s`, naming task 1. Process 0 killed: the
    service goes with it and process 1 is stopped at once. Each survivor's end is noted as it happens (both runs
    are watched together), so the bounds hold beside the other test worker too: they are the service's detection
    time plus the survivor's exit, not CPU time."""
    heartbeat = 10
    runs = {killed: launch(2, 4, "fsdp=4,tp=2", str(tmp_path / f"kill{killed}"), worker_env, kill_at_batch=2,
                           kill_process=killed, heartbeat_timeout_s=heartbeat, guard=False, evaluate=False)
            for killed in (1, 0)}
    ended, deadline = {}, time.monotonic() + TIMEOUT_S
    while len(ended) < len(runs) and time.monotonic() < deadline:
        for killed, procs in runs.items():
            if killed not in ended and procs[1 - killed].poll() is not None:
                ended[killed] = time.time()
        time.sleep(0.05)
    if len(ended) < len(runs):
        for proc in [p for pair in runs.values() for p in pair]:
            proc.kill()
        pytest.fail(f"the survivors of runs {sorted(set(runs) - set(ended))} hung after their partner was killed")
    logs, waited = {}, {}
    for killed, procs in runs.items():
        out, survivor = str(tmp_path / f"kill{killed}"), procs[1 - killed]
        procs[killed].wait(timeout=30)
        logs[killed] = open(os.path.join(out, f"log{1 - killed}.txt")).read()
        assert procs[killed].returncode == -9, open(os.path.join(out, f"log{killed}.txt")).read()[-3000:]
        assert survivor.returncode != 0, logs[killed][-3000:]
        waited[killed] = ended[killed] - float(open(os.path.join(out, "killed_at")).read())
    print(f"survivors ended {waited} s after the kill (by killed process)", flush=True)
    for killed, log in logs.items():
        assert "JAX distributed service detected fatal errors" in log and "another task died" in log, log[-3000:]
        assert f"multi-host process {1 - killed} of 2" in log  # what a lost process looks like, said at the start
    assert "The following tasks are unhealthy (stopped sending heartbeats):\n1\n" in logs[1], logs[1][-3000:]
    assert "Failed to send RPC to coordination service" in logs[0] and "leader task" in logs[0], logs[0][-3000:]
    assert waited[1] < heartbeat + 20, waited  # measured 6-10 s (the service checks heartbeats periodically)
    assert waited[0] < 20, waited  # measured under 1 s


def test_recipe_multi_host_flags_become_initialize_arguments():
    from nnx_surgery.distill.distributed import DistributedError, DistributedSettings
    from nnx_surgery.recipes.compress.resolution import resolve
    from nnx_surgery.recipes.compress.multi_host import distributed_settings as from_section

    def distributed_settings(argv):  # the multi-host flags as the recipe reads them (its one parse)
        return from_section(resolve(argv).multi_host)

    settings = distributed_settings(["--coordinator", "10.0.0.2:8476", "--num-processes", "4", "--process-id",
                                     "3", "--heartbeat-timeout", "30", "--preset", "tiny"])
    assert settings.initialize_kwargs() == {"coordinator_address": "10.0.0.2:8476", "num_processes": 4,
                                            "process_id": 3, "heartbeat_timeout_seconds": 30,
                                            "initialization_timeout": 300}
    auto = distributed_settings(["--distributed", "auto"])
    assert auto.requested and auto.initialize_kwargs() == {"heartbeat_timeout_seconds": 100,
                                                           "initialization_timeout": 300}
    assert not distributed_settings(["--preset", "tiny"]).requested  # one host: no jax.distributed
    with pytest.raises(DistributedError, match="all three"):
        distributed_settings(["--coordinator", "10.0.0.2:8476", "--num-processes", "4"])
    with pytest.raises(DistributedError, match="process_id 4 must be in"):
        DistributedSettings(coordinator="h:1", num_processes=4, process_id=4)
    with pytest.raises(DistributedError, match="HOST:PORT"):
        DistributedSettings(coordinator="10.0.0.2", num_processes=2, process_id=0)


def test_multi_host_launches_are_recognised_and_a_late_start_is_refused():
    import jax
    from nnx_surgery.distill.distributed import (DistributedError, DistributedSettings, initialize_distributed,
                                     launched_multi_host)

    assert launched_multi_host({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2"})
    assert not launched_multi_host({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"})  # sbatch script, not an srun step
    assert not launched_multi_host({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1"})
    assert launched_multi_host({"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"})
    assert not launched_multi_host({"TPU_WORKER_HOSTNAMES": "localhost"})  # one TPU VM
    assert launched_multi_host({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:8476"})
    assert not initialize_distributed(DistributedSettings())  # nothing asked: one host, no-op
    jax.devices()  # devices touched: too late to start the runtime
    with pytest.raises(DistributedError, match="before anything touches devices"):
        initialize_distributed(DistributedSettings(coordinator=f"127.0.0.1:{free_port()}", num_processes=2,
                                                   process_id=1, initialization_timeout_s=2))

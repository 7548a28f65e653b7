"""Multi-host evaluation, as separate processes on localhost (tests/multihost_eval_worker.py): 2 processes x 4 CPU
devices, each holding only its rows of the held-out batches, give the held-out CE, agreement, KL, the suite's
metrics and its greedy samples of 1 process x 8 devices, the same on every process, on a mesh whose data axes keep
each process's rows on its own devices, on one that interleaves the processes and with models on no mesh; only
process 0 writes the suite's files and the student `prune_checkpoint` cuts from disk."""
import json
import os
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

import multihost_launch

# two JAX processes and a reference run: slow; no time bound (beside the other test worker, in the parallel pass)
pytestmark = pytest.mark.slow

TESTS = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(TESTS, "multihost_eval_worker.py")
TIMEOUT_S = 600  # for all workers together: a hang fails the test instead of blocking it (a guard only)
# XLA:CPU without backend optimisation: these tiny programs compile in half the time (same flag for both runs)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "--xla_backend_optimization_level=0"}


def launch(processes: int, devices: int, out: str) -> list[subprocess.Popen]:
    return multihost_launch.launch(WORKER, processes, devices, out, env=ENV, mesh="fsdp=4,tp=2")


def finish(runs: dict[str, list[subprocess.Popen]], root) -> dict[str, list[dict]]:
    multihost_launch.wait_all([proc for procs in runs.values() for proc in procs], TIMEOUT_S, root)
    return {name: multihost_launch.results(procs, os.path.join(root, name)) for name, procs in runs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2 x 4 run and the 1 x 8 reference, started together."""
    root = tmp_path_factory.mktemp("multihost_eval")
    results = finish({"two": launch(2, 4, str(root / "two")), "one": launch(1, 8, str(root / "one"))}, root)
    return {"root": root, "two": results["two"], "one": results["one"][0]}


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


def test_two_processes_evaluate_the_global_batches_of_one(runs):
    one, (first, second) = runs["one"], runs["two"]
    assert (first["process_count"], first["devices"], one["devices"]) == (2, 8, 8)
    assert first["sharded_over_processes"] and not one["sharded_over_processes"]
    assert (first["local_rows"], one["local_rows"], first["batches"]) == (4, 8, 2)  # each holds half the rows
    assert first["global_ids"] == second["global_ids"] == one["global_ids"]  # batch_arrays: the global batch
    for key in ("suite", "layouts"):
        assert first[key] == second[key], key  # every process computes the same numbers ...
        close(first[key], one[key], key)  # ... the one-process numbers (measured within 6e-7)
    rows = one["suite"]["models"]
    assert rows["student"]["eval_tokens"] == rows["teacher"]["eval_tokens"] == one["layouts"]["unplaced"]["tokens"]
    assert rows["student"]["eval_tokens"] > 300  # all held-out tokens, not one process's share
    assert first["suite"]["samples"] == one["suite"]["samples"]  # greedy continuations token for token
    assert len(one["suite"]["samples"]) == 3 and 0 < rows["student"]["kl"] and rows["student"]["mc_accuracy"] >= 0


def test_only_process_0_writes(runs):
    root, (first, second) = runs["root"], runs["two"]
    assert sorted(os.listdir(root / "two" / "suite0")) == ["suite.json", "suite.md"]
    assert not os.path.exists(root / "two" / "suite1")  # process 1's out_path: nothing, not even the folder
    written = json.load(open(root / "two" / "suite0" / "suite.json"))
    assert written["models"] == first["suite"]["models"]
    # prune_checkpoint: process 0 writes the shared folder, and it is complete when process 1 returns
    assert (first["pruned_writes"], second["pruned_writes"], runs["one"]["pruned_writes"]) == (1, 0, 1)
    assert second["pruned_files"] == first["pruned_files"] and "model.safetensors" in first["pruned_files"]
    two, one = (load_file(str(root / name / "pruned" / "model.safetensors")) for name in ("two", "one"))
    assert sorted(two) == sorted(one) and len(one) > 5
    for name, value in one.items():
        np.testing.assert_array_equal(two[name], value, err_msg=name)  # same teacher, same plan, same bytes

"""Launching multi-host test workers as processes on localhost: one coordinator port, one log and one result
file per process, and a bounded wait (a hang fails the test instead of blocking the suite)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(worker: str, processes: int, devices: int, out: str, env: dict, **options) -> list[subprocess.Popen]:
    """`processes` runs of `worker` in the environment `env`, each with `devices` CPU devices and the JSON of its
    arguments; with more than one, they form one jax.distributed run. Process i logs to `out`/log{i}.txt."""
    os.makedirs(out, exist_ok=True)
    port, procs = free_port(), []
    for index in range(processes):
        args = dict(devices=devices, out=out, **options)
        if processes > 1:
            args.update(coordinator=f"127.0.0.1:{port}", num_processes=processes, process_id=index)
        with open(os.path.join(out, f"log{index}.txt"), "w") as log:
            procs.append(subprocess.Popen([sys.executable, worker, json.dumps(args)], stdout=log,
                                          stderr=subprocess.STDOUT, cwd=os.path.dirname(TESTS),
                                          env=env))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float, where) -> None:
    """Wait for every process within `timeout` seconds in all; past it, kill them all and fail."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"a worker hung past {timeout} s; logs in {where}")


def results(procs: list[subprocess.Popen], out: str) -> list[dict]:
    """Each finished process's result{i}.json, after checking it exited cleanly (else its log's tail)."""
    for index, proc in enumerate(procs):
        assert proc.returncode == 0, open(os.path.join(out, f"log{index}.txt")).read()[-4000:]
    return [json.load(open(os.path.join(out, f"result{i}.json"))) for i in range(len(procs))]

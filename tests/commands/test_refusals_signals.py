"""Stopping and running out of space, second round (issue 63): SIGTERM exits 143 and Ctrl-C 130 wherever they
arrive (a training step, an evaluation, the recipe), a second Ctrl-C stops at once instead of crashing, the advice
names nothing the command has no flag for, and what an interrupted or full-disk run leaves never blocks the
corrected rerun (cache-teacher: nothing, or a cache --resume continues; compress: no run folder). The signals are
real ones, sent to a child process, only where the process itself is what is checked; the rest runs here."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from refusal_env import DATA, FULL_DISK, ROOT, SPEC, make_workspace, run, tree

# the signals are sent to children, which inherit this process's handlers (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("default_signal_handlers")
# PYTHONFAULTHANDLER: a child that has to be aborted prints where each of its threads was
ENV = {**os.environ, "PYTHONFAULTHANDLER": "1", "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
STEP_SHOWN = re.compile(r"\| *[1-9]\d*/\d+ \[")  # the progress bar after a completed step


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    base = tmp_path_factory.mktemp("refusals-signals")
    cache, saved = tmp_path_factory.mktemp("gguf-cache"), os.environ.get("NNX_SURGERY_CACHE")
    w = make_workspace(base, cache)
    yield w
    os.environ.pop("NNX_SURGERY_CACHE", None) if saved is None else os.environ.update(NNX_SURGERY_CACHE=saved)


def distill_signalled(w: dict, out: str, signals: list[str], *, at_step: bool) -> tuple[int, str]:
    """`nnx-surgery distill` in a child process, sent `signals` 0.3 s apart once a training step is done
    (`at_step`) or while it starts; (exit code, stdout and stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "nnx_surgery", "distill", w["teacher"], w["student"], "-o", out,
                             "--steps", "100000", *DATA, "--data", w["data"]], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)
    seen = bytearray()
    reader = threading.Thread(target=lambda: [seen.extend(chunk) for chunk in
                                              iter(lambda: proc.stdout.read1(4096), b"")])
    reader.start()
    deadline = time.time() + 120
    while time.time() < deadline and not (STEP_SHOWN.search(seen.decode(errors="replace")) if at_step
                                           else b"[distill]" in seen):
        time.sleep(0.05)
    for index, name in enumerate(signals):
        time.sleep(0.3 if index else 0.0)
        proc.send_signal(getattr(signal, name))
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:  # stuck: SIGABRT makes faulthandler print every thread's stack, then fail
        proc.send_signal(signal.SIGABRT)
        proc.wait(timeout=60)
        reader.join()
        pytest.fail(f"the child did not exit within 120 s of {signals}; its output and stacks:\n"
                    f"{seen.decode(errors='replace')[-8000:]}")
    reader.join()
    return code, seen.decode(errors="replace")


@pytest.mark.parametrize("signals,at_step,code", [(["SIGTERM"], True, 143), (["SIGINT", "SIGINT"], True, 130),
                                                  (["SIGTERM", "SIGTERM"], False, 143)],
                         ids=["sigterm-at-a-step", "ctrl-c-twice-at-a-step", "sigterm-twice-while-starting"])
def test_distill_stops_with_the_signals_code(w, tmp_path, signals, at_step, code):
    """SIGTERM: 143, Ctrl-C: 130; a second signal 0.3 s after the first stops at once with the same code (never a
    crash); one last line says what was left, and no advice names a Python setting."""
    out = str(tmp_path / "distilled")
    got, text = distill_signalled(w, out, signals, at_step=at_step)
    assert got == code, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith("terminated (SIGTERM)" if code == 143 else "interrupted"), text[-3000:]
    assert "nothing was written" in last and "Traceback" not in text and "checkpoint.directory" not in text
    assert not os.path.exists(out) and os.listdir(tmp_path) == []


@pytest.mark.parametrize("several_processes", [False, True])
def test_sigterm_in_one_process_of_several_keeps_its_default_effect(several_processes):
    """One process: SIGTERM raises `Terminated` where the command runs (its cleanup runs, then exit 143). One
    process of a multi-host run: the signal's default effect, so the process ends at once and the others see it."""
    script = (f"import os, signal, time\nfrom nnx_surgery import signals\n"
              f"signals.multi_host = lambda: {several_processes}\n"
              "try:\n    with signals.raised_in_main_thread():\n        os.kill(os.getpid(), signal.SIGTERM)\n"
              "        time.sleep(30)\nexcept signals.Terminated:\n    raise SystemExit(7)\n")
    done = subprocess.run([sys.executable, "-c", script], env=ENV, cwd=ROOT, timeout=120, capture_output=True)
    assert done.returncode == (-signal.SIGTERM if several_processes else 7), done.stderr[-2000:]


def test_sigterm_at_an_evaluation_and_in_the_recipe_exits_143(w, tmp_path, monkeypatch):
    """distill's loop names the signal that stopped it (here raised where it stops: an evaluation's end, the
    recipe's teacher loading): SIGTERM exits 143 in distill and compress, Ctrl-C 130, and compress leaves no run
    folder that would refuse the same command."""
    from nnx_surgery import distill
    from nnx_surgery.distill.interruption import RunInterrupted, interruption_message
    from nnx_surgery.recipes.compress import run_phases

    def stopped_by(name):
        def stop(*args, **kwargs):
            message = interruption_message(name, 3, 9, saved=False, directory=None, checkpoint_step=None)
            raise RunInterrupted(message, step=3, checkpoint_step=None, directory=None)
        return stop

    out = str(tmp_path / "out")
    for name, code in (("SIGTERM", 143), ("SIGINT", 130)):
        with monkeypatch.context() as patch:
            patch.setattr(distill, "run", stopped_by(name))
            patch.setattr(run_phases, "load_teacher_and_data", stopped_by(name))
            before = tree(w["base"])
            got, _, err = run("distill", w["teacher"], w["student"], "-o", out, *DATA, "--data", w["data"])
            assert got == code and "checkpoint.directory" not in err, err
            got, _, err = run("compress", "--teacher", w["teacher"], "--student", SPEC, "--data", w["data"], *DATA,
                              "--output", out)
            assert got == code and err.strip().splitlines()[-1].startswith(name), err
            assert not os.path.exists(out) and tree(w["base"]) == before


def test_cache_teacher_stopped_leaves_nothing_or_what_resume_continues(w, tmp_path, monkeypatch):
    """Ctrl-C before a shard is listed (one is written, its progress file not yet): the folder is removed and the
    same command runs. Ctrl-C after a listed shard: the cache is kept, the message says --resume, and --resume
    finishes it."""
    from nnx_surgery.distill.inputs import topk_cache

    write = topk_cache.write_cache
    out = str(tmp_path / "cache")
    argv = ["cache-teacher", w["teacher"], "--top-k", "4", "-o", out, *DATA, "--data", w["data"], "--rows-per-shard",
            "16"]

    def unlisted_shard(teacher, batches, folder, settings, **kwargs):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, topk_cache.shard_name(0, 0)), "wb") as handle:
            handle.write(b"a shard with no progress file")
        raise KeyboardInterrupt

    def after_first_shard(*args, **kwargs):
        return write(*args, **kwargs, after_shard=lambda index: (_ for _ in ()).throw(KeyboardInterrupt()))

    with monkeypatch.context() as patch:
        patch.setattr(topk_cache, "write_cache", unlisted_shard)
        code, _, err = run(*argv)
    assert code == 130 and "run the same command again" in err and "--resume" not in err, err
    assert os.listdir(tmp_path) == []
    with monkeypatch.context() as patch:
        patch.setattr(topk_cache, "write_cache", after_first_shard)
        code, _, err = run(*argv)
    assert code == 130 and "rerun the same command with --resume" in err, err
    code, _, err = run(*argv)
    assert code == 2 and "--overwrite" in err  # the same command: the partial cache is not replaced silently
    code, _, err = run(*argv, "--resume")
    assert code == 0, err
    assert os.path.isfile(os.path.join(out, "manifest.json"))




def test_a_full_disk_in_compress_and_cache_teacher_leaves_nothing(w, tmp_path):
    """Past a file size limit (as `ulimit -f`): compress (at its settings files, and with room for them, at the
    first checkpoint, which orbax's writer reports in words) and cache-teacher refuse in one line and leave no
    folder, so that the same command runs once space is freed."""
    out = tmp_path / "out"
    compress = ["compress", "--teacher", w["teacher"], "--student", SPEC, "--data", w["data"], *DATA, "--steps", "2",
                "--batch-size", "2", "--eval-tokens", "64", "--eval-prompts", "0", "--no-general-eval", "--output",
                str(out / "run")]
    cache = ["cache-teacher", w["teacher"], "--top-k", "4", "-o", str(out / "cache"), *DATA, "--data", w["data"]]
    commands = [[0, compress], [30000, compress], [0, cache], [2000, cache], [0, ["export-gguf", w["teacher"],
                                                                                   str(out / "x.gguf")]]]
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, json.dumps(commands)], capture_output=True, text=True,
                          timeout=300, env={**ENV, "NNX_SURGERY_CACHE": str(tmp_path / "gguf")}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for argv, (code, err) in zip(commands, json.loads(proc.stdout.strip().splitlines()[-1])):
        assert code == 2 and "Traceback" not in err, (argv, err)
        assert "the disk is full or a file size limit was reached" in err, (argv, err)
    assert not out.exists() or os.listdir(out) == [], os.listdir(out)

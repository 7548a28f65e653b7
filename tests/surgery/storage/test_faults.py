"""Faults while saving: a full disk (RLIMIT_FSIZE in a subprocess) or a crash mid-write never leaves a folder
that looks complete; the previous output and the previous distillation checkpoints stay intact and usable, and
the next save cleans up what the dead writer left."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
LIMIT = 24 << 10  # bytes any one file may reach: the tiny model's weights are ~75 KB

SAVE = textwrap.dedent("""
    import os, resource, signal, sys
    sys.path.insert(0, {tests!r})
    from hf_reference import make_hf_model
    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained, save_pretrained
    mode, teacher, out = sys.argv[1:4]
    model = load_pretrained(teacher)
    # full-disk: the write fails with EFBIG, as on a full disk; crash: SIGXFSZ kills the writer mid-file
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN if mode == "full-disk" else signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
    try:
        save_pretrained(model, out, overwrite=True)
    except OSError as err:
        print("SAVE FAILED", err.errno, err.strerror)
        sys.exit(3)
""")


def _digests(folder) -> dict[str, str]:
    return {name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A teacher folder, and a previous output of ours next to where the failing saves go."""
    from hf_reference import make_hf_model
    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained, save_pretrained

    root = tmp_path_factory.mktemp("faults")
    make_hf_model("gemma2", seed=5, num_hidden_layers=2, layer_types=None).save_pretrained(root / "teacher")
    model = load_pretrained(root / "teacher")
    return root, model, save_pretrained


def _run_save(mode: str, teacher, out) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    script = SAVE.format(tests=os.path.join(ROOT, "tests"), limit=LIMIT)
    return subprocess.run([sys.executable, "-c", script, mode, str(teacher), str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("mode", ["full-disk", "crash"])
def test_failed_save_keeps_previous_output_and_leaves_nothing_complete(saved, tmp_path, mode):
    root, model, save_pretrained = saved
    out = tmp_path / "student"
    save_pretrained(model, out, max_shard_size="20KB")  # the previous output: sharded, so it differs
    before = _digests(out)
    proc = _run_save(mode, root / "teacher", out)
    if mode == "full-disk":
        assert proc.returncode == 3 and "SAVE FAILED 27" in proc.stdout, proc.stderr[-3000:]  # EFBIG
    else:
        assert proc.returncode == -signal.SIGXFSZ, (proc.returncode, proc.stderr[-3000:])
    assert _digests(out) == before  # the previous output, untouched
    leftovers = [name for name in os.listdir(tmp_path) if name != "student"]
    if mode == "full-disk":
        assert leftovers == []  # the failed writer removed its temporary folder
    else:  # a killed writer cannot clean up: what it left is hidden and incomplete, never named like the output
        assert len(leftovers) == 1 and leftovers[0].startswith(".student.partial-")
        partial = tmp_path / leftovers[0]
        assert "config.json" not in os.listdir(partial)  # written last: the partial folder is not loadable
    # The next save succeeds, replaces the previous output, and removes the dead writer's leftovers.
    save_pretrained(model, out, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["student"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


CHECKPOINT = textwrap.dedent("""
    import json, os, resource, signal, sys
    import numpy as np
    import jax.numpy as jnp
    from nnx_surgery.distill.loop.checkpointing import Checkpointer
    directory, mode = sys.argv[1], sys.argv[2]
    small = {{"w": jnp.arange(64, dtype=jnp.float32)}}
    big = {{"w": jnp.arange(1 << 16, dtype=jnp.float32)}}  # 256 KB: beyond the file size limit
    ckpt = Checkpointer(directory, keep=3)
    if mode == "write":
        ckpt.save(1, student=small, optimizer=small, projections={{}}, meta={{"step": 1}})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.RLIM_INFINITY))
        try:
            ckpt.save(2, student=big, optimizer=big, projections={{}}, meta={{"step": 2}})
            print("RESULT saved")
        except Exception as err:
            print("RESULT failed", type(err).__name__)
        os._exit(0)
    step = ckpt.latest_step()
    student, _, _ = ckpt.restore(step, student=small, optimizer=small, projections={{}})
    print("RESULT " + json.dumps({{"step": step, "meta": ckpt.read_meta(step),
                                  "equal": bool(np.array_equal(student["w"], np.arange(64)))}}))
""")


def test_full_disk_during_a_distillation_checkpoint_keeps_the_previous_one(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    script = CHECKPOINT.format(limit=LIMIT)
    directory = str(tmp_path / "ckpt")

    def run(mode):
        proc = subprocess.run([sys.executable, "-c", script, directory, mode], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, proc.stderr[-3000:]
        return lines[-1][len("RESULT "):]

    assert run("write").startswith("failed")
    restored = json.loads(run("read"))
    assert restored["step"] == 1 and restored["meta"]["step"] == 1 and restored["equal"]

"""The teacher cache (issue 42, distill.inputs.topk_cache): the cached top k equal the full logits' top k and
log-softmax, each encoding within its stated tolerance; shards are checksummed, resume is byte-identical, the
reader replays TokenBatches's order; two processes write the one-process cache and read its batches; a cache
written on a mesh holds what one device writes; `nnx-surgery cache-teacher` refuses bad input in one line."""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_surgery.distill import TokenBatches
from nnx_surgery.distill.inputs import cache_format as fmt
from nnx_surgery.distill.inputs import topk_cache as teacher_cache
from nnx_surgery.distill.inputs.topk_cache import CacheError, CacheSettings, TeacherCache, write_cache
from distill_fixtures import VOCAB, tiny_teacher

K = 7
# the compressed encodings' stated tolerances: max |decoded - exact| log-probability over the top k, on entries
# within 12 nats of the top 1 (bench/teacher_cache_encoding.py measures them on the real Gemma 3 270M, below these;
# float16's absolute error grows with the magnitude, which this random teacher's log-probabilities reach)
TOLERANCE = {"exact": 0.0, "float16": 2e-2, "q16": 1e-3, "q8": 8e-2, "q8z": 8e-2}


@pytest.fixture(scope="module")
def teacher():
    return tiny_teacher(seed=1)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, VOCAB, size=int(n)) for n in rng.integers(5, 40, size=24)]
    return TokenBatches.from_arrays(docs, eos_id=1, bos_id=2, seq_len=16, batch_size=4, seed=3)


def _settings(encoding: str, **extra) -> CacheSettings:  # vocab_chunk 40 leaves a padded last chunk of the 96
    return CacheSettings(top_k=K, encoding=encoding, rows_per_shard=5, batch_rows=4, vocab_chunk=40, block_rows=24,
                         **extra)


@pytest.fixture(scope="module")
def exact_cache(teacher, data, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("cache") / "exact")
    write_cache(teacher, data, folder, _settings("exact"), identity={"teacher": {"config_sha256": "c"}})
    return folder


def _full(teacher, batch):
    out = teacher(jnp.asarray(batch["input_ids"]), positions=jnp.asarray(batch["positions"]),
                  segment_ids=jnp.asarray(batch["segment_ids"]))
    return np.asarray(jax.nn.log_softmax(out.logits.astype(jnp.float32), -1))


def test_cached_topk_equals_the_full_logits(teacher, exact_cache):
    cache = TeacherCache.open(exact_cache)
    batch = next(cache.batches(4))
    logprobs = _full(teacher, batch)
    values, ids = jax.lax.top_k(jnp.asarray(logprobs), K)
    np.testing.assert_array_equal(batch["topk_ids"], np.asarray(ids))
    np.testing.assert_allclose(batch["topk_logprobs"], np.asarray(values), atol=2e-5)
    mass = np.exp(np.asarray(values, np.float64)).sum(-1)
    np.testing.assert_allclose(batch["residual"], np.log1p(-mass), atol=1e-4)


def test_reader_replays_the_training_order(data, exact_cache):
    cache = TeacherCache.open(exact_cache)
    data.restore({"epoch": 0, "position": 0})
    stream = iter(data)
    for got in list(cache.batches(4, epochs=3)):  # across epoch boundaries
        want = next(stream)
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)
    assert len(list(cache.batches(4, epochs=1))) == cache.num_rows // 4


def _by_id(rows: dict) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(rows["topk_ids"], axis=-1, kind="stable")
    return (np.take_along_axis(rows["topk_ids"], order, -1), np.take_along_axis(rows["topk_logprobs"], order, -1))


@pytest.mark.parametrize("encoding", ["float16", "q16", "q8", "q8z"])
def test_compressed_encodings_within_their_tolerance(teacher, data, exact_cache, encoding, tmp_path):
    """The same ids per token (q8z may order two ids of one quantised value either way), each log-probability
    within the tolerance, the most likely first."""
    folder = str(tmp_path / encoding)
    write_cache(teacher, data, folder, _settings(encoding), identity={})
    index = np.array([7, 0, 3, 9, 1, 2, 4, 5, 6, 8])  # across shards, in any order
    exact, packed = TeacherCache.open(exact_cache).rows(index), TeacherCache.open(folder).rows(index)
    (exact_ids, exact_values), (ids, values) = _by_id(exact), _by_id(packed)
    np.testing.assert_array_equal(ids, exact_ids)
    near = exact_values > exact["topk_logprobs"][..., :1] - 12
    error = np.abs(values - exact_values)[near]
    assert error.max() <= TOLERANCE[encoding], error.max()
    assert np.all(packed["topk_logprobs"][..., :1] >= packed["topk_logprobs"])
    assert np.allclose(packed["residual"], exact["residual"], atol=2e-2, rtol=2e-3)
    for key in ("input_ids", "loss_mask", "positions", "segment_ids"):
        np.testing.assert_array_equal(packed[key], exact[key], err_msg=key)


def test_q8z_holds_q8s_values_in_less_space_on_a_clustered_top_k():
    """Ids drawn as a real top k is (most from a few thousand common pieces of 262,144): q8z decodes to q8's ids
    and values and takes far less space than q8's fixed 18-bit ids."""
    rng = np.random.default_rng(0)
    rows, tokens, k, vocab = 3, 64, 128, 262144
    common = rng.choice(vocab, size=4000, replace=False)
    ids = np.stack([np.stack([rng.choice(np.where(rng.random(200) < 0.8, rng.choice(common, 200),
                                                  rng.integers(0, vocab, 200)), k, replace=False)
                              for _ in range(tokens)]) for _ in range(rows)])
    logprobs = -np.sort(rng.exponential(3.0, size=(rows, tokens, k)), -1).astype(np.float32) - 0.1
    residual = np.full((rows, tokens), -4.0, np.float32)
    q8, q8z = (fmt.encode(ids, logprobs, residual, name, vocab) for name in ("q8", "q8z"))
    want, got = fmt.decode(q8, "q8", vocab, k), fmt.decode(q8z, "q8z", vocab, k)
    (want_ids, want_values), (got_ids, got_values) = _by_id(want), _by_id(got)
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_values, want_values)
    np.testing.assert_array_equal(got["residual"], want["residual"])
    assert sum(a.nbytes for a in q8z.values()) < 0.8 * sum(a.nbytes for a in q8.values())


def test_ids_pack_at_their_bit_width():
    ids = np.random.default_rng(1).integers(0, 262144, size=(3, 5, 128))
    packed = fmt.pack_ids(ids, 18)
    assert packed.shape == (3, 5, 288)
    np.testing.assert_array_equal(fmt.unpack_ids(packed, 18, 128), ids)


def test_a_flipped_byte_or_a_truncated_shard_is_named(exact_cache, tmp_path):
    for damage in ("flip", "truncate"):
        folder = str(tmp_path / damage)
        shutil.copytree(exact_cache, folder)
        shard = os.path.join(folder, fmt_shard := sorted(f for f in os.listdir(folder) if f.startswith("shard"))[1])
        raw = bytearray(open(shard, "rb").read())
        raw = raw[:-7] if damage == "truncate" else raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:]
        open(shard, "wb").write(bytes(raw))
        with pytest.raises(CacheError, match=f"{fmt_shard}: missing, truncated or corrupted"):
            TeacherCache.open(folder)


def test_resume_after_a_kill_gives_identical_shards(teacher, data, exact_cache, tmp_path):
    folder = str(tmp_path / "resumed")

    def kill(index):
        if index == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_cache(teacher, data, folder, _settings("exact"), identity={"teacher": {"config_sha256": "c"}},
                    after_shard=kill)
    assert not os.path.exists(os.path.join(folder, "manifest.json"))
    os.remove(os.path.join(folder, "shard-p000-000001.safetensors"))  # a shard lost too: written again
    with pytest.raises(CacheError, match="top_k is 7 in the cache but 8 here"):
        write_cache(teacher, data, folder, CacheSettings(top_k=8, rows_per_shard=5, encoding="exact", batch_rows=4),
                    identity={"teacher": {"config_sha256": "c"}}, resume=True)
    written = []
    write_cache(teacher, data, folder, _settings("exact"), identity={"teacher": {"config_sha256": "c"}},
                resume=True, after_shard=written.append)
    assert written[0] == 1 and 0 not in written and 2 not in written
    shards = sorted(f for f in os.listdir(exact_cache) if f.startswith("shard"))
    assert shards == sorted(f for f in os.listdir(folder) if f.startswith("shard"))
    for name in shards + ["manifest.json"]:
        assert open(os.path.join(folder, name), "rb").read() == open(os.path.join(exact_cache, name), "rb").read()


def test_a_cache_for_another_teacher_is_refused(exact_cache):
    cache = TeacherCache.open(exact_cache)
    cache.check_matches(teacher_config_hash="c", seq_len=16, tokenizer_hash=None)
    with pytest.raises(CacheError, match="made for teacher_config_hash 'c', not 'other'"):
        cache.check_matches(teacher_config_hash="other")
    with pytest.raises(CacheError, match="made for seq_len 16, not 32"):
        cache.check_matches(seq_len=32)


# ------------------------------------------------------------------------------------------------ the command
@pytest.fixture(scope="module")
def w(tmp_path_factory):
    from cache_workspace import teacher_workspace
    return teacher_workspace(tmp_path_factory.mktemp("cache-command"))


def _cache_args(w, out, *extra):
    return ("cache-teacher", w["teacher"], "--data", w["data"], "--seq-len", "32", "--batch-size", "4",
            "--rows-per-shard", "16", "--top-k", "8", "--output", out, *extra)


def test_command_writes_resumes_and_refuses(w):
    from refusal_env import assert_refused, run

    out = str(w["base"] / "cache")
    code, printed, err = run(*_cache_args(w, out))
    assert code == 0, err
    cache = TeacherCache.open(out)
    manifest = cache.manifest
    assert manifest["identity"]["teacher"]["weights_sha256"] and manifest["identity"]["tokenizer_sha256"]
    assert "bytes per token" in printed and len(manifest["shards"]) >= 2
    with open(os.path.join(w["teacher"], "config.json"), "rb") as handle:
        import hashlib
        cache.check_matches(teacher_config_hash=hashlib.sha256(handle.read()).hexdigest(), seq_len=32)
    # a killed run: the last shard gone, its progress entry dropped; --resume writes it again, byte for byte
    last = manifest["shards"][-1]["file"]
    original = open(os.path.join(out, last), "rb").read()
    os.remove(os.path.join(out, last))
    os.remove(os.path.join(out, "manifest.json"))
    progress = os.path.join(out, "progress-p000.json")
    saved = json.load(open(progress))
    saved["shards"] = saved["shards"][:-1]
    json.dump(saved, open(progress, "w"))
    assert run(*_cache_args(w, out, "--resume"))[0] == 0
    assert open(os.path.join(out, last), "rb").read() == original
    assert_refused(*run(*_cache_args(w, out)), "--output")  # not empty, neither --overwrite nor --resume
    assert_refused(*run(*_cache_args(w, out, "--resume")[:-3], "--top-k", "9", "--output", out, "--resume"),
                   "top_k is 8 in the cache but 9 here", started=True)
    assert_refused(*run(*_cache_args(w, str(w["base"] / "n1"))[:-4], "--top-k", "0", "--output", "x"), "--top-k")
    assert_refused(*run(*_cache_args(w, str(w["base"] / "n2"))[:-4], "--top-k", str(w["vocab"] + 1), "--output",
                        str(w["base"] / "n2")), "--top-k")
    assert_refused(*run("cache-teacher", str(w["base"] / "missing"), "--top-k", "4", "--output",
                        str(w["base"] / "n3")), "TEACHER")
    assert_refused(*run(*_cache_args(w, str(w["base"] / "n4"), "--resume")), "--resume")
    assert not any(os.path.exists(w["base"] / name) for name in ("n1", "n2", "n3", "n4"))
    # --cache-selection sampled: k draws of the distribution, resumed under the same settings only
    drawn = str(w["base"] / "drawn")
    code, printed, err = run(*_cache_args(w, drawn, "--cache-selection", "sampled"))
    assert code == 0 and "8 draws of" in printed, err
    assert TeacherCache.open(drawn).selection == "sampled"
    assert_refused(*run(*_cache_args(w, drawn, "--resume")), "in the cache but None here", started=True)
    mixed = str(w["base"] / "mixed")  # --cache-selection mixed: the top k/2 and draws of the rest
    code, printed, err = run(*_cache_args(w, mixed, "--cache-selection", "mixed"))
    assert code == 0 and "top 4 and 4 draws of the rest of" in printed, err
    assert TeacherCache.open(mixed).selection == "mixed"


def test_overwrite_replaces_the_cache_only_once_the_new_one_is_complete(w, monkeypatch):
    """`cache-teacher --overwrite` writes beside the old cache and swaps it in at the end: a failure after the
    first new shard (a full disk) leaves the old cache whole and readable, and a finished run replaces it."""
    from refusal_env import run, tree

    out = str(w["base"] / "overwritten")
    assert run(*_cache_args(w, out))[0] == 0
    before = tree(out)
    real_write = teacher_cache.write_cache

    def full_disk_after_one_shard(*args, **kwargs):
        def fail(_index):
            raise OSError(28, "No space left on device")
        return real_write(*args, **{**kwargs, "after_shard": fail})

    monkeypatch.setattr(teacher_cache, "write_cache", full_disk_after_one_shard)
    code, _, err = run(*_cache_args(w, out, "--top-k", "4", "--overwrite"))
    assert code != 0 and "No space left" in err
    assert tree(out) == before and TeacherCache.open(out).manifest["top_k"] == 8
    assert not [name for name in os.listdir(w["base"]) if name.startswith(".overwritten.")]  # no staging left
    monkeypatch.setattr(teacher_cache, "write_cache", real_write)
    assert run(*_cache_args(w, out, "--top-k", "4", "--overwrite"))[0] == 0
    assert TeacherCache.open(out).manifest["top_k"] == 4 and tree(out) != before


def test_two_processes_write_the_cache_of_one_and_read_its_batches(teacher, data, exact_cache, tmp_path):
    """Each process writes its own shards (shard i by process i % 2) and process 0 the manifest: the cache holds
    the rows of the one-process cache, byte for byte; read back by two processes, each gets its half of every
    batch, and the halves together are the one-process batch."""
    from nnx_surgery.distill.loop.cache_replay import CachedTeacherData

    folder = str(tmp_path / "two")
    for process in (1, 0):  # process 0 last: it lists every process's shards in the manifest
        write_cache(teacher, data, folder, _settings("exact"), identity={"teacher": {"config_sha256": "c"}},
                    process_index=process, process_count=2)
    one, two = TeacherCache.open(exact_cache), TeacherCache.open(folder)
    assert {s["file"][:10] for s in two.manifest["shards"]} == {"shard-p000", "shard-p001"}
    assert [s["sha256"] for s in two.manifest["shards"]] == [s["sha256"] for s in one.manifest["shards"]]
    alone = CachedTeacherData(one, 4, process_index=0, process_count=1)
    halves = [CachedTeacherData(two, 4, process_index=p, process_count=2) for p in (0, 1)]
    for _ in range(one.num_rows // 4 + 2):  # into the second epoch
        whole, parts = alone.next_batch(), [h.next_batch() for h in halves]
        for key, value in whole.items():
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), value, err_msg=key)


MESH_SCRIPT = """
import sys, tempfile
import numpy as np
import jax
from distill_fixtures import VOCAB, tiny_teacher
from nnx_surgery.distill import TokenBatches, make_mesh
from nnx_surgery.distill.inputs.topk_cache import CacheSettings, TeacherCache, write_cache

assert jax.device_count() == 4, jax.devices()
rng = np.random.default_rng(0)
docs = [rng.integers(3, VOCAB, size=int(n)) for n in rng.integers(5, 40, size=24)]
data = TokenBatches.from_arrays(docs, eos_id=1, bos_id=2, seq_len=16, batch_size=4, seed=3)
settings = CacheSettings(top_k=7, encoding="exact", rows_per_shard=5, batch_rows=4)
root = tempfile.mkdtemp()
for name, mesh in (("one", None), ("mesh", make_mesh("fsdp=2,tp=2"))):
    write_cache(tiny_teacher(seed=1), data, f"{root}/{name}", settings, identity={}, mesh=mesh)
one, sharded = TeacherCache.open(f"{root}/one"), TeacherCache.open(f"{root}/mesh")
rows = np.arange(one.num_rows)
a, b = one.rows(rows), sharded.rows(rows)
for key in a:
    if key == "topk_logprobs" or key == "residual":
        np.testing.assert_allclose(b[key], a[key], atol=1e-5, err_msg=key)
    else:
        np.testing.assert_array_equal(b[key], a[key], err_msg=key)
print("same", len(rows))
"""


def test_a_cache_written_on_a_mesh_holds_the_rows_and_top_k_of_one_device():
    """Written over a 2 x 2 mesh of CPU devices: the same rows, the same top-k ids, the log-probabilities to float
    rounding (a sharded matmul sums in another order). Runs in a subprocess: the device count is fixed when jax
    starts."""
    import subprocess
    import sys

    from recipe_env import with_host_devices

    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "XLA_FLAGS": with_host_devices(4), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", MESH_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "same" in done.stdout, done.stderr[-3000:]

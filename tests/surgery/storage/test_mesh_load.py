"""Loading straight onto an (fsdp=4, tp=2) mesh of 8 host CPU devices (in a subprocess: the device count is fixed
when jax starts): same logits as one device and as transformers, weights really sharded per their axes, MQA's
single KV head left unsharded on tp, and a save from the sharded model reloads identically. The files are
rewritten with data not 64-byte aligned (as 7 Hub files in 8), so every block is read, none mapped."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from hf_reference import hf_forward, make_hf_model, rewrite_unaligned, sample_ids
from recipe_env import with_host_devices

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import AxisType
    from flax import nnx
    from nnx_surgery.surgery import load_pretrained, save_pretrained
    from nnx_surgery import surgery
    import nnx_surgery.surgery.storage.host_buffers
    surgery.storage.host_buffers.HUGE_BUFFER_MIN_BYTES = 0  # per-device row blocks in mappings of their own, as large ones are

    folder, out_dir, data = sys.argv[1], sys.argv[2], np.load(sys.argv[3])
    ids = jnp.asarray(data["ids"])
    assert jax.device_count() == 8, jax.devices()
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))

    def logits_of(model):
        graphdef, state = nnx.split(model)
        forward = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids).logits)
        return np.asarray(jax.block_until_ready(forward(state, ids)))

    single = load_pretrained(folder)
    single_logits = logits_of(single)
    sharded = load_pretrained(folder, mesh=mesh)
    with jax.set_mesh(mesh):
        mesh_logits = logits_of(sharded)
    attn = sharded.layers[0].self_attn
    q, k = attn.q_proj.weight[...], attn.k_proj.weight[...]
    report = dict(
        single_vs_mesh=float(np.abs(single_logits - mesh_logits).max()),
        mesh_vs_hf=float(np.abs(mesh_logits - data["hf"]).max()),
        q_spec=list(q.sharding.spec), q_shard=list(q.addressable_shards[0].data.shape),
        q_devices=len(q.sharding.device_set),
        k_spec=list(k.sharding.spec), k_shard=list(k.addressable_shards[0].data.shape),
        o_spec=list(attn.o_proj.weight[...].sharding.spec),
        down_spec=list(sharded.layers[0].mlp.down_proj.weight[...].sharding.spec),
        embed_spec=list(sharded.embed_tokens[...].sharding.spec),
        lm_head_spec=list(sharded.lm_head[...].sharding.spec),
        q_equal=bool(np.array_equal(np.asarray(q), np.asarray(single.layers[0].self_attn.q_proj.weight[...]))),
    )
    save_pretrained(sharded, out_dir, max_shard_size="20KB")
    report["resaved_vs_single"] = float(np.abs(logits_of(load_pretrained(out_dir)) - single_logits).max())
    print("REPORT " + json.dumps(report))
""")


def test_load_onto_fsdp_tp_mesh(tmp_path):
    hf_model = make_hf_model("gemma3_text", seed=21, num_key_value_heads=1, tie_word_embeddings=False)
    folder = tmp_path / "teacher"
    hf_model.save_pretrained(folder, max_shard_size="20KB")
    assert all(start % 64 for start in rewrite_unaligned(folder))
    ids = sample_ids(2, 13)
    np.savez(tmp_path / "data.npz", ids=ids, hf=hf_forward(hf_model, ids)["logits"])
    env = dict(os.environ, XLA_FLAGS=with_host_devices(8), JAX_PLATFORMS="cpu",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(tmp_path / "resaved"),
                             str(tmp_path / "data.npz")], env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    assert report["single_vs_mesh"] <= 1e-5
    assert report["mesh_vs_hf"] <= 1e-4
    assert report["resaved_vs_single"] == 0.0  # same weights, same single-device program
    assert report["q_equal"]
    # q_proj (N=4, H=12, D=32): heads over tp, hidden over fsdp; each device holds a (2, 12, 8) block
    assert report["q_spec"] == ["tp", None, "fsdp"] and report["q_shard"] == [2, 12, 8]
    assert report["q_devices"] == 8
    # k_proj (K=1, 12, 32): one KV head cannot be split over tp=2, so only fsdp remains
    assert report["k_spec"] == [None, None, "fsdp"] and report["k_shard"] == [1, 12, 8]
    assert report["o_spec"] == ["fsdp", "tp", None]
    assert report["down_spec"] == ["fsdp", "tp"]
    assert report["embed_spec"] == ["tp", "fsdp"]
    assert report["lm_head_spec"] == ["tp", "fsdp"]

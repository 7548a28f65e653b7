"""Memory of the fused logit loss (value and gradients for the student's hidden states and head), compiled, not run.

    python bench/fused_loss_memory.py liger [--target v5p|cpu|both]   Liger-Kernel's benchmark shape: fused, two-pass
                                                                       and reference
    python bench/fused_loss_memory.py chunks [--chunks 256,1024,...]   the 7B -> 2B step's loss on a v5e-8, per chunk

`liger`: hidden 4096, vocabulary 128,256, 8,192 rows, bf16 hidden states and head, forward KL against a teacher
of the same shape; ours (`fused_logit_loss`, and `two_pass_logit_loss` in `--vocab-slice` rows per slice) against
`reference_logit_loss` on full logits, each as
`jax.value_and_grad` with respect to the student's hidden states and head, compiled for one TPU v5p chip (95 GiB;
one device of the v5p:2x2x1 topology) and for the CPU. XLA's peak is arguments + temporaries + outputs - aliased
(per device). Liger-Kernel reports FusedLinearJSD at 8.7 GB against 56.4 GB for PyTorch on this shape.

`chunks`: the logit loss of the distillation step of a Gemma 7B teacher and a gemma-2b-shaped student (8 x 2048
tokens, bf16 compute, the heads sharded as the step shards them) on the fsdp=8 mesh of a v5e-8, one compile per
chunk (rows per chunk, one chunk per block as on an accelerator): its temporaries should not grow as chunks shrink.
One JSON line per compile, then a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpu_compile  # noqa: E402
from tpu_compile import GIB, compile_memory, gib  # noqa: E402

LIGER = dict(hidden=4096, vocab=128256, rows=8192)


def loss_functions(chunk: int, block: int | None = None, vocab_slice: int | None = None,
                   two_pass_slice: int | None = None):
    """(fused, reference, two-pass): (h_s, head_s, h_t, head_t, labels, weights) -> (loss, (d h_s, d head_s)),
    forward KL."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from nnx_surgery.distill.losses.divergence import LogitLossSettings, fused_logit_loss, reference_logit_loss
    from nnx_surgery.distill.losses.two_pass import two_pass_logit_loss

    spec = LogitLossSettings(kl=True, chunk=chunk, block=block, vocab_slice=vocab_slice, unit_temperature=True)
    coeffs = {"temperature": 1.0, "kl": 1.0, "reverse_kl": 0.0, "jsd": 0.0, "ce": 0.0}
    logits = lambda h, w: jnp.einsum("...D,VD->...V", h, w.astype(h.dtype), preferred_element_type=jnp.float32)

    def fused(h_s, head_s, h_t, head_t, labels, weights):
        return fused_logit_loss(h_s, head_s, h_t, head_t, labels, weights, coeffs, student_logits=logits,
                                teacher_logits=logits, spec=spec)[0]

    def two_pass(h_s, head_s, h_t, head_t, labels, weights):
        return two_pass_logit_loss(h_s, head_s, h_t, head_t, labels, weights, coeffs, student_logits=logits,
                                   teacher_logits=logits,
                                   spec=dataclasses.replace(spec, vocab_slice=two_pass_slice))[0]

    def reference(h_s, head_s, h_t, head_t, labels, weights):
        return reference_logit_loss(logits(h_s, head_s), logits(h_t, head_t), labels, weights, coeffs, spec)[0]

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
    return grad(fused), grad(reference), grad(two_pass)


def abstract_inputs(batch, length, d_s, d_t, vocab, dtype, sharding=None, head_sharding=None, rows_sharding=None):
    import jax
    import jax.numpy as jnp

    arg = lambda shape, dt, s: jax.ShapeDtypeStruct(shape, dt, sharding=s)
    return (arg((batch, length, d_s), dtype, sharding), arg((vocab, d_s), dtype, head_sharding),
            arg((batch, length, d_t), dtype, sharding), arg((vocab, d_t), dtype, head_sharding),
            arg((batch, length), jnp.int32, rows_sharding), arg((batch, length), jnp.float32, rows_sharding))


def liger(target: str, chunk: int, vocab_slice: int) -> list[dict]:
    """Fused vs reference at Liger's shape, on `target` ("v5p" or "cpu")."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = None
    if target == "v5p":
        mesh = tpu_compile.tpu_mesh("v5p:2x2x1")
        mesh = jax.sharding.Mesh(mesh.devices[:1], mesh.axis_names, axis_types=mesh.axis_types)
        sharding = NamedSharding(mesh, PartitionSpec())
    d, vocab, rows = LIGER["hidden"], LIGER["vocab"], LIGER["rows"]
    inputs = abstract_inputs(1, rows, d, d, vocab, jnp.bfloat16, sharding, sharding, sharding)
    out = []
    fused, reference, two_pass = loss_functions(chunk, vocab_slice=32768 if target == "cpu" else None,
                                                two_pass_slice=vocab_slice)
    for name, fn in (("fused", fused), ("two_pass", two_pass), ("reference", reference)):
        figures = compile_memory(lambda: fn.lower(*inputs))
        figures.pop("compiled", None)
        out.append({"bench": "liger", "target": target, "impl": name,
                    "chunk": vocab_slice if name == "two_pass" else chunk, **figures})
        print(json.dumps(out[-1]), flush=True)
    return out


def step_loss_chunks(chunks: list[int], block: int | None) -> list[dict]:
    """The 7B -> 2B step's logit loss on a v5e-8 (fsdp=8), per chunk."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = tpu_compile.tpu_mesh("v5e:2x4")
    rows, head = NamedSharding(mesh, PartitionSpec("fsdp")), NamedSharding(mesh, PartitionSpec(None, "fsdp"))
    inputs = abstract_inputs(8, 2048, 2048, 3072, 256000, jnp.bfloat16, rows, head, rows)
    out = []
    for chunk in chunks:
        fused = loss_functions(chunk, block)[0]
        figures = compile_memory(lambda: fused.lower(*inputs))
        figures.pop("compiled", None)
        out.append({"bench": "chunks", "target": "v5e:2x4", "chunk": chunk, "block": block, **figures})
        print(json.dumps(out[-1]), flush=True)
    return out


def table(results: list[dict]) -> str:
    lines = ["| bench | target | impl | chunk | arguments GiB | temporaries GiB | outputs GiB | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        over = "" if r.get("fits", True) else " (over the chip)"
        lines.append(f"| {r['bench']} | {r['target']} | {r.get('impl', 'fused')} | {r['chunk']} | "
                     f"{gib(r.get('argument'))} | {gib(r.get('temp'))}{over} | {gib(r.get('output'))} | "
                     f"{gib(r.get('peak'))} |")
    for impl in ("fused", "two_pass"):
        ours = {r["target"]: r for r in results if r.get("impl") == impl and r.get("peak")}
        for r in results:
            if r.get("impl") == "reference" and r.get("peak") and r["target"] in ours:
                saving = 1 - ours[r["target"]]["peak"] / r["peak"]
                lines.append(f"\n{r['target']}: {impl} peak {ours[r['target']]['peak'] / GIB:.2f} GiB vs reference "
                             f"{r['peak'] / GIB:.2f} GiB: {saving:.1%} less")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", choices=("liger", "chunks"))
    parser.add_argument("--target", choices=("v5p", "cpu", "both"), default="both")
    parser.add_argument("--chunk", type=int, default=2048, help="liger: rows per chunk of the fused loss")
    parser.add_argument("--vocab-slice", type=int, default=1024,
                        help="liger: vocabulary rows per slice of the two-pass loss (the table's chunk column)")
    parser.add_argument("--chunks", default="256,512,1024,2048,4096,8192", help="chunks: rows per chunk to compile")
    parser.add_argument("--block", type=int, default=None, help="chunks: rows per block (default: one chunk)")
    args = parser.parse_args()
    if args.bench == "liger":
        targets = ("v5p", "cpu") if args.target == "both" else (args.target,)
        results = [r for target in targets for r in liger(target, args.chunk, args.vocab_slice)]
    else:
        results = step_loss_chunks([int(c) for c in args.chunks.split(",")], args.block)
    print(table(results))


if __name__ == "__main__":
    main()

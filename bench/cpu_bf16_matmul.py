"""How fast is a bfloat16 matmul on this CPU under XLA, by operand layout and result dtype?

    python bench/cpu_bf16_matmul.py                       # the demo's shapes (1,024 tokens, hidden 640)
    python bench/cpu_bf16_matmul.py --record bench/results/cpu-bf16-matmul.jsonl

A training step's matmuls come in three layouts over (tokens M, in K, out N): the forward `x @ W.T` contracts both
operands' last axes (NT), the input gradient `g @ W` is a plain product (NN), and the weight gradient `g.T @ x`
contracts both operands' first axes (TN). Each is timed in float32, in bfloat16 with a bfloat16 result (what
`einsum` of two bfloat16 operands makes), and in bfloat16 with a float32 result (`preferred_element_type`), plus
the TN product made as NN on an explicitly transposed copy. GFLOP/s, medians of `--repeats` after one warm-up.
On CPUs with bfloat16 matrix units XLA:CPU may hand some of these to a fast library and not others: this
measures which, on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LAYOUTS = {"NT": ((1,), (1,)), "NN": ((1,), (0,)), "TN": ((0,), (0,))}


def operands(layout: str, m: int, k: int, n: int, dtype):
    a_shape = (k, m) if layout == "TN" else (m, k)
    b_shape = (n, k) if layout == "NT" else (k, n)
    a = jax.random.normal(jax.random.key(0), a_shape).astype(dtype)
    return a, jax.random.normal(jax.random.key(1), b_shape).astype(dtype)


def transposed_copy(a):
    """A physical transpose that XLA does not fold back into the product's dimension numbers."""
    rows, cols = a.shape
    return jnp.reshape(jnp.swapaxes(a.reshape(rows, cols, 1), 0, 1), (cols, rows))


def measure(m: int, k: int, n: int, repeats: int) -> list[dict]:
    rows = []
    for layout, contract in LAYOUTS.items():
        dims = (contract, ((), ()))
        ways = {"float32": (jnp.float32, lambda a, b: lax.dot_general(a, b, dims)),
                "bf16 -> bf16": (jnp.bfloat16, lambda a, b: lax.dot_general(a, b, dims)),
                "bf16 -> f32": (jnp.bfloat16, lambda a, b: lax.dot_general(a, b, dims,
                                                                           preferred_element_type=jnp.float32))}
        if layout == "TN":
            ways["bf16 -> f32, transposed copy"] = (jnp.bfloat16, lambda a, b: lax.dot_general(
                transposed_copy(a), b, (LAYOUTS["NN"], ((), ())), preferred_element_type=jnp.float32))
        for way, (dtype, fn) in ways.items():
            took = common.median_seconds(jax.jit(fn), *operands(layout, m, k, n, dtype), repeats=repeats)
            rows.append({"layout": layout, "way": way, "m": m, "k": k, "n": n, "ms": round(took * 1e3, 3),
                         "gflop_per_s": round(2 * m * k * n / took / 1e9, 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1024x640x2048,1024x2048x640,1024x640x16384",
                        help="MxKxN products, comma separated (tokens x in x out)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--record", help="append one JSON line with every row")
    args = parser.parse_args()
    rows = [row for shape in args.shapes.split(",") for row in measure(*map(int, shape.split("x")), args.repeats)]
    if args.record:
        with open(args.record, "a") as handle:
            handle.write(json.dumps({"bench": "cpu_bf16_matmul", "machine": platform.machine(), "cpus": os.cpu_count(),
                                     "bf16_units": bf16_flags(), "jax": jax.__version__,
                                     "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}) + "\n")


def bf16_flags() -> list[str]:
    """The CPU's bfloat16 instruction sets (Linux), e.g. AVX512_BF16 and AMX."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), [])
    except OSError:
        return []
    return sorted(flag for flag in flags if "bf16" in flag or flag.startswith("amx"))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The GPU check, one prepared script: load throughput and distillation steps (Gemma-2-2B-shaped teacher, pruned ~1B
# student, bf16) on one NVIDIA H200 in under 8 minutes; tokens/s and MFU against 989 TFLOP/s bf16 dense.
# Without a GPU it runs the same code at tiny shapes on CPU (that is how it is tested).
#
#   bash bench/gpu.sh                    # on the GPU machine: python3 with jax/flax/optax/torch/transformers there
#   PYTHON=.venv/bin/python bash bench/gpu.sh    # here, CPU, tiny shapes (~2 minutes)
#
# Results: one JSON line per measurement on stdout and in $BENCH_OUT/gpu.jsonl (default bench/out); checkpoints
# go to $BENCH_GPU_ROOT (default bench/out/gpu-ckpt, ~7.5 GB at full scale; reused when present).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT_DIR=${BENCH_OUT:-bench/out}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
"$PYTHON" -c 'import jax; d = jax.devices()[0]; print("backend:", jax.default_backend(), d.device_kind, "x", len(jax.devices()))'
if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true; fi
exec timeout --signal=INT 470 "$PYTHON" bench/gpu_bench.py --out "$OUT_DIR/gpu.jsonl" "$@"

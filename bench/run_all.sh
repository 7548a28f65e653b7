#!/usr/bin/env bash
# All CPU benchmarks, then BENCHMARKS.md. About 30 minutes on the 2-core development machine once the synthetic
# checkpoints exist (first run: + ~3 min to write the gemma-2-2b, gemma-7b and gemma-3-270m shapes, 23 GB, + ~90 s
# to create the Tunix peer's venv, + the recipe's tiny run for the quality section).
#
#   bash bench/run_all.sh                    # everything
#   bash bench/run_all.sh load distill_270m  # only these parts; BENCHMARKS.md keeps the latest of each
#
# Parts: load prune distill_tiny distill_270m mesh quality, and on the real 270M gguf_import generate gguf_export (not by default). Heavy parts wait until 14 GiB are free.
# Results: bench/out/results.jsonl (appended, one JSON line per measurement, tagged with this run's id).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${BENCH_RESULTS:-bench/out/results.jsonl}
mkdir -p "$(dirname "$OUT")"
export BENCH_RUN=${BENCH_RUN:-$(date +%Y%m%d-%H%M%S)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TF_CPP_MIN_LOG_LEVEL=2
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(load prune distill_tiny distill_270m mesh quality)
want() { local p; for p in "${PARTS[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
stamp() { echo "[run_all $(date +%H:%M:%S)] $*" >&2; }

"$PY" bench/common.py "$OUT" >/dev/null
if want load || want distill_tiny || want distill_270m; then "$PY" bench/tunix_env.py >/dev/null; fi
if want load; then stamp load; "$PY" bench/load.py --shape gemma-2-2b --peers ours,torch,tunix \
    --repeats 2 --cache warm,cold --out "$OUT" >/dev/null; fi
if want prune; then stamp prune; "$PY" bench/prune.py --teacher-shape gemma-7b --student-shape gemma-2b \
    --readers package --package-repeats 2 --package-timeout 300 --repeats 2 --out "$OUT" >/dev/null; fi
if want distill_tiny; then stamp distill_tiny; "$PY" bench/distill_step.py --scale tiny --repeats 2 \
    --out "$OUT" >/dev/null; fi
if want distill_270m; then stamp distill_270m; "$PY" bench/distill_step.py --scale 270m --repeats 2 --warmup 2 \
    --steps 6 --min-free-gib 14 --out "$OUT" >/dev/null; fi
if want mesh; then stamp mesh; "$PY" bench/mesh.py --out "$OUT" >/dev/null; fi
if want quality; then stamp quality; "$PY" bench/quality.py --reuse --out "$OUT" >/dev/null; fi
REAL=bench/results/real-270m.jsonl  # real Gemma 3 270M: committed, rendered by report_real.py
if want gguf_import; then stamp gguf_import; "$PY" bench/gguf_import.py --peers ours,transformers \
    --out "$REAL" >/dev/null; fi
if want generate; then stamp generate; "$PY" bench/generate.py --out "$REAL" >/dev/null; fi
if want gguf_export; then stamp gguf_export; "$PY" bench/gguf_export.py --out bench/results/gguf-export.jsonl \
    >/dev/null; fi
stamp report
"$PY" bench/report.py "$OUT" > BENCHMARKS.md
stamp "wrote BENCHMARKS.md"

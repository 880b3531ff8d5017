# Two entry points, each doing all set-up on a fresh machine:
#   make demo   runs the main job on its embedded default
#   make test   runs the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install lint mutation engines engines-sglang test-sglang engines-vllm034 test-vllm034

$(BIN)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU build of torch; the package itself accepts any torch >= 2.4 for GPU users.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(BIN)/.installed

# The demo serves at a B300 pair's step rate (the modeled backbone: the GPU's step time slept, the
# fetch path real), so each 5-second point measures hundreds of steps on a 2-core machine.
DEMO_ARGS ?= --backbone modeled --gpu b300 --tp 2 --concurrency 8,32 --cache-states cold,warm --seconds 5
demo: $(BIN)/.installed
	$(BIN)/engram-offload bench $(DEMO_ARGS)

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q
	@if [ -f $(SGLANG_VENV)/.installed ]; then $(MAKE) --no-print-directory test-sglang; \
	else echo "SGLang's own Engram code not run: make engines-sglang installs it"; fi
	@if [ -f $(VLLM034_VENV)/.installed ]; then $(MAKE) --no-print-directory test-vllm034; \
	else echo "vLLM 0.34.0's own Engram code not run: make engines-vllm034 installs it"; fi

# vLLM 0.33.0's own code beside the CPU torch, so tests/integrations run the plugin against it
# (run by .ci/run; without it those tests skip). No CUDA build of torch is pulled: vLLM comes
# without its dependency closure and tools/engines-cpu.txt pins torch.
$(BIN)/.engines: $(BIN)/.installed tools/engines-cpu.txt
	$(BIN)/pip install --quiet --no-deps vllm==0.33.0
	$(BIN)/pip install --quiet -r tools/engines-cpu.txt
	touch $@

engines: $(BIN)/.engines

# vLLM 0.34.0's own code in an environment of its own (one environment holds one vLLM), built
# as .venv's: the CPU torch, vLLM without its dependency closure, tools/engines-cpu.txt (what the
# tests import of 0.34.0 needs nothing more). make test runs the vLLM test files there too when it
# exists (run by .ci/run; without it they run against 0.33.0 only). The venv ignores itself in git.
VLLM034_VENV ?= .venv-vllm034
VLLM_TESTS = tests/integrations/test_vllm_*.py
$(VLLM034_VENV)/.installed: pyproject.toml setup.py tools/engines-cpu.txt
	$(PYTHON) -m venv $(VLLM034_VENV)
	echo '*' > $(VLLM034_VENV)/.gitignore
	$(VLLM034_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM034_VENV)/bin/pip install --quiet -r tools/engines-cpu.txt
	$(VLLM034_VENV)/bin/pip install --quiet --no-deps vllm==0.34.0
	$(VLLM034_VENV)/bin/pip install --quiet -e '.[test]' -c tools/engines-cpu.txt
	touch $@

engines-vllm034: $(VLLM034_VENV)/.installed

test-vllm034: $(VLLM034_VENV)/.installed
	$(VLLM034_VENV)/bin/python -m pytest -q -p no:cacheprovider $(VLLM_TESTS)

# SGLang 0.5.23's own code in an environment of its own (tools/engines-sglang.txt says why: its
# torchvision needs torch 2.14.1, a CUDA build that runs on the CPU; several GB). make test runs
# tests/integrations' SGLang files there when it exists (run by .ci/run; without it they skip).
SGLANG_VENV ?= .venv-sglang
$(SGLANG_VENV)/.installed: pyproject.toml setup.py tools/engines-sglang.txt
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/pip install --quiet -r tools/engines-sglang.txt
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/pip install --quiet -e '.[test]' -c tools/engines-sglang.txt
	touch $@

engines-sglang: $(SGLANG_VENV)/.installed

test-sglang: $(SGLANG_VENV)/.installed
	CUDA_VISIBLE_DEVICES="" $(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		tests/integrations/test_sglang_*.py

# Lint and types over the package (run by .ci/run before the tests).
lint: $(BIN)/.installed
	$(BIN)/ruff check src
	$(BIN)/mypy

# Mutation testing of one core module against its own tests (docs/mutation.md); not in CI.
#   make mutation MODULE=serving/dedup   make mutation  (lists the modules)
MODULE ?=
WORKERS ?= 2
$(BIN)/mutmut: $(BIN)/.installed
	$(BIN)/pip install --quiet -e '.[test,dev]'

mutation: $(BIN)/mutmut
	nice -n 19 $(BIN)/python tools/mutation.py $(MODULE) --workers $(WORKERS)

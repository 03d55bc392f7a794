# Two commands do all the set-up: `make demo` runs the main job, `make test` runs the tests.
# Both create .venv (Python 3.11) and install the package with its test extra on first use.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch; on a GPU machine, install your CUDA build of torch first.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: install test demo
install: $(VENV)/.installed

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider

demo: $(VENV)/.installed
	$(BIN)/ray-attn demo

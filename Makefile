# Two entry points on a fresh clone: `make demo` and `make test`.
# The venv sees system site-packages so that a torch already installed (your CUDA build) is used
# as is; only where no torch exists is the CPU wheel torch==2.13.0 installed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/python -m pip install -q "triton==3.6.0"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/epmoe demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info

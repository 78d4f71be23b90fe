# Two entry points on a fresh clone: `make demo` and `make test`.
# The venv sees the packages of the Python that creates it (also when that Python is itself a
# venv), so a torch you already have -- your CUDA build -- is used as is; only where no torch exists
# is the CPU wheel torch==2.13.0 installed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test docs install clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PYTHON) -c "import site, sysconfig; print('\n'.join(dict.fromkeys([sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib'], *site.getsitepackages()])))" \
		> "$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_epmoe_parent_site.pth"
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -c "import sys, triton" 2>/dev/null || [ "$$(uname -s)" != Linux ] \
		|| $(BIN)/python -m pip install -q "triton==3.6.0"
	$(BIN)/python -m pip install -q --no-build-isolation -e ".[test]" 2>/dev/null \
		|| $(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/epmoe demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# The API reference, generated from the docstrings (pdoc, the `docs` extra) into build/docs/.
DOCS_OUT ?= build/docs
docs: $(STAMP)
	$(BIN)/python -c "import pdoc" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[docs]"
	$(BIN)/python -m pdoc --docformat google -o $(DOCS_OUT) $$($(BIN)/python -c \
		"import pkgutil, epmoe; print(' '.join(['epmoe'] + ['epmoe.' + m.name for m in pkgutil.iter_modules(epmoe.__path__)]))")
	@echo "API reference: $(DOCS_OUT)/index.html"

clean:
	rm -rf $(VENV) build *.egg-info

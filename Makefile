# Set-up and the two commands the README opens with. `make train` and `make test` each create
# the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup train test mutate clean

setup: $(VENV)/.installed

# torch is installed first, pinned to the CPU wheel (an unpinned torch pulls a multi-GB CUDA
# build); on a GPU machine install your CUDA build of torch==2.13.0 into the venv beforehand.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

train: setup
	$(VENV)/bin/meshlm train

test: setup
	$(PY) -m pytest

# Mutation testing of the core maths (docs/testing.md): minutes per module, not part of `make test`.
mutate: setup
	$(PY) -m pip install -q -e '.[mutate]'
	$(PY) tools/mutate.py $(MODULES)

clean:
	rm -rf $(VENV) runs .pytest_cache

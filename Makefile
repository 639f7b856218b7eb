# zpath: `make run` trains a small transformer pipelined over the hosts of a local cluster it
# starts; `make demo` runs the Figure-2 program; `make test` runs the tests.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run demo test test-fast bench install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) examples/transformer/train.py

demo: $(STAMP)
	$(PY) examples/demo.py

# the tests in TEST_WORKERS processes (pytest-xdist), each taking whole modules, so
# that a module's cluster starts once; tests/conftest.py orders the slowest first
# (`make test TEST_WORKERS=0`: all in one process)
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

bench: $(STAMP)
	$(PY) benchmarks/opbyop.py

clean:
	rm -rf $(VENV) build *.egg-info

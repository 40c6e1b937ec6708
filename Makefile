# The two commands a fresh machine needs: `make run` and `make test`.
# make run installs the base package only (`-e .`: all python -m cluster --task linear imports); make test,
# make bench and make venv install the test extras (`-e '.[test]'`: pytest, torch, playwright, ...).
VENV ?= .venv
PY := $(VENV)/bin/python
BASE_STAMP := $(VENV)/.installed-base
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test lint-imports bench venv docs clean

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(BASE_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $(BASE_STAMP)

# the test install includes the base: after it, make run installs nothing more
$(TEST_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $(TEST_STAMP) $(BASE_STAMP)

venv: $(TEST_STAMP)

# RUN_ARGS: more options of python -m cluster, e.g. make run RUN_ARGS=--keep-logs
run: $(BASE_STAMP)
	$(PY) -m cluster --workers 4 --task linear $(RUN_ARGS)

# The last section of the output, "degraded checks", lists what ran degraded or was skipped for want of
# promtool, Chromium or Docker (tests/conftest.py). TEST_PROCESSES: pytest-xdist processes running the tests (most
# tests wait on real processes, sockets and containers; those that share one resource run in one process, in turn).
# --no-loadscope-reorder: the files go out in tests/conftest.py's order, the slowest first (its docstring: Order).
TEST_PROCESSES ?= 2
test: $(TEST_STAMP)
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint-imports: $(TEST_STAMP)
	$(VENV)/bin/lint-imports

bench: $(TEST_STAMP)
	$(PY) -m bench.table

# the documentation site (mkdocs.yml) into site/ (git-ignored); --strict: a broken link or a page off the nav fails
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache build site *.egg-info

# The two commands a fresh machine needs: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench venv clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# RUN_ARGS: more options of python -m cluster, e.g. make run RUN_ARGS=--keep-logs
run: $(STAMP)
	$(PY) -m cluster --workers 4 --task linear $(RUN_ARGS)

# The last section of the output, "degraded checks", lists what ran degraded or was skipped for want of
# promtool, Chromium or Docker (tests/conftest.py).
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench.table

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

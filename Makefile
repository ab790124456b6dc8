# Two commands on a fresh machine: `make dev` (Dagster UI with the examples) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: dev test test-multihost lint install clean

$(BIN)/cmb-dagster: pyproject.toml
	@echo "installing cmb_dagster and Dagster into $(VENV) (about a minute the first time)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/cmb-dagster

dev: install
	$(BIN)/cmb-dagster dev $(DEV_ARGS)

# The suite in parallel processes (pytest-xdist): most tests wait on Postgres, worker processes or `dagster dev`, so
# more processes than cores. Each process is handed its next test as it finishes one, the longest first
# (tests/conftest.py orders them).
TEST_PROCESSES ?= 4

test: install
	$(BIN)/pytest -q -n $(TEST_PROCESSES) --dist load --maxschedchunk 1

# The slower job run before each release (as root, with Debian's PostgreSQL 15 and iproute2): worker processes
# against servers of their own, through a failover, a network partition and a stopped process.
test-multihost: install
	CMB_MULTIHOST=1 $(BIN)/pytest -q tests/acceptance/test_multihost_failover.py tests/acceptance/test_multihost_zombie.py \
		tests/acceptance/test_multihost_partition.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	-$(BIN)/cmb-dagster db stop
	rm -rf $(VENV) .cmb

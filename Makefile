# Each target creates .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test format test-fast compose-test bench protos clean

$(BIN)/swarmpipe: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(BIN)/swarmpipe

setup: $(BIN)/swarmpipe

demo: setup
	$(BIN)/swarmpipe demo

# Lint and format check first (ruff, configured in pyproject.toml), then every tier this machine can run: unit and
# integration two files at a time (a file goes whole to a worker, so a module's shared swarm starts once), then the
# fault tier two scenarios at a time, its longest first (tests/fault/conftest.py). Roles start warm from a fork
# server per worker (tests/conftest.py, swarmpipe/cli/warm_start.py). Measured on the 2-core machine: 13.6 min
# (8.9 + 4.7, 1,459 + 16 tests); at -n 3 the integration tier took the same (9.0 min, both cores 99 % busy): CPU is the limit.
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest tests -m "not compose" --ignore=tests/fault -q -n 2 --dist loadfile --durations=15
	$(BIN)/python -m pytest tests/fault -m "not compose" -q -n 2 --durations=10

# The unit tier alone (no sockets): the edit loop's check, under two minutes.
test-fast: setup
	$(BIN)/python -m pytest tests/unit -q -n 2 --dist loadfile

# Apply ruff's fixes and formatting.
format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# COMPOSE_ARGS narrows the scenarios, e.g. COMPOSE_ARGS='-k "not nemesis"'
compose-test: setup
	$(BIN)/python -m pytest tests/compose -m compose -q -s $(COMPOSE_ARGS)

bench: setup
	$(BIN)/python bench/convergence.py

# Regenerate protos/swarm_pb2*.py from protos/swarm.proto (tests fail when they drift).
# The proto is compiled under its installed path (swarmpipe/protos/), so the generated code imports
# `swarmpipe.protos.swarm_pb2`.
protos: setup
	rm -rf build/protos && mkdir -p build/protos
	$(BIN)/python -m grpc_tools.protoc -Iswarmpipe/protos=protos --python_out=build/protos --pyi_out=build/protos \
		--grpc_python_out=build/protos swarmpipe/protos/swarm.proto
	cp build/protos/swarmpipe/protos/swarm_pb2.py build/protos/swarmpipe/protos/swarm_pb2.pyi \
		build/protos/swarmpipe/protos/swarm_pb2_grpc.py protos/

clean:
	rm -rf $(VENV) runs .pytest_cache

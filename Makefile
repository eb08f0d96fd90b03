# Each target creates .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TEST_WORKERS ?= 4

.PHONY: setup demo test format test-fast compose-test bench protos clean

$(BIN)/swarmpipe: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(BIN)/swarmpipe

setup: $(BIN)/swarmpipe

demo: setup
	$(BIN)/swarmpipe demo

# Lint and format check first (ruff, configured in pyproject.toml), then every tier this machine can run, in one
# pytest run of four workers: the integration and fault tiers wait on real processes (start-up, DHT rounds,
# fixed-length trainer runs) far more than they compute, so four share the two cores well. Files go whole to a
# worker (a module's shared swarm is started once), the longest first (tests/conftest.py orders them).
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest tests -m "not compose" -q -n $(TEST_WORKERS) --dist loadfile --durations=20

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

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

# Lint and format check first (ruff, configured in pyproject.toml), then every tier this machine can run.
# The fault tier runs two scenarios at a time (pytest-xdist): its trainers run for a fixed time, so it waits
# more than it computes (9.5 min instead of 13.5 here, every scenario passing under the shared cores).
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest tests -m "not compose" --ignore=tests/fault -q --durations=15
	$(BIN)/python -m pytest tests/fault -m "not compose" -q -n 2 --durations=10

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

"""swarmpipe: train one neural network as an asynchronous pipeline on a swarm of volunteer computers.

Installed, the project is this one import name. Its parts live at the repository root and are mapped
here by setuptools (``[tool.setuptools.package-dir]`` in pyproject.toml):

* ``swarmpipe.peer`` (``peer/``): the library every participant runs: transport, swarm, stage, trainer,
  model, optim;
* ``swarmpipe.coordinator`` (``coordinator/``): bootstrap node, checkpoints, dashboard, metrics;
* ``swarmpipe.protos`` (``protos/``): the wire protocol and its generated modules;
* ``swarmpipe.cli`` (this folder): the ``swarmpipe`` command, which starts every role and so is the only
  package that may import all of them.

Imports point down: cli -> coordinator -> peer -> protos (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("swarmpipe")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

"""Unit-test fixtures: one torch thread (the machine is shared)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    torch.set_num_threads(1)
    yield

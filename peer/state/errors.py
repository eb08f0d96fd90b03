"""Errors of state transfer, shared by the state format (state.py) and its signatures (state_signing.py)."""

from __future__ import annotations


class StateError(ValueError):
    """A state that does not fit this stage, or a transfer that ended early."""


class MixedState(StateError):
    """Shards of different snapshots, or weights that do not hash to their announced digest."""

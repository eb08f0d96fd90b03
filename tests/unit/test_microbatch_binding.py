"""A forward belongs to the caller that opened it: its key carries the caller and a digest of its ticket, and a
flood from one caller evicts that caller's own forwards, never another's."""

from __future__ import annotations

import grpc
import pytest
import torch

from swarmpipe.peer.spec import load_spec
from swarmpipe.peer.stage.request_checks import RequestError, pending_key
from swarmpipe.peer.stage.runtime import StageRuntime, UnknownMicrobatch

pytestmark = pytest.mark.unit

TICKET = b"t" * 16


def test_the_key_binds_caller_and_ticket() -> None:
    mine = pending_key("10.0.0.1", "mb-7", TICKET)
    assert pending_key("10.0.0.1", "mb-7", TICKET) == mine  # a retry of the same caller reaches it
    assert pending_key("10.0.0.1", "mb-7", b"x" * 16) != mine  # someone who only knows the id does not
    assert pending_key("10.0.0.1", "mb-7", b"") != mine
    assert pending_key("10.0.0.2", "mb-7", TICKET) != mine  # nor the same ticket from elsewhere
    assert TICKET.hex() not in mine and "74747474" not in mine  # the secret itself is never stored or logged


@pytest.mark.parametrize("ticket", [b"short", b"x" * 65])
def test_tickets_are_bounded(ticket: bytes) -> None:
    with pytest.raises(RequestError) as info:
        pending_key("10.0.0.1", "mb", ticket)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def _runtime(max_pending: int) -> StageRuntime:
    spec = load_spec(num_stages=2, model={"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 8})
    return StageRuntime(spec, 0, max_pending=max_pending)


def test_a_flood_evicts_the_flooders_own_forwards_first() -> None:
    rt = _runtime(max_pending=8)
    tokens = torch.randint(0, 256, (1, 8))
    honest = pending_key("10.0.0.1", "honest", TICKET)
    out = rt.forward(honest, tokens)
    for i in range(300):  # 300 tiny anonymous forwards from one other caller
        rt.forward(pending_key("10.6.6.6", f"junk-{i}", b""), tokens)
    assert len(rt.pending) == 8 and honest in rt.pending
    assert rt.backward(honest, torch.ones_like(out)).applied
    with pytest.raises(UnknownMicrobatch):  # and the flooder's oldest are gone
        rt.backward(pending_key("10.6.6.6", "junk-0", b""), torch.ones_like(out))


def test_when_callers_hold_equal_shares_the_oldest_goes() -> None:
    rt = _runtime(max_pending=2)
    tokens = torch.randint(0, 256, (1, 8))
    a, b, c = (pending_key(f"10.0.0.{i}", "m", TICKET) for i in (1, 2, 3))
    for key in (a, b, c):
        rt.forward(key, tokens)
    assert list(rt.pending) == [b, c]

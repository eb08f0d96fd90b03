"""Request validation of the stage server (peer/stage/request_checks.py): the new logits bound of an
evaluate Forward on the last stage, checked before any work."""

from __future__ import annotations

import grpc
import pytest
import torch

from swarmpipe.peer.spec import spec_from_dict
from swarmpipe.peer.stage.request_checks import RequestError, check_logits_size

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_logits_within_the_tensor_bound_pass_and_beyond_it_are_refused():
    spec = spec_from_dict({"model": {"vocab_size": 1000}, "limits": {"max_tensor_elements": 64_000}})
    check_logits_size(spec, torch.zeros(2, 32, 128))  # 2 x 32 x 1000 = 64,000 logits: at the bound
    with pytest.raises(RequestError) as refused:
        check_logits_size(spec, torch.zeros(2, 33, 128))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "66000 logits exceed max_tensor_elements 64000" in str(refused.value)


def test_a_request_carries_at_most_two_micro_batches_of_rows():
    """An oversized batch (2048 rows of a 16-row run) is refused before it costs compute or memory."""
    from swarmpipe.peer.stage.request_checks import decode_stage_input
    from swarmpipe.peer.transport.wire import WireError, encode

    spec = spec_from_dict({"microbatch_size": 16, "model": {"seq_len": 32}})
    assert decode_stage_input(spec, True, encode(torch.zeros(32, 32, dtype=torch.int64))).shape == (32, 32)
    with pytest.raises(WireError, match="2048 rows, more than 32"):
        decode_stage_input(spec, True, encode(torch.zeros(2048, 32, dtype=torch.int64)))

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

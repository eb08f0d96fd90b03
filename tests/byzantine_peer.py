"""A Byzantine stage peer, for tests only: an honest peer process whose answers to training calls are corrupted.

Run as a LocalSwarm ``prefix``: ``python tests/byzantine_peer.py MODE -- <the usual peer command>``. The peer
joins, loads state, averages and announces like any other; only the tensors it returns from training calls
(a Forward's output, a Backward's or ForwardBackward's input gradient; in a chain, the output it passes on or parks, and the
input gradient it returns) are corrupted, so forward-only calls
(validation, a second opinion, verification probes) get honest answers, as a careful attacker would give.

MODE: ``noise`` (adds Gaussian noise as large as the tensor), ``flip`` (negates it), ``scale`` (x10).

In a container (the Compose suite): mount this file as ``sitecustomize.py`` on ``PYTHONPATH`` and set
``SWARMPIPE_TEST_BYZANTINE=MODE``; every Python process there then starts patched.
"""

from __future__ import annotations

import contextvars
import os
import sys

import torch

CORRUPTIONS = {
    "noise": lambda t: t + t.float().pow(2).mean().sqrt() * torch.randn_like(t.float()),
    "flip": lambda t: -t,
    "scale": lambda t: 10.0 * t,
}
_training = contextvars.ContextVar("training", default=False)


def install(mode: str) -> None:
    from swarmpipe.peer.stage.chain.service import ChainService
    from swarmpipe.peer.stage.server import StageServicer
    from swarmpipe.peer.stage.service.core import ServingCore

    corrupt = CORRUPTIONS[mode]
    encode = ServingCore.encode

    def lying_encode(self, t, codec, sink=None, field=""):
        if _training.get() and field in ("output", "grad_input"):
            t = corrupt(t).to(t.dtype)
        return encode(self, t, codec, sink, field)

    def marking(method, is_training):
        async def wrapped(self, request, context, sink=None):
            token = _training.set(is_training(request))
            try:
                return await method(self, request, context, sink)
            finally:
                _training.reset(token)

        return wrapped

    call_next = ChainService._call_next

    async def lying_call_next(self, request, out, *rest):
        return await call_next(self, request, corrupt(out).to(out.dtype), *rest)

    ServingCore.encode = lying_encode  # every reply tensor of every service is encoded here
    ChainService._call_next = lying_call_next  # a chained output goes straight to the next stage: lie there too
    park = ChainService._park

    async def lying_park(self, request, out, *rest):
        return await park(self, request, corrupt(out).to(out.dtype), *rest)

    ChainService._park = lying_park  # and the output a chain parks for the trainer to carry on
    # The servicer's RPCs (what grpc and Stream call): a chain's input gradient, and training calls' tensors
    StageServicer.Chain = marking(StageServicer.Chain, lambda r: True)
    StageServicer.Forward = marking(StageServicer.Forward, lambda r: not r.evaluate)
    StageServicer.ForwardBackward = marking(StageServicer.ForwardBackward, lambda r: not r.evaluate)
    StageServicer.Backward = marking(StageServicer.Backward, lambda r: True)


def main(argv: list[str]) -> int:
    mode, rest = argv[0], argv[argv.index("--") + 1 :]
    # rest: <python> -m swarmpipe.cli.main peer ...: run that entry point here, patched
    args = rest[rest.index("swarmpipe.cli.main") + 1 :]
    install(mode)
    from swarmpipe.cli.main import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
elif __name__ == "sitecustomize" and os.environ.get("SWARMPIPE_TEST_BYZANTINE"):
    install(os.environ["SWARMPIPE_TEST_BYZANTINE"])

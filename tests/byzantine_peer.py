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
    from swarmpipe.peer.stage import server

    corrupt = CORRUPTIONS[mode]
    servicer = server.StageServicer
    encode = servicer._encode

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

    chain_next = servicer._chain_next

    async def lying_chain_next(self, request, out, *rest):
        return await chain_next(self, request, corrupt(out).to(out.dtype), *rest)

    servicer._encode = lying_encode
    servicer._chain_next = lying_chain_next  # a chained output goes straight to the next stage: lie there too
    park = servicer._chain_park

    async def lying_chain_park(self, request, out, *rest):
        return await park(self, request, corrupt(out).to(out.dtype), *rest)

    servicer._chain_park = lying_chain_park  # and the output a chain parks for the trainer to carry on
    servicer.Chain = marking(servicer.Chain, lambda r: True)  # and on the input gradient a chain returns
    servicer.Forward = marking(servicer.Forward, lambda r: not r.evaluate)
    servicer.ForwardBackward = marking(servicer.ForwardBackward, lambda r: not r.evaluate)
    servicer.Backward = marking(servicer.Backward, lambda r: True)


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

"""A Byzantine replica for replica averaging, for tests only: an honest peer whose served weights are scaled.

Run as a LocalSwarm ``prefix``: ``python tests/byzantine_weights_peer.py SCALE -- <the usual peer command>``.
The peer joins, trains, averages and answers training calls honestly; only the weights it serves to a sibling's
averaging round (a params-only pull) are its own times SCALE, signed with its real key and hashed correctly, as a
careful attacker would send them. (A joiner's full-state download is left honest: that path is not what this
liar attacks.) The patch lives in this process only.
"""

from __future__ import annotations

import sys


def install(scale: float) -> None:
    from swarmpipe.peer.stage.weights import StageWeights

    export = StageWeights.export_params

    def lying(self):
        state = export(self)
        state.tensors = {k: v * scale for k, v in state.tensors.items()}
        state._digests.clear()  # the digest it announces is over what it sends
        return state

    StageWeights.export_params = lying


def main(argv: list[str]) -> int:
    scale, rest = float(argv[0]), argv[argv.index("--") + 1 :]
    # rest: <python> -m swarmpipe.cli.main peer ...: run that entry point here, patched
    args = rest[rest.index("swarmpipe.cli.main") + 1 :]
    install(scale)
    from swarmpipe.cli.main import main as cli_main

    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

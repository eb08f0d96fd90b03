#!/usr/bin/env python3
"""Delay packets in user space: a stand-in for ``tc qdisc ... netem delay`` on kernels without sch_netem.

An iptables rule sends packets to NFQUEUE ``--queue``; this program holds each
one for ``delay +- jitter`` milliseconds (uniform) and then accepts it.
Packets leave in the order they came (a late packet never overtakes an early
one, so TCP sees delay, not reordering). Pure standard library: it speaks
nfnetlink_queue over a raw netlink socket, so the image needs no compiler and
no libnetfilter_queue. Needs CAP_NET_ADMIN (run as root in the container).

    nfq_delay.py --queue 7 --delay 100 --jitter 20 [--ready-file F]

``swarmpipe-netem delay 100ms 20ms`` starts it and inserts the rule with
``--queue-bypass``, so traffic flows undelayed if this program dies.
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLMSG_ERROR = 2
NLMSG_DONE = 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_CFG_CMD_UNBIND = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQA_CFG_F_FAIL_OPEN = 0x1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NF_ACCEPT = 1
AF_UNSPEC = 0

NLMSGHDR = struct.Struct("=IHHII")
NFGENMSG = struct.Struct("=BBH")  # family, version, res_id (res_id is big endian: packed by hand)
NLATTR = struct.Struct("=HH")


def _attr(kind: int, payload: bytes) -> bytes:
    length = NLATTR.size + len(payload)
    return NLATTR.pack(length, kind) + payload + b"\0" * ((4 - length % 4) % 4)


class NfQueue:
    def __init__(self, queue: int, maxlen: int = 20000):
        self.queue = queue
        self.seq = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind((0, 0))
        self._config(_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, AF_UNSPEC)))
        self._config(_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)))
        self._config(_attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen)))
        self._config(
            _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN))
            + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN))
        )

    def _message(self, msg_type: int, flags: int, body: bytes) -> bytes:
        self.seq += 1
        payload = struct.pack("=BB", AF_UNSPEC, 0) + struct.pack("!H", self.queue) + body
        return (
            NLMSGHDR.pack(NLMSGHDR.size + len(payload), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, self.seq, 0)
            + payload
        )

    def _config(self, attrs: bytes) -> None:
        self.sock.send(self._message(NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, attrs))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            data = self.sock.recv(65536)
            for msg_type, _, seq, payload in self._parse(data):
                if msg_type == NLMSG_ERROR and seq == self.seq:
                    code = struct.unpack_from("=i", payload)[0]
                    if code:
                        raise OSError(-code, f"nfqueue config failed: {os.strerror(-code)}")
                    return
        raise TimeoutError("no answer from nfnetlink_queue")

    @staticmethod
    def _parse(data: bytes):
        offset = 0
        while offset + NLMSGHDR.size <= len(data):
            length, msg_type, flags, seq, _ = NLMSGHDR.unpack_from(data, offset)
            if length < NLMSGHDR.size:
                break
            yield msg_type, flags, seq, data[offset + NLMSGHDR.size : offset + length]
            offset += (length + 3) & ~3

    def packets(self, data: bytes):
        """Packet ids in one datagram from the kernel."""
        for msg_type, _, _, payload in self._parse(data):
            if msg_type != (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                continue
            offset = NFGENMSG.size
            while offset + NLATTR.size <= len(payload):
                length, kind = NLATTR.unpack_from(payload, offset)
                if length < NLATTR.size:
                    break
                if kind & 0x7FFF == NFQA_PACKET_HDR:
                    yield struct.unpack_from("!I", payload, offset + NLATTR.size)[0]
                    break
                offset += (length + 3) & ~3

    def accept_upto(self, packet_id: int) -> None:
        """Accept every queued packet with an id up to ``packet_id`` (ids grow in arrival order)."""
        body = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))
        self.sock.send(self._message(NFQNL_MSG_VERDICT_BATCH, NLM_F_REQUEST, body))

    def close(self) -> None:
        try:
            self.sock.send(
                self._message(
                    NFQNL_MSG_CONFIG,
                    NLM_F_REQUEST,
                    _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_UNBIND, AF_UNSPEC)),
                )
            )
        except OSError:
            pass
        self.sock.close()


def run(queue: int, delay_ms: float, jitter_ms: float, ready_file: str, seed: int | None) -> int:
    rng = random.Random(seed)
    nfq = NfQueue(queue)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(str(os.getpid()))
    print(f"nfq_delay: queue {queue}, delay {delay_ms} ms +- {jitter_ms} ms", flush=True)
    held: collections.deque[tuple[float, int]] = collections.deque()
    last_release = 0.0
    released = 0
    while not stop:
        now = time.monotonic()
        upto = None
        while held and held[0][0] <= now:
            upto = held.popleft()[1]
            released += 1
        if upto is not None:
            nfq.accept_upto(upto)
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        try:
            readable, _, _ = select.select([nfq.sock], [], [], timeout)
        except InterruptedError:
            continue
        if not readable:
            continue
        try:
            data = nfq.sock.recv(1 << 16)
        except OSError as e:
            if e.errno == errno.ENOBUFS:  # the kernel dropped messages; fail-open keeps traffic going
                continue
            raise
        arrived = time.monotonic()
        for packet_id in nfq.packets(data):
            release = arrived + max(0.0, delay_ms + rng.uniform(-jitter_ms, jitter_ms)) / 1000.0
            last_release = max(last_release, release)  # keep order: no packet overtakes another
            held.append((last_release, packet_id))
    if held:
        nfq.accept_upto(held[-1][1])
    nfq.close()
    print(f"nfq_delay: stopped after {released} packets", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, default=7)
    parser.add_argument("--delay", type=float, required=True, help="milliseconds")
    parser.add_argument("--jitter", type=float, default=0.0, help="milliseconds, uniform +-")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ready-file", default="", help="write our pid here once bound to the queue")
    args = parser.parse_args(argv)
    try:
        return run(args.queue, args.delay, args.jitter, args.ready_file, args.seed)
    except OSError as e:
        print(
            f"nfq_delay: {e} (needs CAP_NET_ADMIN: run as root in a container with cap_add NET_ADMIN)", file=sys.stderr
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())

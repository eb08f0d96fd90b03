"""Signed state shards: a donor vouches for what it sends, and a receiver knows who sent it.

Every state stream (a joiner's ``DownloadState`` shard, a drain's ``PushState``, a checkpoint the coordinator
serves) starts with a JSON metadata chunk. The sender adds to it the hash of the tensor chunks that follow, the
purpose (``download`` or ``push``), the time, its public key, and a signature over all of it with its identity key
(the key behind its peer id, :mod:`swarmpipe.peer.swarm.identity`). The receiver hashes the chunks as they arrive,
checks the signature and the clock, and learns the sender's peer id, which its caller then checks against the
swarm: a shard must come from the peer that announced the address it was fetched from, a pushed state from a
replica announced on the same stage. A state tampered with on the way, replayed much later, or sent for another
purpose is refused before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from typing import Any

from hivemind.utils.crypto import RSAPublicKey

from swarmpipe.peer.state.errors import StateError
from swarmpipe.peer.swarm.identity import Identity, peer_id_of
from swarmpipe.protos import swarm_pb2

PURPOSES = ("download", "push")
MAX_CLOCK_SKEW_S = 300.0  # a signature older (or newer) than this is refused: no replay of a captured push
SIGNATURE_FIELDS = ("purpose", "signed_at", "chunk_hash", "signer", "signature")
MAX_SIGNATURE_CHARS = 2048


class ChunkHasher:
    """The sha256 of a stream's tensor chunks, fed as they arrive (no copy of the stream is kept for it)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def add(self, chunk: swarm_pb2.StateChunk) -> None:
        self._h.update(chunk.SerializeToString(deterministic=True))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def chunks_hash(chunks: Iterable[swarm_pb2.StateChunk]) -> str:
    hasher = ChunkHasher()
    for chunk in chunks:
        hasher.add(chunk)
    return hasher.hexdigest()


def _canonical(meta: dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in meta.items() if k != "signature"}, sort_keys=True).encode()


def sign_meta(meta: dict[str, Any], chunk_hash: str, identity: Identity, purpose: str) -> dict[str, Any]:
    """``meta`` plus what proves who sent the shard and that it is whole."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown state purpose {purpose!r}")
    signed = {k: v for k, v in meta.items() if k not in SIGNATURE_FIELDS and k != "signed_by"}
    signed.update(
        purpose=purpose,
        signed_at=time.time(),
        chunk_hash=chunk_hash,
        signer=identity.key.get_public_key().to_bytes().decode(),
    )
    signed["signature"] = identity.key.sign(_canonical(signed)).decode()
    return signed


def verify_meta(meta: dict[str, Any], chunk_hash: str, purpose: str, now: float | None = None) -> str:
    """The peer id that signed this shard; :class:`StateError` when the signature does not hold."""
    signature, signer = meta.get("signature"), meta.get("signer")
    if not isinstance(signature, str) or not isinstance(signer, str):
        raise StateError("the state is not signed by its sender (an older peer, or a stranger)")
    if len(signature) > MAX_SIGNATURE_CHARS:
        raise StateError("the state's signature is oversized")
    if meta.get("purpose") != purpose:
        raise StateError(f"the state was signed for {str(meta.get('purpose'))[:16]!r}, not for {purpose!r}")
    if meta.get("chunk_hash") != chunk_hash:
        raise StateError("the state's tensors are not the ones its sender signed (tampered or mixed)")
    signed_at = meta.get("signed_at")
    now = time.time() if now is None else now
    if not isinstance(signed_at, (int, float)) or abs(now - float(signed_at)) > MAX_CLOCK_SKEW_S:
        raise StateError(f"the state's signature is stale or from the future (more than {MAX_CLOCK_SKEW_S:.0f} s off)")
    peer_id = peer_id_of(signer.encode())
    if peer_id is None:
        raise StateError("the state's signer is not an RSA public key")
    if not RSAPublicKey.from_bytes(signer.encode()).verify(_canonical(meta), signature.encode()):
        raise StateError(f"the state's signature does not verify for peer {peer_id[-6:]}")
    return peer_id


def unsigned(meta: dict[str, Any]) -> dict[str, Any]:
    """The metadata without the signature fields (what is stored and re-served)."""
    return {k: v for k, v in meta.items() if k not in SIGNATURE_FIELDS}

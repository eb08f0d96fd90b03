"""Who may take part in a private swarm: a shared token or an allow-list of peer ids, in the DHT and on every RPC.

Off by default (an open swarm). One process has one :class:`SwarmAccess`, read from its flags
(``--auth-token`` / ``--auth-token-file`` / ``SWARMPIPE_AUTH_TOKEN``, or ``--allow-peers FILE``; ``--tls``,
``--tls-cert``, ``--tls-key``; ``--identity``) and installed by the role's start (:func:`install_access`);
:func:`~swarmpipe.peer.swarm.dht.start_dht` turns it, with the process's identity, into the
:class:`~swarmpipe.peer.transport.security.Security` its channels and servers use.

In the DHT (:class:`RecordAdmission`, checked by :class:`~swarmpipe.peer.swarm.record_validator.RunRecordValidator`
on every node and again by readers): a stage or trainer record, or an entry in the runs index, counts only if
its signer is on the allow-list (the run's coordinators always are), or, with a token, if it carries ``auth``:
an HMAC under a key derived from the token over the record's key and the signer's peer id. A stranger who finds
the DHT can read it but cannot announce itself, and it cannot reuse a member's proof (it names that member, whose
key it does not hold). hivemind 1.1.12's p2pd has no libp2p private-network (PSK) option, so the DHT's
transport itself stays open: this is enforced per record instead.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPublicKey

from swarmpipe.peer.swarm.identity import Identity, peer_id_of, split_signed_subkey
from swarmpipe.peer.transport.auth import (
    Credentials,
    KeyCheck,
    KeyMinter,
    TokenCheck,
    TokenMinter,
    Verifier,
    derive_key,
)
from swarmpipe.peer.transport.security import Security
from swarmpipe.peer.transport.tls import generate_cert, load_cert

log = logging.getLogger("swarmpipe.access")
PROOF_FIELD = "auth"  # the token proof inside a member record's value (records ignore unknown fields)
MAX_ALLOW_LIST_BYTES = 1 << 20
MAX_ALLOWED = 10_000
_DHT_PROOF = b"swarmpipe-dht-v1"


@dataclass(frozen=True)
class RecordAdmission:
    """Which member records the run admits. Plain fields: it travels into hivemind's DHT process."""

    dht_key: bytes = b""  # token mode: the HMAC key of record proofs
    allowed: frozenset[str] | None = None  # allow-list mode: the admitted signers (coordinators included)

    @property
    def active(self) -> bool:
        return bool(self.dht_key) or self.allowed is not None

    def proof(self, key_id: bytes, signer: str) -> str:
        """What a record stored under ``key_id`` (the DHT's hash of the key) by ``signer`` must carry."""
        mac = hmac.new(self.dht_key, _DHT_PROOF + b"\n" + key_id + b"\n" + signer.encode(), hashlib.sha256)
        return base64.urlsafe_b64encode(mac.digest()).decode()

    def problem(self, key_id: bytes, signer: str, value: Any) -> str:
        """Why a record signed by ``signer`` is not admitted ('' when it is)."""
        if self.allowed is not None and signer not in self.allowed:
            return f"signer {signer[-6:]} is not on the allow-list"
        if self.dht_key:
            proof = value.get(PROOF_FIELD) if isinstance(value, dict) else None
            if not isinstance(proof, str) or not hmac.compare_digest(
                proof.encode(), self.proof(key_id, signer).encode()
            ):
                return f"signer {signer[-6:]} shows no proof of the swarm's token"
        return ""


@lru_cache(maxsize=1024)
def key_id(key: str) -> bytes:
    """The DHT's id of ``key``, which is all a DHT node's validator sees of it."""
    return DHTID.generate(source=key).to_bytes()


def admitted(admission: RecordAdmission, key: str, found: Any) -> Any:
    """A reader's check: ``found`` (``dht.get(key, latest=True)`` of a subkeyed key) without the subkeys the
    swarm does not admit. A lying or unprotected DHT node may answer with records honest nodes refused."""
    if not admission.active or found is None or not isinstance(found.value, dict):
        return found
    kid = key_id(key)
    kept = {}
    for subkey, item in found.value.items():
        signed = split_signed_subkey(subkey)
        if signed is not None and not admission.problem(kid, signed[1], getattr(item, "value", None)):
            kept[subkey] = item
    return type(found)(kept, found.expiration_time)


@dataclass(frozen=True)
class SwarmAccess:
    """A process's access settings; the default is an open swarm."""

    token: bytes = field(default=b"", repr=False)
    allowed: frozenset[str] | None = None
    tls: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    identity_path: str = ""

    def __post_init__(self) -> None:
        if self.token and self.allowed is not None:
            raise ValueError("choose one of --auth-token and --allow-peers")
        if self.token:
            derive_key(self.token, "rpc")  # refuses a short token now, not at the first call
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")

    @property
    def mode(self) -> str:
        return "token" if self.token else "allow-list" if self.allowed is not None else "open"

    @property
    def active(self) -> bool:
        return self.mode != "open" or self.tls

    @classmethod
    def from_config(cls, cfg: Any) -> SwarmAccess:
        """From any role's config; fields a config lacks count as unset."""
        token = read_token(getattr(cfg, "auth_token", ""), getattr(cfg, "auth_token_file", ""))
        allow_file = getattr(cfg, "allow_peers", "")
        cert, key = getattr(cfg, "tls_cert", ""), getattr(cfg, "tls_key", "")
        return cls(
            token=token,
            allowed=read_allow_list(allow_file) if allow_file else None,
            tls=bool(getattr(cfg, "tls", False) or cert),
            tls_cert=cert,
            tls_key=key,
            identity_path=getattr(cfg, "identity", ""),
        )

    def admission(self, coordinators: frozenset[str]) -> RecordAdmission:
        dht_key = derive_key(self.token, "dht") if self.token else b""
        allowed = self.allowed | coordinators if self.allowed is not None else None
        return RecordAdmission(dht_key=dht_key, allowed=allowed)

    def security(self, identity: Identity, coordinators: frozenset[str]) -> Security:
        """The gRPC side: credentials signed or keyed for this process, the check its servers make, its
        certificate (a fresh one unless ``--tls-cert``)."""
        credentials = verifier = None
        if self.token:
            credentials = token_credentials(self.token)
            verifier = Verifier(TokenCheck(derive_key(self.token, "rpc")))
        elif self.allowed is not None:
            members = self.allowed | coordinators
            if identity.peer_id not in members:
                log.warning(
                    "access: this process's peer id %s is not on --allow-peers: members will refuse its records and "
                    "calls (run with --identity FILE holding a listed key)",
                    identity.peer_id,
                )
            credentials = key_credentials(identity)
            verifier = Verifier(KeyCheck(lambda: members, peer_id_of, verify_signature))
        cert = None
        if self.tls:
            cert = load_cert(self.tls_cert, self.tls_key) if self.tls_cert else generate_cert()
        return Security(
            credentials=credentials, verifier=verifier, server_cert=cert, require_tls=self.tls, mode=self.mode
        )


def read_token(token: str, token_file: str = "") -> bytes:
    """``--auth-token`` (or ``SWARMPIPE_AUTH_TOKEN``) or the contents of ``--auth-token-file``; b"" for neither."""
    if token and token_file:
        raise ValueError("--auth-token and --auth-token-file: pass one")
    if token_file:
        with open(token_file, "rb") as f:
            data = f.read(4096).strip()
        if not data:
            raise ValueError(f"{token_file} is empty")
        return data
    return token.encode()


def token_credentials(token: bytes) -> Credentials:
    """What a caller that holds the swarm's token attaches to its calls."""
    return Credentials(TokenMinter(derive_key(token, "rpc")))


def key_credentials(identity: Identity) -> Credentials:
    """What a caller on an allow-list attaches: credentials signed with its identity key."""
    public_key = identity.key.get_public_key().to_bytes()
    return Credentials(
        KeyMinter(identity.peer_id, public_key, lambda m: base64.b64decode(identity.key.sign(m)))  # hivemind: base64
    )


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """hivemind's RSA-PSS check, as records and state shards are signed."""
    try:
        return RSAPublicKey.from_bytes(public_key).verify(message, base64.b64encode(signature))
    except Exception:  # not an RSA key in OpenSSH form, or whatever else hostile bytes make the parser raise
        return False


def read_allow_list(path: str) -> frozenset[str]:
    """``--allow-peers FILE``: one peer id (``Qm...``) or OpenSSH RSA public key per line; ``#`` comments."""
    with open(path, "rb") as f:
        data = f.read(MAX_ALLOW_LIST_BYTES + 1)
    if len(data) > MAX_ALLOW_LIST_BYTES:
        raise ValueError(f"{path}: an allow-list over {MAX_ALLOW_LIST_BYTES >> 20} MiB")
    peers = set()
    for number, raw in enumerate(data.decode(errors="replace").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("ssh-rsa "):
            peer = peer_id_of(" ".join(line.split()[:2]).encode())
        else:
            try:
                peer = PeerID.from_base58(line).to_base58()
            except Exception:
                peer = None
        if peer is None:
            raise ValueError(f"{path}:{number}: neither a peer id nor an ssh-rsa public key: {line[:40]!r}")
        peers.add(peer)
    if not peers:
        raise ValueError(f"{path} lists no peer")
    if len(peers) > MAX_ALLOWED:
        raise ValueError(f"{path}: {len(peers)} peers (at most {MAX_ALLOWED})")
    return frozenset(peers)


_installed = SwarmAccess()


def install_access(access: SwarmAccess) -> None:
    """This process's access settings (the CLI, once per role); :func:`start_dht` reads them."""
    global _installed
    _installed = access


def current_access() -> SwarmAccess:
    return _installed

"""A participant's identity: one RSA key that is both its libp2p peer id and the key that signs its DHT records.

libp2p derives a peer id from the public key (a sha256 multihash of it), so a record stored under the subkey
``b"<peer id>[owner:<public key>]"`` proves itself to anyone: hivemind's ``RSASignatureValidator`` checks that
the holder of ``<public key>`` signed it, and :func:`peer_id_of` checks that this key is the one that ``<peer id>``
names. Nobody can announce under another peer's id, and a run's coordinator is known by the peer id in its
multiaddr (``.../p2p/<peer id>``): that is how a volunteer who knows the coordinator's address knows its key.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import lru_cache

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

OWNER_OPEN = b"[owner:"
MAX_PUBLIC_KEY_BYTES = 2048  # an OpenSSH RSA-4096 key is about 730 bytes
MAX_NAME_BYTES = 128  # the part before "[owner:": a peer id (46 chars) or a run id


@dataclass
class Identity:
    """The key file p2pd loads and the same key as a record signer."""

    path: str  # the protobuf private key file (hivemind's identity format)
    key: RSAPrivateKey
    peer_id: str
    _tmpdir: str = ""  # a throwaway identity lives here until :meth:`forget_file`

    @property
    def validator(self) -> RSASignatureValidator:
        return RSASignatureValidator(self.key)

    def owner_subkey(self, name: str | None = None) -> bytes:
        """``b"<name>[owner:<public key>]"``: records under it only this key can write; ``name`` defaults to our peer id."""
        return (name or self.peer_id).encode() + self.validator.local_public_key

    def forget_file(self) -> None:
        """Remove a throwaway key file once p2pd has read it (a persistent ``--identity`` file stays)."""
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = ""


def write_key_file(identity: Identity) -> str:
    """A fresh throwaway copy of ``identity``'s key file (p2pd reads keys from files); the caller removes its
    folder once p2pd has read it. For starting the same node again (the DHT in client mode)."""
    tmpdir = tempfile.mkdtemp(prefix="swarmpipe-id-")
    path = os.path.join(tmpdir, "identity.key")
    der = identity.key.to_bytes()
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString())
    return path


def load_identity(path: str | None) -> Identity:
    """The key at ``path`` (created there when missing), or a fresh throwaway key when ``path`` is empty."""
    tmpdir = ""
    if not path:
        tmpdir = tempfile.mkdtemp(prefix="swarmpipe-id-")
        path = os.path.join(tmpdir, "identity.key")
    if not os.path.isfile(path):
        P2P.generate_identity(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        der = crypto_pb2.PrivateKey.FromString(data).data
        private = serialization.load_der_private_key(der, password=None)
    except Exception as e:
        raise ValueError(f"{path} is not a hivemind identity file (a protobuf RSA private key): {e}") from None
    if not isinstance(private, rsa.RSAPrivateKey):
        raise ValueError(f"{path} holds a {type(private).__name__}; swarmpipe identities are RSA keys")
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})  # hivemind's own (un)pickling path: the DER bytes
    return Identity(path=path, key=key, peer_id=PeerID.from_identity(data).to_base58(), _tmpdir=tmpdir)


@lru_cache(maxsize=4096)  # readers see the same few hundred keys on every announce round
def peer_id_of(openssh_public_key: bytes) -> str | None:
    """The libp2p peer id of an RSA public key as records carry it (OpenSSH form), or None if it is not one."""
    if not 0 < len(openssh_public_key) <= MAX_PUBLIC_KEY_BYTES:
        return None
    try:
        public = serialization.load_ssh_public_key(openssh_public_key)
    except Exception:
        return None
    if not isinstance(public, rsa.RSAPublicKey):
        return None
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    # multihash sha2-256: code 0x12, length 0x20, digest (libp2p hashes RSA keys, they are over 42 bytes)
    return PeerID(b"\x12\x20" + hashlib.sha256(encoded).digest()).to_base58()


def split_signed_subkey(subkey: object) -> tuple[str, str] | None:
    """``b"<name>[owner:<key>]"`` -> (name, the peer id of key); None for anything else (plain strings included).

    The signature itself is checked by ``RSASignatureValidator`` in every DHT node before a reader sees the record;
    this ties the key to a peer id, so the caller can require ``name == signer`` or a signer it trusts.
    """
    if not isinstance(subkey, bytes) or not subkey.endswith(b"]"):
        return None
    name, sep, rest = subkey.partition(OWNER_OPEN)
    if not sep or not 0 < len(name) <= MAX_NAME_BYTES or OWNER_OPEN in rest:
        return None
    signer = peer_id_of(rest[:-1])
    if signer is None:
        return None
    try:
        return name.decode("ascii"), signer
    except UnicodeDecodeError:
        return None


def peer_id_in_maddr(maddr: str) -> str | None:
    """The peer id a multiaddr ends with (``/ip4/1.2.3.4/tcp/5/p2p/Qm...``), or None."""
    _, sep, tail = maddr.rpartition("/p2p/")
    if not sep or not tail or "/" in tail:
        return None
    try:
        return PeerID.from_base58(tail).to_base58()
    except Exception:
        return None

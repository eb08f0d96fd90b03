"""TLS on gRPC channels without a CA: self-signed certificates, pinned from signed DHT records.

A server (a peer's ``Stage`` service, the coordinator's checkpoint server) holds one certificate, generated at
start or loaded from ``--tls-cert``/``--tls-key``, and publishes it in its signed DHT record. A client trusts,
for an address, exactly the certificates that signed records announced there (:class:`TLSPins`): gRPC Python
cannot verify by fingerprint, so the pinned PEMs are the channel's only roots and ``ssl_target_name_override``
names the host in them. Whoever answers at the address must hold the private key of a certificate that the
announcer signed for: the address is bound to the DHT identity that announced it.

Our certificates name the host ``swarmpipe`` (``TLS_NAME``) and each has its own subject, so several pinned
for one address (a peer restarted on the same port before its old record expired) can sit in one root bundle.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtensionOID, NameOID

TLS_NAME = "swarmpipe"
MAX_CERT_CHARS = 4096  # a PEM certificate in a record: an RSA-4096 one is ~1.9 KB, ours ~0.6 KB
CERT_DAYS = 365
PIN_TTL_S = 600.0  # a certificate no record has shown for this long is no longer trusted for its address
MAX_PINS_PER_ADDRESS = 4
MAX_ADDRESSES = 4096
_BEGIN, _END = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"


@dataclass(frozen=True)
class ServerCert:
    """A server's certificate (PEM text, as records carry it) and its private key (PEM bytes, never sent)."""

    cert_pem: str
    key_pem: bytes = b""

    @property
    def fingerprint(self) -> str:
        return cert_identity(self.cert_pem)[0]

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem.encode())])


def generate_cert() -> ServerCert:
    """A fresh self-signed P-256 certificate for ``TLS_NAME`` (milliseconds; one per server start)."""
    key = ec.generate_private_key(ec.SECP256R1())
    # a subject of its own: certificates of one address can share a root bundle (issuers are found by subject)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{TLS_NAME} {os.urandom(8).hex()}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))  # a client whose clock is behind still accepts it
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return ServerCert(cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem)


def load_cert(cert_path: str, key_path: str) -> ServerCert:
    """``--tls-cert``/``--tls-key``: one PEM certificate naming a DNS host, and its private key."""
    with open(cert_path) as f:
        cert_pem = f.read()
    with open(key_path, "rb") as f:
        key_pem = f.read()
    check_cert_pem(cert_pem)
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    key = serialization.load_pem_private_key(key_pem, password=None)
    der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*der) != cert.public_key().public_bytes(*der):
        raise ValueError(f"{key_path} is not the private key of the certificate in {cert_path}")
    return ServerCert(cert_pem, key_pem)


@lru_cache(maxsize=1024)  # readers see the same few hundred certificates on every refresh
def cert_identity(pem: str) -> tuple[str, str]:
    """(sha256 fingerprint of the DER, the host name to verify it by); ValueError if it is not one certificate."""
    if len(pem) > MAX_CERT_CHARS:
        raise ValueError(f"a certificate of {len(pem)} characters (at most {MAX_CERT_CHARS})")
    text = pem.strip()
    if not text.startswith(_BEGIN) or not text.endswith(_END) or text.count(_BEGIN) != 1:
        raise ValueError("not one PEM certificate")
    try:
        cert = x509.load_pem_x509_certificate(text.encode())
    except ValueError:
        raise ValueError("an undecodable PEM certificate") from None
    fingerprint = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
    return fingerprint, _host_name(cert)


def _host_name(cert: x509.Certificate) -> str:
    try:
        names = cert.extensions.get_extension_for_oid(ExtensionOID.SUBJECT_ALTERNATIVE_NAME).value
        dns = names.get_values_for_type(x509.DNSName)
        if dns:
            return dns[0]
    except x509.ExtensionNotFound:
        pass
    common = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not common:
        raise ValueError("the certificate names no host (no DNS subject alternative name, no common name)")
    return str(common[0].value)


def check_cert_pem(pem: str) -> str:
    """A record field's check: '' (no TLS) or one parseable certificate; raises ValueError otherwise."""
    if pem:
        cert_identity(pem)
    return pem


@dataclass(frozen=True)
class Pin:
    """What a channel to one address trusts: the roots bundle, the host name to check, and its identity."""

    roots: bytes
    name: str
    fingerprints: tuple[str, ...]

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.roots)


class TLSPins:
    """Address -> the certificates signed records announced for it, learned as records are read.

    Bounded: ``MAX_PINS_PER_ADDRESS`` certificates per address (the newest kept), ``MAX_ADDRESSES`` addresses
    (the least recently announced forgotten), and a certificate unseen for ``PIN_TTL_S`` no longer counts."""

    def __init__(self, ttl_s: float = PIN_TTL_S, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.clock = clock
        self._certs: OrderedDict[str, OrderedDict[str, float]] = OrderedDict()  # address -> {pem: last seen}
        self._pins: dict[str, Pin | None] = {}  # address -> its Pin, rebuilt when its certificates change

    def __len__(self) -> int:
        return len(self._certs)

    def learn(self, address: str, pem: str) -> bool:
        """A signed record announced ``pem`` for ``address``; False (ignored) if it is not a certificate."""
        try:
            cert_identity(pem)
        except ValueError:
            return False
        certs = self._certs.get(address)
        if certs is None:
            certs = self._certs[address] = OrderedDict()
            if len(self._certs) > MAX_ADDRESSES:
                forgotten, _ = self._certs.popitem(last=False)
                self._pins.pop(forgotten, None)
        self._certs.move_to_end(address)
        changed = pem not in certs
        certs[pem] = self.clock()
        certs.move_to_end(pem)
        while len(certs) > MAX_PINS_PER_ADDRESS:
            certs.popitem(last=False)
        if changed:
            self._pins.pop(address, None)
        return True

    def pin(self, address: str) -> Pin | None:
        """The certificates to trust at ``address`` (None: no signed record announced one)."""
        certs = self._certs.get(address)
        if certs is None:
            return None
        oldest = self.clock() - self.ttl_s
        if certs and next(iter(certs.values())) < oldest:  # ordered by last seen: expire from the front
            for pem in [p for p, seen in certs.items() if seen < oldest]:
                del certs[pem]
            self._pins.pop(address, None)
        if not certs:
            del self._certs[address]
            self._pins.pop(address, None)
            return None
        pin = self._pins.get(address)
        if pin is None:
            newest_first = list(reversed(certs))
            pin = Pin(
                roots="\n".join(p.strip() for p in newest_first).encode() + b"\n",
                name=cert_identity(newest_first[0])[1],
                fingerprints=tuple(sorted(cert_identity(p)[0] for p in newest_first)),
            )
            self._pins[address] = pin
        return pin

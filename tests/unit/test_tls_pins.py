"""Self-signed certificates and the pins learned from signed records (peer/transport/tls.py), and the
``tls_cert`` record field against hostile values."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from swarmpipe.peer.swarm.records import CheckpointRecord, StageRecord
from swarmpipe.peer.transport.security import Security, UntrustedAddress
from swarmpipe.peer.transport.tls import (
    MAX_CERT_CHARS,
    MAX_PINS_PER_ADDRESS,
    TLS_NAME,
    TLSPins,
    cert_identity,
    check_cert_pem,
    generate_cert,
    load_cert,
)

pytestmark = pytest.mark.unit
STAGE = {"address": "10.0.0.1:5000", "state": "online", "throughput": 1.0, "queue": 0, "version": 0, "updated_at": 0.0}


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def certs():
    return [generate_cert() for _ in range(6)]


def test_a_generated_certificate_names_swarmpipe_and_is_small(certs) -> None:
    cert = certs[0]
    fingerprint, name = cert_identity(cert.cert_pem)
    assert name == TLS_NAME and len(fingerprint) == 64 and fingerprint == cert.fingerprint
    assert len(cert.cert_pem) < 1024 and b"PRIVATE KEY" in cert.key_pem and "PRIVATE" not in cert.cert_pem
    assert cert_identity(certs[1].cert_pem)[0] != fingerprint


def test_load_cert_checks_the_pair(tmp_path, certs) -> None:
    (tmp_path / "c.pem").write_text(certs[0].cert_pem)
    (tmp_path / "k.pem").write_bytes(certs[0].key_pem)
    (tmp_path / "other.pem").write_bytes(certs[1].key_pem)
    assert load_cert(str(tmp_path / "c.pem"), str(tmp_path / "k.pem")).cert_pem == certs[0].cert_pem
    with pytest.raises(ValueError, match="not the private key"):
        load_cert(str(tmp_path / "c.pem"), str(tmp_path / "other.pem"))


@pytest.mark.parametrize(
    "hostile",
    [
        "x" * 10_000,
        "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----",
        "not a certificate",
        "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----",
    ],
)
def test_hostile_tls_cert_fields_are_refused(hostile: str) -> None:
    with pytest.raises(ValueError):
        check_cert_pem(hostile)
    with pytest.raises(ValidationError):
        StageRecord.model_validate({**STAGE, "tls_cert": hostile})
    with pytest.raises(ValidationError):
        CheckpointRecord.model_validate(
            {"step": 1, "versions": [], "digests": [], "created_at": 0.0, "tls_cert": hostile}
        )


def test_two_certificates_in_one_field_are_refused(certs) -> None:
    with pytest.raises(ValidationError):
        StageRecord.model_validate({**STAGE, "tls_cert": certs[0].cert_pem + certs[1].cert_pem})
    assert StageRecord.model_validate({**STAGE, "tls_cert": certs[0].cert_pem}).tls_cert == certs[0].cert_pem
    assert len(certs[0].cert_pem) <= MAX_CERT_CHARS


def test_pins_follow_what_records_announce(certs) -> None:
    clock = Clock()
    pins = TLSPins(ttl_s=100, clock=clock)
    assert pins.pin("a:1") is None
    assert not pins.learn("a:1", "junk")  # an unparseable certificate is ignored
    assert pins.learn("a:1", certs[0].cert_pem)
    first = pins.pin("a:1")
    assert first.fingerprints == (certs[0].fingerprint,) and first.name == TLS_NAME
    assert pins.pin("a:1") is first  # cached until the certificates change
    pins.learn("a:1", certs[1].cert_pem)  # a restarted peer on the same port, its old record not yet expired
    both = pins.pin("a:1")
    assert set(both.fingerprints) == {certs[0].fingerprint, certs[1].fingerprint}
    assert both.roots.count(b"BEGIN CERTIFICATE") == 2
    clock.now = 60
    pins.learn("a:1", certs[1].cert_pem)
    clock.now = 150  # the old certificate's record stopped showing it 150 s ago
    assert pins.pin("a:1").fingerprints == (certs[1].fingerprint,)
    clock.now = 1000
    assert pins.pin("a:1") is None and len(pins) == 0


def test_pins_are_bounded(certs) -> None:
    pins = TLSPins()
    for cert in certs:
        pins.learn("a:1", cert.cert_pem)
    assert len(pins.pin("a:1").fingerprints) == MAX_PINS_PER_ADDRESS
    assert certs[-1].fingerprint in pins.pin("a:1").fingerprints  # the newest kept


def test_require_tls_refuses_unpinned_addresses(certs) -> None:
    security = Security(require_tls=True)
    with pytest.raises(UntrustedAddress) as refused:
        security.pin("10.0.0.9:1")
    assert "no certificate" in refused.value.details()
    security.pins.learn("10.0.0.9:1", certs[0].cert_pem)
    assert security.pin("10.0.0.9:1") is not None
    assert Security().pin("10.0.0.9:1") is None  # an open swarm dials plaintext

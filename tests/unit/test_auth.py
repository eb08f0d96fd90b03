"""Call credentials of a private swarm (peer/transport/auth.py): token HMACs and identity-signed credentials,
the expiry window, the verified-credential cache, and hostile credentials (forged, replayed for another
method, expired, from the far future, oversized, garbage)."""

from __future__ import annotations

import time

import pytest

from swarmpipe.peer.swarm.access import key_credentials, token_credentials, verify_signature
from swarmpipe.peer.swarm.identity import load_identity, peer_id_of
from swarmpipe.peer.transport.auth import (
    CLOCK_SKEW_S,
    CREDENTIAL_LIFETIME_S,
    MAX_CREDENTIAL_CHARS,
    REFRESH_AFTER_S,
    AuthError,
    Credentials,
    KeyCheck,
    TokenCheck,
    TokenMinter,
    Verifier,
    derive_key,
)

pytestmark = pytest.mark.unit

TOKEN = b"correct horse battery staple"
METHOD = "/swarmpipe.Stage/Forward"


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def keys():
    member, stranger = load_identity(None), load_identity(None)
    for identity in (member, stranger):
        identity.forget_file()
    return member, stranger


def token_verifier(token: bytes = TOKEN, clock=time.time) -> Verifier:
    return Verifier(TokenCheck(derive_key(token, "rpc")), clock=clock)


def key_verifier(allowed: set[str], clock=time.time) -> Verifier:
    return Verifier(KeyCheck(lambda: allowed, peer_id_of, verify_signature), clock=clock)


def test_a_token_credential_is_accepted_and_never_contains_the_token() -> None:
    credential = token_credentials(TOKEN).for_method(METHOD)
    assert TOKEN.decode() not in credential and credential.startswith("t1.")
    assert token_verifier().verify(METHOD, credential) == "token"


def test_wrong_token_other_method_and_tampering_are_refused() -> None:
    credential = token_credentials(TOKEN).for_method(METHOD)
    with pytest.raises(AuthError, match="wrong token"):
        token_verifier(b"another token of enough length").verify(METHOD, credential)
    with pytest.raises(AuthError, match="another method"):  # a captured Info credential does not open Forward
        token_verifier().verify("/swarmpipe.Stage/PushState", credential)
    version, expires, nonce, mac = credential.split(".")
    with pytest.raises(AuthError):
        token_verifier().verify(METHOD, ".".join([version, str(int(expires) + 60), nonce, mac]))  # longer life


def test_short_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        derive_key(b"hunter2", "rpc")


def test_the_rpc_and_dht_keys_differ() -> None:
    assert derive_key(TOKEN, "rpc") != derive_key(TOKEN, "dht")


def test_expired_and_far_future_credentials_are_refused() -> None:
    clock = Clock()
    minted = Credentials(TokenMinter(derive_key(TOKEN, "rpc")), clock=clock).for_method(METHOD)
    verifier = token_verifier(clock=clock)
    clock.now += CREDENTIAL_LIFETIME_S + CLOCK_SKEW_S - 1
    assert verifier.verify(METHOD, minted) == "token"  # a slow clock is tolerated
    clock.now += 2
    with pytest.raises(AuthError, match="expired"):
        verifier.verify(METHOD, minted)  # also once cached
    future = Credentials(TokenMinter(derive_key(TOKEN, "rpc")), clock=Clock(clock.now + 3600)).for_method(METHOD)
    with pytest.raises(AuthError, match="too far into the future"):
        token_verifier(clock=clock).verify(METHOD, future)


def test_a_client_reuses_its_credential_then_refreshes_it() -> None:
    clock = Clock()
    credentials = Credentials(TokenMinter(derive_key(TOKEN, "rpc")), clock=clock)
    first = credentials.for_method(METHOD)
    clock.now += REFRESH_AFTER_S - 1
    assert credentials.for_method(METHOD) == first
    assert credentials.for_method("/swarmpipe.Stage/Info") != first  # one per method
    clock.now += 2
    renewed = credentials.for_method(METHOD)
    assert renewed != first and token_verifier(clock=clock).verify(METHOD, renewed) == "token"


def test_a_server_verifies_once_then_looks_up(monkeypatch: pytest.MonkeyPatch) -> None:
    verifier = token_verifier()
    credential = token_credentials(TOKEN).for_method(METHOD)
    verifier.verify(METHOD, credential)
    calls = []
    monkeypatch.setattr(verifier.check, "check", lambda *a: calls.append(a) or "token")
    started = time.perf_counter()
    for _ in range(10_000):
        verifier.verify(METHOD, credential)
    per_call = (time.perf_counter() - started) / 10_000
    assert not calls and per_call < 50e-6, per_call  # a dict lookup, no HMAC


def test_the_cache_is_bounded() -> None:
    verifier = Verifier(TokenCheck(derive_key(TOKEN, "rpc")), max_entries=8)
    minter = TokenMinter(derive_key(TOKEN, "rpc"))
    for _ in range(100):
        verifier.verify(METHOD, minter.mint(METHOD, int(time.time()) + 60))
    assert len(verifier) == 8


@pytest.mark.parametrize(
    "credential, reason",
    [
        (None, "no credentials"),
        ("", "no credentials"),
        ("x" * (MAX_CREDENTIAL_CHARS + 1), "characters"),
        ("garbage", "malformed"),
        ("t1.notanumber.a.b", "malformed"),
        ("t1.{expiry}.nonce.!!!not-base64!!!", "wrong token"),
        ("t1.{expiry}", "not a token credential"),
        ("k1.{expiry}.n.p.k.s", "not a token credential"),
    ],
)
def test_hostile_token_credentials(credential, reason: str) -> None:
    if credential is not None:  # the expiry is set when the test runs, not when it is collected (minutes earlier)
        credential = credential.replace("{expiry}", str(int(time.time()) + 30))
    with pytest.raises(AuthError, match=reason):
        token_verifier().verify(METHOD, credential)


def test_an_allow_listed_key_is_accepted(keys) -> None:
    member, _ = keys
    credential = key_credentials(member).for_method(METHOD)
    assert key_verifier({member.peer_id}).verify(METHOD, credential) == member.peer_id


def test_a_key_off_the_list_is_refused_before_any_signature_work(keys, monkeypatch: pytest.MonkeyPatch) -> None:
    member, stranger = keys
    checked = []
    verifier = Verifier(KeyCheck(lambda: {member.peer_id}, peer_id_of, lambda *a: checked.append(a) or True))
    with pytest.raises(AuthError, match="not on the allow-list"):
        verifier.verify(METHOD, key_credentials(stranger).for_method(METHOD))
    assert not checked


def test_impersonation_and_forgery_are_refused(keys) -> None:
    member, stranger = keys
    verifier = key_verifier({member.peer_id})
    honest = key_credentials(member).for_method(METHOD)
    version, expires, nonce, peer, public, signature = honest.split(".")
    mine = key_credentials(stranger).for_method(METHOD).split(".")
    # the member's peer id with the stranger's key and signature: the key does not name that peer id
    with pytest.raises(AuthError, match="not the one peer id"):
        verifier.verify(METHOD, ".".join([version, mine[1], mine[2], peer, mine[4], mine[5]]))
    # the member's key with the stranger's signature
    with pytest.raises(AuthError, match="bad signature"):
        verifier.verify(METHOD, ".".join([version, expires, nonce, peer, public, mine[5]]))
    # the member's credential replayed for another method
    with pytest.raises(AuthError, match="another method"):
        verifier.verify("/swarmpipe.Stage/PushState", honest)
    # garbage where the key and signature belong
    with pytest.raises(AuthError):
        verifier.verify(METHOD, ".".join([version, expires, nonce, peer, "AAAA", "AAAA"]))
    with pytest.raises(AuthError, match="not a key credential"):
        verifier.verify(METHOD, token_credentials(TOKEN).for_method(METHOD))

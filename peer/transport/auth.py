"""Call credentials of a private swarm: what a caller attaches to every RPC and how a server checks it.

Two modes (``--auth-token`` or ``--allow-peers``), one credential per (caller, method) that lives
``CREDENTIAL_LIFETIME_S`` and travels in the ``swarmpipe-auth`` call metadata:

* token: ``t1.<expires>.<nonce>.<mac>``, an HMAC-SHA256 under a key derived from the shared token over the
  method, the expiry and a random nonce. The token itself never leaves the process, so a passive listener
  on a plaintext link cannot learn it (and with it the right to announce in the DHT); what it can do is
  replay a captured credential for the same method until it expires (``--tls`` stops that).
* key: ``k1.<expires>.<nonce>.<peer id>.<public key>.<signature>``, signed with the caller's identity key
  (the key behind its libp2p peer id). The server admits it only when that peer id is on its allow-list and
  the public key is the one the peer id names.

A server verifies a credential once and then only looks it up (bounded LRU until it expires), so the
per-call cost is a dict lookup; a client mints one per method and reuses it for half its life.
No grpc here: :mod:`swarmpipe.peer.transport.security` attaches and checks credentials on gRPC calls.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Container
from typing import Protocol

METADATA_KEY = "swarmpipe-auth"
CREDENTIAL_LIFETIME_S = 120  # a captured credential is worth at most this long
REFRESH_AFTER_S = 60  # a client mints a fresh one when its credential is older than this
CLOCK_SKEW_S = 60  # volunteers' clocks disagree; a credential this far "from the future" still counts
MAX_CREDENTIAL_CHARS = 4096  # an RSA-4096 key and signature fit; anything longer is refused unparsed
MIN_TOKEN_BYTES = 16  # a shorter shared token is guessable offline from one captured credential
CACHE_ENTRIES = 4096  # verified credentials a server remembers (a few per caller and method)
_VERSION = "swarmpipe-rpc-v1"


class AuthError(Exception):
    """Why a credential is refused; short, never echoes more than a few characters of it."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def derive_key(token: bytes, purpose: str) -> bytes:
    """A key for one purpose ("rpc", "dht"): a credential of one kind proves nothing for the other."""
    if len(token) < MIN_TOKEN_BYTES:
        raise ValueError(f"the auth token must be at least {MIN_TOKEN_BYTES} bytes (e.g. `openssl rand -hex 32`)")
    return hmac.new(token, f"swarmpipe {purpose} key".encode(), hashlib.sha256).digest()


def _message(kind: str, method: str, expires: int, nonce: str, peer_id: str = "") -> bytes:
    return f"{_VERSION}\n{kind}\n{method}\n{expires}\n{nonce}\n{peer_id}".encode()


# ------------------------------------------------------------------ minting (the caller)


class Minter(Protocol):
    def mint(self, method: str, expires: int) -> str: ...


class TokenMinter:
    def __init__(self, rpc_key: bytes):
        self._key = rpc_key

    def mint(self, method: str, expires: int) -> str:
        nonce = _b64(os.urandom(12))
        mac = hmac.new(self._key, _message("t1", method, expires, nonce), hashlib.sha256).digest()
        return f"t1.{expires}.{nonce}.{_b64(mac)}"


class KeyMinter:
    """``sign(message) -> signature`` with the identity key; ``public_key``: its OpenSSH form."""

    def __init__(self, peer_id: str, public_key: bytes, sign: Callable[[bytes], bytes]):
        self.peer_id = peer_id
        self._public = _b64(public_key)
        self._sign = sign

    def mint(self, method: str, expires: int) -> str:
        nonce = _b64(os.urandom(12))
        signature = self._sign(_message("k1", method, expires, nonce, self.peer_id))
        return f"k1.{expires}.{nonce}.{self.peer_id}.{self._public}.{_b64(signature)}"


class Credentials:
    """The caller's side: a credential per method, reused until it is ``REFRESH_AFTER_S`` old."""

    def __init__(self, minter: Minter, clock: Callable[[], float] = time.time):
        self.minter = minter
        self.clock = clock
        self._cache: dict[str, tuple[float, str]] = {}  # method -> (minted at, credential); a service has few

    def for_method(self, method: str) -> str:
        now = self.clock()
        cached = self._cache.get(method)
        if cached is None or now - cached[0] > REFRESH_AFTER_S:
            if len(self._cache) > 64:  # methods of our own services only; never grows with callers
                self._cache.clear()
            cached = (now, self.minter.mint(method, int(now) + CREDENTIAL_LIFETIME_S))
            self._cache[method] = cached
        return cached[1]


# ------------------------------------------------------------------ verifying (the server)


class Check(Protocol):
    def check(self, method: str, credential: str) -> str: ...


class TokenCheck:
    """Admits credentials minted with the same token; returns "token" as the caller's name."""

    def __init__(self, rpc_key: bytes):
        self._key = rpc_key

    def check(self, method: str, credential: str) -> str:
        parts = credential.split(".")
        if len(parts) != 4 or parts[0] != "t1":
            raise AuthError("not a token credential (does the caller use --allow-peers?)")
        expires, nonce, mac = int(parts[1]), parts[2], parts[3]
        expected = hmac.new(self._key, _message("t1", method, expires, nonce), hashlib.sha256).digest()
        if not hmac.compare_digest(_b64(expected), mac):
            raise AuthError("wrong token, or a credential for another method")
        return "token"


class KeyCheck:
    """Admits credentials signed by a peer on the allow-list; returns its peer id.

    ``allowed()``: the peer ids admitted now; ``peer_id_of(public key)``: the peer id a key names (None if it
    is not a valid key); ``verify(public key, message, signature)``: the signature check."""

    def __init__(
        self,
        allowed: Callable[[], Container[str]],
        peer_id_of: Callable[[bytes], str | None],
        verify: Callable[[bytes, bytes, bytes], bool],
    ):
        self.allowed = allowed
        self.peer_id_of = peer_id_of
        self.verify = verify

    def check(self, method: str, credential: str) -> str:
        parts = credential.split(".")
        if len(parts) != 6 or parts[0] != "k1":
            raise AuthError("not a key credential (does the caller use --auth-token?)")
        expires, nonce, peer_id, public_b64, signature_b64 = int(parts[1]), *parts[2:]
        if peer_id not in self.allowed():  # before any public-key work: strangers cost a set lookup
            raise AuthError(f"peer {peer_id[-8:]!r} is not on the allow-list")
        public_key = _unb64(public_b64)
        if self.peer_id_of(public_key) != peer_id:
            raise AuthError(f"the key is not the one peer id {peer_id[-8:]!r} names")
        if not self.verify(public_key, _message("k1", method, expires, nonce, peer_id), _unb64(signature_b64)):
            raise AuthError("bad signature, or a credential for another method")
        return peer_id


class Verifier:
    """A :class:`Check` with the expiry window and a bounded cache of credentials already verified."""

    def __init__(self, check: Check, clock: Callable[[], float] = time.time, max_entries: int = CACHE_ENTRIES):
        self.check = check
        self.clock = clock
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[str, str], tuple[int, str]] = OrderedDict()  # -> (expires, caller)

    def __len__(self) -> int:
        return len(self._seen)

    def verify(self, method: str, credential: str | None) -> str:
        """The caller's name ("token" or its peer id); :class:`AuthError` when the call must be refused."""
        if not credential:
            raise AuthError("no credentials: this swarm is private (--auth-token / --allow-peers)")
        if len(credential) > MAX_CREDENTIAL_CHARS:
            raise AuthError(f"a credential of {len(credential)} characters")
        now = self.clock()
        entry = self._seen.get((method, credential))
        if entry is not None:
            if entry[0] + CLOCK_SKEW_S >= now:
                self._seen.move_to_end((method, credential))
                return entry[1]
            del self._seen[(method, credential)]
            raise AuthError("expired credential")
        expires = _expiry(credential)
        if expires + CLOCK_SKEW_S < now:
            raise AuthError(f"expired credential ({now - expires:.0f} s ago; is this machine's clock right?)")
        if expires > now + CREDENTIAL_LIFETIME_S + CLOCK_SKEW_S:
            raise AuthError("a credential valid too far into the future")
        try:
            caller = self.check.check(method, credential)
        except (ValueError, TypeError, UnicodeError) as e:  # undecodable fields
            raise AuthError(f"malformed credential ({type(e).__name__})") from None
        self._seen[(method, credential)] = (expires, caller)
        if len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
        return caller


def _expiry(credential: str) -> int:
    try:
        return int(credential.split(".", 2)[1])
    except (IndexError, ValueError):
        raise AuthError("malformed credential") from None

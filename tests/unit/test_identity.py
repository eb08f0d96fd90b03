"""swarmpipe.peer.swarm.identity: one key is the peer id and the record signer; subkeys prove their owner."""

from __future__ import annotations

import os

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey

from swarmpipe.peer.swarm.identity import load_identity, peer_id_in_maddr, peer_id_of, split_signed_subkey

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def identity(tmp_path_factory):
    return load_identity(str(tmp_path_factory.mktemp("id") / "peer.key"))


def test_a_saved_identity_is_reloaded_with_the_same_peer_id(identity) -> None:
    again = load_identity(identity.path)
    assert again.peer_id == identity.peer_id
    with open(identity.path, "rb") as f:
        assert identity.peer_id == PeerID.from_identity(f.read()).to_base58()


def test_the_signing_key_is_the_peer_ids_key(identity) -> None:
    public = identity.key.get_public_key().to_bytes()
    assert peer_id_of(public) == identity.peer_id
    assert identity.validator.local_public_key == b"[owner:" + public + b"]"


def test_owner_subkey_proves_its_owner(identity) -> None:
    assert split_signed_subkey(identity.owner_subkey()) == (identity.peer_id, identity.peer_id)
    assert split_signed_subkey(identity.owner_subkey("run-a")) == ("run-a", identity.peer_id)


def test_a_subkey_naming_a_victim_with_another_key_shows_the_real_signer(identity) -> None:
    attacker = RSASignatureValidator(RSAPrivateKey())
    name, signer = split_signed_subkey(identity.peer_id.encode() + attacker.local_public_key)
    assert name == identity.peer_id and signer != identity.peer_id


@pytest.mark.parametrize(
    "subkey",
    [
        "plain-string",
        b"plain-bytes",
        None,
        7,
        b"peer[owner:not a key]",
        b"[owner:ssh-rsa AAAA]",  # no name
        b"x" * 200 + b"[owner:ssh-rsa AAAA]",  # name too long
        b"peer[owner:ssh-rsa AAAA][owner:ssh-rsa BBBB]",
        b"peer[owner:" + b"A" * 5000 + b"]",
        b"\xff\xfe[owner:ssh-rsa AAAA]",
    ],
)
def test_anything_but_a_signed_subkey_is_refused(subkey) -> None:
    assert split_signed_subkey(subkey) is None


def test_a_throwaway_identity_leaves_no_file() -> None:
    throwaway = load_identity(None)
    assert os.path.isfile(throwaway.path)
    throwaway.forget_file()
    assert not os.path.exists(throwaway.path)
    assert len(throwaway.peer_id) > 40


def test_a_file_that_is_not_an_identity_is_refused(tmp_path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_bytes(b"not a key")
    with pytest.raises(ValueError, match="not a hivemind identity"):
        load_identity(str(bad))


def test_peer_id_in_maddr(identity) -> None:
    assert peer_id_in_maddr(f"/ip4/10.0.0.1/tcp/31337/p2p/{identity.peer_id}") == identity.peer_id
    assert peer_id_in_maddr("/ip4/10.0.0.1/tcp/31337") is None
    assert peer_id_in_maddr("/ip4/10.0.0.1/tcp/31337/p2p/not-base58-0OIl") is None

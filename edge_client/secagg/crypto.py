"""The cryptographic primitives of secure aggregation, each one call into ``cryptography``.

- X25519 key agreement, the shared secret stretched by HKDF-SHA256 with a label and the
  round's session bytes (:func:`agree`): one key to encrypt shares, one mask seed;
- ChaCha20-Poly1305 (:func:`seal` / :func:`unseal`): what one device sends another through
  the coordinator, with the sender, recipient and session as associated data;
- Ed25519 (:func:`sign` / :func:`verify`): a device's long-term identity signs its round keys;
- the mask generator (:func:`prg_uint32`): a 32-byte seed -> ``n`` uint32 words, the
  ChaCha20 keystream (a PRG under the usual assumption on ChaCha20).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from edge_client.errors import ProtocolError

KEY_BYTES = 32
SIGNATURE_BYTES = 64
NONCE_BYTES = 12
_RAW = serialization.Encoding.Raw
_RAW_PUB = serialization.PublicFormat.Raw
_RAW_PRIV = serialization.PrivateFormat.Raw
_NO_ENC = serialization.NoEncryption()


def x25519_keypair() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair as raw bytes ``(private 32, public 32)``."""
    sk = X25519PrivateKey.generate()
    return sk.private_bytes(_RAW, _RAW_PRIV, _NO_ENC), sk.public_key().public_bytes(_RAW, _RAW_PUB)


def x25519_public(private: bytes) -> bytes:
    """The public key of a raw X25519 private key (how a reconstructed key is checked)."""
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes(_RAW, _RAW_PUB)


def agree(private: bytes, public: bytes, label: bytes, session: bytes) -> bytes:
    """32 bytes both ends of a pair derive: HKDF-SHA256(X25519(private, public)) with
    ``label`` and ``session`` as info. ProtocolError for a public key that is not one."""
    try:
        shared = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:
        raise ProtocolError(f"key agreement failed: {exc}") from None
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=label + b"|" + session).derive(shared)


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """``nonce || ChaCha20-Poly1305(key, nonce, plaintext, aad)`` (a random 96-bit nonce)."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, aad)


def unseal(key: bytes, blob: bytes, aad: bytes) -> bytes:
    """The plaintext of :func:`seal`'s output; ProtocolError when it was not sealed with
    ``key`` and ``aad`` or was changed since."""
    if len(blob) < NONCE_BYTES + 16:
        raise ProtocolError("ciphertext: too short")
    try:
        return ChaCha20Poly1305(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
    except InvalidTag:
        raise ProtocolError("ciphertext: does not authenticate") from None


def identity_keypair() -> tuple[bytes, bytes]:
    """A fresh Ed25519 identity ``(private 32, public 32)``."""
    sk = Ed25519PrivateKey.generate()
    return sk.private_bytes(_RAW, _RAW_PRIV, _NO_ENC), sk.public_key().public_bytes(_RAW, _RAW_PUB)


def identity_public(private: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(private).public_key().public_bytes(_RAW, _RAW_PUB)


def sign(private: bytes, message: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(private).sign(message)


def verify(public: bytes, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``public``'s Ed25519 signature of ``message``."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
        return True
    except (InvalidSignature, ValueError):
        return False


def digest(*parts: bytes) -> bytes:
    """SHA-256 of the length-prefixed ``parts`` (commitments to secrets and shares)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(4, "big"))
        h.update(p)
    return h.digest()


def prg_uint32(seed: bytes, n: int) -> np.ndarray:
    """``n`` pseudo-random uint32 words from a 32-byte ``seed`` (ChaCha20 keystream, nonce
    zero: every seed is used for one vector only)."""
    enc = Cipher(algorithms.ChaCha20(seed, b"\0" * 16), mode=None).encryptor()
    return np.frombuffer(enc.update(bytes(4 * int(n))), dtype="<u4").astype(np.uint32, copy=False)

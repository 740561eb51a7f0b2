"""SipHash-1-3, the hash behind Rust's `std::collections::hash_map::DefaultHasher`.

Upstream Dynamo's Kubernetes discovery derives a worker's instance id from its
DynamoWorkerMetadata name with `DefaultHasher::new()` (SipHash-1-3 with both keys zero) over
the name hashed as a Rust `str`: its UTF-8 bytes followed by one 0xff byte. We must produce
the very same number, so the algorithm is reproduced here from the SipHash paper
(Aumasson & Bernstein, 2012): 1 compression round per 8-byte word, 3 finalization rounds.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _rotl(value: int, bits: int) -> int:
    return ((value << bits) | (value >> (64 - bits))) & _MASK64


def _sip_round(v0: int, v1: int, v2: int, v3: int) -> tuple[int, int, int, int]:
    v0 = (v0 + v1) & _MASK64
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 = (v2 + v3) & _MASK64
    v3 = _rotl(v3, 16) ^ v2
    v0 = (v0 + v3) & _MASK64
    v3 = _rotl(v3, 21) ^ v0
    v2 = (v2 + v1) & _MASK64
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


def siphash13(data: bytes, k0: int = 0, k1: int = 0) -> int:
    """SipHash-1-3 of `data` under the 128-bit key (k0, k1), as an unsigned 64-bit int."""
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573
    whole = len(data) - len(data) % 8
    for offset in range(0, whole, 8):
        word = int.from_bytes(data[offset : offset + 8], "little")
        v3 ^= word
        v0, v1, v2, v3 = _sip_round(v0, v1, v2, v3)
        v0 ^= word
    # The last word: the remaining bytes, with the message length (mod 256) in the top byte.
    last = int.from_bytes(data[whole:], "little") | ((len(data) & 0xFF) << 56)
    v3 ^= last
    v0, v1, v2, v3 = _sip_round(v0, v1, v2, v3)
    v0 ^= last
    v2 ^= 0xFF
    for _ in range(3):
        v0, v1, v2, v3 = _sip_round(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


def rust_str_hash(text: str) -> int:
    """What `text.hash(&mut DefaultHasher::new()); hasher.finish()` returns in Rust."""
    return siphash13(text.encode("utf-8") + b"\xff")

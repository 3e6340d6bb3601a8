"""Checksums used by the on-disk format: xxh3_64 (payload, header) and the
device checksum (payload, computable by torch on the GPU).

One function per purpose so the algorithm is named in exactly one place: the
format version must change if it ever does. xxh3_64 runs at memory speed, which
matters because every spilled and promoted block is hashed on the I/O path.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import xxhash


def payload_checksum(data: Any) -> int:
    """xxh3_64 of the stored (possibly compressed) payload bytes.

    ``data`` is anything exposing the buffer protocol (bytes, memoryview,
    contiguous numpy array). xxhash's binding lets the GIL go while it
    hashes, so the engine's thread runs beside a thread that verifies or
    spills blocks instead of waiting behind each block (docs/benchmarks.md,
    "Engine step stalls"). The price is one GIL re-acquisition per block on
    the hashing thread, which is long only next to a thread that spins in
    pure Python.
    """
    return xxhash.xxh3_64_intdigest(data)


def payload_hasher() -> xxhash.xxh3_64:
    """An incremental :func:`payload_checksum`: ``update`` it with a
    payload's bytes in order, then ``intdigest()``. For a payload read in
    pieces (the tools check stores whose block size they do not choose)."""
    return xxhash.xxh3_64()


def header_checksum(data: Any) -> int:
    """xxh3_64 of the header's fixed fields, detecting torn or flipped headers."""
    return payload_checksum(data)


# -- the device checksum ------------------------------------------------------
#
# A checksum that torch computes on the GPU (and on CPU tensors, bit for bit
# the same), so a slot read straight into device memory is verified there.
# Definition, over the payload zero-padded to a multiple of 4 bytes, read as
# little-endian uint32 words u_0 .. u_{n-1} (n < 2**31, i.e. < 8 GiB):
#
#     P  = 2**31 - 1                                  (a Mersenne prime)
#     S1 = (u_0 + u_1 + ... + u_{n-1})          mod 2**32
#     S2 = (1*u_0 + 2*u_1 + ... + n*u_{n-1})    mod P
#     device_checksum = S2 << 32 | S1       (< 2**63: fits int64 as is)
#
# Every step is exact integer arithmetic in int64 that never overflows (the
# bounds are noted where they matter), so CPU and CUDA, numpy and torch agree
# exactly; there are no floating-point or atomics-order effects (integer sums
# are associative). What it detects, honestly:
#   - any change of one word (S1 changes: the difference is in (-2**32, 2**32)
#     and non-zero), so every single-bit flip and every burst within 4 bytes;
#   - a swap of two different words i != j, unless u_i == u_j (mod P) (S2
#     changes by (j - i)(u_i - u_j), and P is prime with |j - i| < P);
#   - changes of two words, unless their differences cancel mod 2**32 in S1
#     and mod P in S2 at once;
#   - other corruption (zeroed tails, another block's bytes) with a chance of
#     about 2**-62 of being missed for unstructured data. It is linear, so it
#     is no defence against a crafted payload (xxh3 is not either; the header
#     key and fingerprint say which block a slot holds).
# It is weaker than xxh3_64 against structured errors, which is why every
# header keeps xxh3 and the host path keeps checking it.

DEVICE_CHECKSUM_PRIME = (1 << 31) - 1
_P = DEVICE_CHECKSUM_PRIME
_MASK32 = 0xFFFFFFFF
# How it is computed (both implementations): the words are cut into q rows of
# _COLS words (plus a tail of r < _COLS words). With T_c the row sums and K_j
# the column sums, sum((i+1) u_i) = sum_c (c*_COLS) T_c + sum_j (j+1) K_j
# (+ the tail's own weighted sum). So the big data is only summed twice along
# two axes (exact: every sum < n * 2**32 < 2**63); the weights and the
# modular products touch the small vectors T and K only.
_COLS = 1024
# Words per torch piece: bounds the int64 temporaries to 8 bytes * this.
_TORCH_PIECE_WORDS = 1 << 22
_weights: dict[tuple[str, int, int], Any] = {}
_weights_lock = threading.Lock()


def _weights_for(key: tuple[str, int, int], arange: Any) -> tuple[Any, Any, Any]:
    """The weights of ``q, n = key[1:]`` words (row offsets, column weights,
    tail weights), made with ``arange(start, stop)`` once per key."""
    _, q, n = key
    with _weights_lock:
        w = _weights.get(key)
        if w is None:
            if len(_weights) > 32:
                _weights.clear()
            w = _weights[key] = (
                (arange(0, q) * _COLS) % _P,
                arange(1, _COLS + 1),
                arange(q * _COLS + 1, n + 1) % _P,
            )
    return w


def device_checksum(data: Any) -> int:
    """The device checksum (see above) of ``data``'s bytes, on the host.

    ``data`` exposes the buffer protocol. This is what the writer stores in
    version 2 headers; :func:`device_checksum_rows` computes it for many
    rows at once, :func:`device_checksums` on tensors.
    """
    raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    if raw.size % 4:
        raw = np.concatenate([raw, np.zeros(4 - raw.size % 4, dtype=np.uint8)])
    return int(device_checksum_rows(raw.reshape(1, -1), raw.size)[0])


def device_checksum_rows(rows: np.ndarray, nbytes: int) -> np.ndarray:
    """:func:`device_checksum` of the first ``nbytes`` bytes of each row of
    ``rows``, on the host, for all rows in a fixed number of numpy calls
    (a writer staging many blocks lets the interpreter lock go a few times
    per batch, not a few times per block).

    ``rows`` is a 2-D uint8 array whose rows are contiguous (its row stride
    may be larger: the payload columns of slots); ``nbytes`` a multiple of
    4 within a row. Returns a uint64 array, one checksum per row.
    """
    if rows.ndim != 2 or rows.dtype != np.uint8 or rows.strides[1] != 1:
        raise ValueError("rows must be a 2-D uint8 array with contiguous rows")
    if nbytes % 4 or not 0 <= nbytes <= rows.shape[1]:
        raise ValueError(f"nbytes={nbytes} must be a multiple of 4 within a row")
    n = nbytes // 4
    if n >= 1 << 31:
        raise ValueError(
            f"payload of {nbytes} bytes is too long for the device checksum"
        )
    m = rows.shape[0]
    if n == 0 or m == 0:
        return np.zeros(m, dtype=np.uint64)
    words = rows[:, :nbytes].view("<u4")  # (m, n)
    q = n // _COLS
    cw, jw, tw = _weights_for(
        ("np", q, n), lambda lo, hi: np.arange(lo, hi, dtype=np.uint64)
    )
    main = words[:, : q * _COLS].reshape(m, q, _COLS)
    tail = words[:, q * _COLS :].astype(np.uint64)
    t = main.sum(axis=2, dtype=np.uint64)  # (m, q), each < 2**42
    k = main.sum(axis=1, dtype=np.uint64)  # (m, _COLS), each < q * 2**32
    # Every sum < n * 2**32 < 2**63, so uint64 never wraps.
    s1 = (t.sum(axis=1) + tail.sum(axis=1)) & np.uint64(_MASK32)
    # Products of two residues < 2**31 stay < 2**62; each sum < n * 2**31
    # and the three together < 2**64.
    p = np.uint64(_P)
    s2 = (
        ((t % p) * cw % p).sum(axis=1)
        + ((k % p) * jw % p).sum(axis=1)
        + ((tail % p) * tw % p).sum(axis=1)
    ) % p
    return (s2 << np.uint64(32)) | s1


def device_checksums(rows: Any, nbytes: int) -> Any:
    """Device checksums of the first ``nbytes`` bytes of each row of ``rows``.

    ``rows`` is a 2-D ``torch.uint8`` tensor (CPU or CUDA; rows may be a
    strided view, e.g. the payload columns of a staging area) whose row
    stride is a multiple of 4; ``nbytes`` must be a multiple of 4 (pad with
    zeros first otherwise). Returns an int64 tensor of one checksum per row on
    ``rows``' device, equal to :func:`device_checksum` of each row's bytes
    (which is < 2**63, so int64 holds it unchanged). Integer ops only (exact,
    so deterministic on any device); a fixed number of kernels per piece of
    rows; never synchronises the device itself.
    """
    import torch

    if rows.dim() != 2 or rows.dtype != torch.uint8:
        raise ValueError("rows must be a 2-D uint8 tensor")
    if nbytes % 4 or not 0 <= nbytes <= rows.shape[1]:
        raise ValueError(f"nbytes={nbytes} must be a multiple of 4 within a row")
    n = nbytes // 4
    count = rows.shape[0]
    out = torch.zeros(count, dtype=torch.int64, device=rows.device)
    if n == 0 or count == 0:
        return out
    if n >= 1 << 31:
        raise ValueError("rows too long for the device checksum")
    q = n // _COLS
    cw, jw, tw = _weights_for(
        (str(rows.device), q, n),
        lambda lo, hi: torch.arange(lo, hi, dtype=torch.int64, device=rows.device),
    )
    words = rows[:, :nbytes].view(torch.int32)
    step = max(1, _TORCH_PIECE_WORDS // n)
    for lo in range(0, count, step):
        u = words[lo : lo + step].to(torch.int64) & _MASK32  # uint32 values
        m = u.shape[0]
        main = u[:, : q * _COLS].reshape(m, q, _COLS)
        tail = u[:, q * _COLS :]
        t = main.sum(dim=2)  # (m, q)
        k = main.sum(dim=1)  # (m, _COLS)
        s1 = (t.sum(dim=1) + tail.sum(dim=1)) & _MASK32
        s2 = (
            (t % _P * cw % _P).sum(dim=1)
            + (k % _P * jw % _P).sum(dim=1)
            + (tail % _P * tw % _P).sum(dim=1)
        ) % _P
        out[lo : lo + step] = (s2 << 32) | s1
    return out

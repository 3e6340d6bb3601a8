from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.store.backends.base import IO_ALIGNMENT
from kvtier.store.checksum import header_checksum
from kvtier.store.compression import Codec
from kvtier.store.slot import (
    FIXED_HEADER_LEN,
    FLAG_AFTER_RESET,
    FLAGGED_HEADER_VERSION,
    FORMAT_VERSION,
    HEADER_SIZE,
    HEADER_VERSION,
    HEADER_VERSIONS,
    MAGIC,
    CorruptHeaderError,
    EmptySlotError,
    LayoutFingerprint,
    SlotHeader,
    aligned_empty,
    slot_size,
)
from kvtier.testing.state import pack_version_1

REPO_ROOT = Path(__file__).resolve().parents[2]
REF = LayoutFingerprint(
    "meta-llama/Llama-3.1-8B", "bfloat16", 2 * 1024 * 1024, "g1", 1, 2
)


def header(**kw: object) -> SlotHeader:
    base = dict(
        key=bytes(range(36)),
        fingerprint=REF.digest(),
        payload_len=1000,
        raw_len=4096,
        codec=Codec.ZSTD_BYTEPLANE,
        checksum=0x1234_5678_9ABC_DEF0,
        seq=42,
        written_at=1_700_000_000.25,
        elem_size=2,
        device_checksum=0x0765_4321_0FED_CBA9,
    )
    base.update(kw)
    return SlotHeader(**base)  # type: ignore[arg-type]


def test_header_roundtrip_and_size() -> None:
    h = header()
    packed = h.pack()
    assert len(packed) == HEADER_SIZE
    assert packed[:8] == MAGIC
    assert packed[FIXED_HEADER_LEN:] == bytes(HEADER_SIZE - FIXED_HEADER_LEN)
    assert SlotHeader.unpack(packed) == h
    assert SlotHeader.unpack(header(key=b"").pack()).key == b""
    assert SlotHeader.unpack(header(key=b"k" * 64).pack()).key == b"k" * 64


def test_version_1_header_still_parses() -> None:
    old = header(version=1, device_checksum=None)
    packed = pack_version_1(old)
    assert packed[8:12] == (1).to_bytes(4, "little")
    back = SlotHeader.unpack(packed)
    assert back == old and back.device_checksum is None
    # A version 1 header is shorter: flipping a byte past it changes nothing
    # it reads, but every byte it has is still under the header checksum.
    for i in range(0, 144, 7):
        bad = bytearray(packed)
        bad[i] ^= 0x10
        with pytest.raises(CorruptHeaderError):
            SlotHeader.unpack(bytes(bad))


def _with_flags(packed: bytes, flags: int) -> bytes:
    """``packed`` with its flags (reserved) byte set and its header checksum
    made right again: what a writer setting those flags would write."""
    fixed = bytearray(packed[:FIXED_HEADER_LEN])
    fixed[15] = flags
    end = FIXED_HEADER_LEN - 8
    fixed[end:] = header_checksum(bytes(fixed[:end])).to_bytes(8, "little")
    return bytes(fixed) + packed[FIXED_HEADER_LEN:]


def test_an_after_reset_header_is_version_3_with_its_flag() -> None:
    plain = header().pack()
    assert plain[8:12] == (HEADER_VERSION).to_bytes(4, "little") and plain[15] == 0
    flagged = header(after_reset=True, version=FLAGGED_HEADER_VERSION)
    packed = flagged.pack()
    assert packed[8:12] == (3).to_bytes(4, "little")
    assert packed[15] == FLAG_AFTER_RESET
    back = SlotHeader.unpack(packed)
    assert back == flagged and back.after_reset
    assert SlotHeader.unpack(plain).after_reset is False
    # The byte is reserved below version 3: a version 2 header is never read
    # as flagged, whatever it holds there.
    assert SlotHeader.unpack(_with_flags(plain, FLAG_AFTER_RESET)).after_reset is False
    # A flag this kvtier does not know (a later release's) is refused.
    with pytest.raises(CorruptHeaderError, match="flags 0x03 .*Upgrade kvtier"):
        SlotHeader.unpack(_with_flags(packed, 0x03))


def test_every_fixed_header_byte_is_protected() -> None:
    packed = header().pack()
    for i in range(FIXED_HEADER_LEN):
        torn = bytearray(packed)
        torn[i] ^= 0x5A
        with pytest.raises(CorruptHeaderError):
            SlotHeader.unpack(torn)


def test_zeroed_header_is_empty_and_short_is_corrupt() -> None:
    with pytest.raises(EmptySlotError):
        SlotHeader.unpack(bytes(HEADER_SIZE))
    with pytest.raises(CorruptHeaderError):
        SlotHeader.unpack(header().pack()[:100])


def test_other_version_and_bad_fields_rejected() -> None:
    # A later release's header: its own checksum holds.
    newer = bytearray(header().pack())
    newer[8:12] = (max(HEADER_VERSIONS) + 1).to_bytes(4, "little")
    flipped = bytes(newer)  # the same bytes, but the checksum is the old one
    size = FIXED_HEADER_LEN - 8
    newer[size : size + 8] = header_checksum(bytes(newer[:size])).to_bytes(8, "little")
    with pytest.raises(CorruptHeaderError, match="header version 4 .*Upgrade kvtier"):
        SlotHeader.unpack(bytes(newer))
    # A bit flipped in the version field (bit rot) is a corrupt header, not
    # a slot to upgrade kvtier for.
    with pytest.raises(CorruptHeaderError, match="checksum mismatch .*reads 4") as err:
        SlotHeader.unpack(flipped)
    assert "Upgrade" not in str(err.value)
    with pytest.raises(ValueError, match="cannot write header version"):
        header(version=FLAGGED_HEADER_VERSION).pack()  # no flag: version 2
    with pytest.raises(ValueError, match="cannot write header version"):
        header(after_reset=True).pack()  # a flag: version 3
    with pytest.raises(ValueError, match="needs device_checksum"):
        header(device_checksum=None).pack()
    with pytest.raises(CorruptHeaderError, match="magic"):
        SlotHeader.unpack(header(magic=b"NOTKVTIE").pack())
    with pytest.raises(CorruptHeaderError):
        SlotHeader.unpack(header(payload_len=5000, raw_len=4096).pack())
    with pytest.raises(ValueError):
        header(key=b"x" * 65).pack()
    with pytest.raises(ValueError):
        header(fingerprint=b"short").pack()


def test_fingerprint_digest_is_pinned_and_field_sensitive() -> None:
    d = REF.digest()
    assert len(d) == 16 and d == REF.digest()
    # Pinned: a change here changes every on-disk directory name and header,
    # so it must come with a FORMAT_VERSION bump.
    assert d.hex() == PINNED_DIGEST
    changes = dict(
        model="x",
        dtype="float16",
        block_bytes=4096,
        geometry="g2",
        tp_rank=0,
        tp_size=4,
    )
    for name, value in changes.items():
        assert dataclasses.replace(REF, **{name: value}).digest() != d, name
    desc = REF.describe()
    assert desc["digest"] == d.hex() and desc["format_version"] == FORMAT_VERSION
    assert desc["model"] == REF.model and desc["tp_size"] == 2


def test_fingerprint_digest_stable_across_processes() -> None:
    code = (
        "from kvtier.store.slot import LayoutFingerprint as F;"
        "print(F('meta-llama/Llama-3.1-8B','bfloat16',2*1024*1024,'g1',1,2).digest().hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert out.stdout.strip() == REF.digest().hex()


def test_fingerprint_validation() -> None:
    with pytest.raises(ValueError):
        LayoutFingerprint("m", "bf16", 0, "g", 0, 1)
    with pytest.raises(ValueError):
        LayoutFingerprint("m", "bf16", 4096, "g", 2, 2)


def test_slot_size_and_alignment() -> None:
    assert slot_size(1) == 8192
    assert slot_size(4096) == 8192
    assert slot_size(4097) == 12288
    assert slot_size(256 * 1024) == HEADER_SIZE + 256 * 1024
    for n in (1, 4096, 12345, 1 << 20):
        assert slot_size(n) % IO_ALIGNMENT == 0 and slot_size(n) >= HEADER_SIZE + n
        buf = aligned_empty(n)
        assert buf.nbytes == n and buf.ctypes.data % IO_ALIGNMENT == 0
    with pytest.raises(ValueError):
        slot_size(0)


PINNED_DIGEST = "51b9020bfa5d62e5f518088a11c0121b"

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.store.compression import (
    Codec,
    CorruptPayloadError,
    compress,
    decompress,
    from_byte_planes,
    to_byte_planes,
)


def kv_bytes(dtype: torch.dtype, n: int = 32 * 1024, seed: int = 0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, dtype=torch.float32, generator=g)
        .to(dtype)
        .view(torch.uint8)
        .numpy()
    )


def roundtrip(
    data: np.ndarray, elem_size: int, **kw: float
) -> tuple[Codec, bytes, np.ndarray]:
    codec, payload = compress(data, elem_size, **kw)
    out = np.full(data.nbytes, 0xEE, dtype=np.uint8)
    decompress(codec, payload, data.nbytes, elem_size, out)
    return codec, payload, out


def test_byte_planes_layout() -> None:
    data = np.array([0x0102, 0x0304, 0x0506], dtype="<u2").view(np.uint8)
    planes = to_byte_planes(data, 2)
    assert planes.tobytes() == bytes([0x02, 0x04, 0x06, 0x01, 0x03, 0x05])
    out = np.zeros(6, dtype=np.uint8)
    from_byte_planes(planes, 2, out)
    assert out.tobytes() == data.tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kv_data_compresses_and_roundtrips(dtype: torch.dtype) -> None:
    data = kv_bytes(dtype)
    codec, payload, out = roundtrip(data, 2)
    assert codec is Codec.ZSTD_BYTEPLANE
    assert len(payload) < 0.95 * data.nbytes
    assert out.tobytes() == data.tobytes()


def test_incompressible_is_stored_raw() -> None:
    data = np.random.default_rng(1).integers(0, 256, 64 * 1024, dtype=np.uint8)
    codec, payload, out = roundtrip(data, 2)
    assert codec is Codec.RAW
    assert payload == data.tobytes()
    assert out.tobytes() == data.tobytes()


def test_threshold_is_configurable() -> None:
    data = kv_bytes(torch.float16)  # saves roughly 8%
    assert compress(data, 2, min_saving=0.5)[0] is Codec.RAW
    assert compress(data, 2, min_saving=0.0)[0] is Codec.ZSTD_BYTEPLANE


def test_zeros_compress_hugely() -> None:
    data = np.zeros(1 << 20, dtype=np.uint8)
    codec, payload, out = roundtrip(data, 2)
    assert codec is Codec.ZSTD_BYTEPLANE and len(payload) < 1024
    assert not out.any()


def test_corrupt_payload_leaves_out_untouched() -> None:
    data = kv_bytes(torch.bfloat16)
    codec, payload = compress(data, 2)
    out = np.full(data.nbytes, 0xEE, dtype=np.uint8)
    with pytest.raises(CorruptPayloadError):
        decompress(codec, payload[: len(payload) // 2], data.nbytes, 2, out)
    with pytest.raises(CorruptPayloadError):
        decompress(Codec.RAW, data.tobytes()[:-1], data.nbytes, 2, out)
    assert (out == 0xEE).all()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        compress(np.zeros(3, dtype=np.uint8), 2)
    with pytest.raises(ValueError):
        decompress(Codec.RAW, b"abc", 4, 1, np.zeros(3, dtype=np.uint8))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([1, 2, 4]),
    st.binary(min_size=0, max_size=4096),
    st.sampled_from([0.0, 0.05, 0.5]),
    st.booleans(),
)
def test_roundtrip_property(
    elem_size: int, raw: bytes, min_saving: float, repeat: bool
) -> None:
    if repeat:  # make some inputs compressible
        raw = raw[:16] * 64
    raw = raw[: len(raw) - len(raw) % elem_size]
    data = np.frombuffer(raw, dtype=np.uint8).copy()
    _, _, out = roundtrip(data, elem_size, min_saving=min_saving)
    assert out.tobytes() == raw

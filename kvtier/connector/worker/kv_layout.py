"""What the worker accepts as a KV cache, checked before it copies a byte.

vLLM hands an offloading worker its KV cache as ``CanonicalKVCaches``:
unique tensors whose first dimension is the block, and per KV-cache group
the references (tensor index, unpadded page size) of its layers. vLLM's own
GPU worker asserts on what it relies on; kvtier checks the same facts (and
a few more that its row layout needs) and says what is wrong and what to do
instead, because a silently wrong layout would be copied, checksummed and
persisted as valid KV:

- every tensor block-contiguous: ``(num_blocks, page_size_bytes)`` bytes
  with nothing between blocks, the layout vLLM's CPU offloading requires
  (a permuted or strided view would make kvtier read the wrong bytes);
- all tensors on one device, of the platform's kind (the CPU platform
  keeps its KV cache in host memory, CUDA on the GPU), with one block count;
- every reference inside its tensor: ``0 < page <= page_size_bytes``;
- a group's block fits the CPU-tier row the spec sized from vLLM's
  ``worker_kv_bytes_per_block``.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_offload.base import CanonicalKVCaches


class KVLayoutError(ValueError):
    """The KV cache has a layout kvtier's worker cannot copy."""


def tensor_pages(
    kv_caches: CanonicalKVCaches, device_kind: str | None = None
) -> list[torch.Tensor]:
    """Validate ``kv_caches``' tensors and return each, in
    ``kv_caches.tensors`` order, as bytes ``(num_blocks, page_size_bytes)``
    (its whole page, padding included): one device (of ``device_kind``,
    ``"cpu"`` on the CPU platform, where given), each block-contiguous,
    one block count. KVLayoutError says what is wrong."""
    tensors = kv_caches.tensors
    if not tensors or not kv_caches.group_data_refs:
        raise KVLayoutError("kvtier: the KV cache has no tensors or no groups")
    devices = {t.tensor.device for t in tensors}
    if len(devices) != 1:
        raise KVLayoutError(
            f"kvtier: the KV cache spans devices {sorted(map(str, devices))}; "
            "one worker's KV cache must live on one device"
        )
    device = devices.pop()
    if device_kind is not None and device.type != device_kind:
        raise KVLayoutError(
            f"kvtier: the KV cache is on {device}, this platform's worker "
            f"copies {device_kind} tensors"
        )
    pages = [
        _block_bytes(idx, entry.tensor, entry.page_size_bytes)
        for idx, entry in enumerate(tensors)
    ]
    counts = {p.shape[0] for p in pages}
    if len(counts) != 1:
        raise KVLayoutError(
            f"kvtier: KV cache tensors hold different block counts {sorted(counts)}"
        )
    return pages


def group_tensors(
    kv_caches: CanonicalKVCaches, pages: list[torch.Tensor]
) -> list[dict[int, int]]:
    """Per KV-cache group, the tensors its layers use (``pages`` from
    :func:`tensor_pages`): tensor index -> the largest unpadded page its
    references use, each tensor once (layers sharing memory appear once),
    in the order of the group's references. KVLayoutError for a reference
    outside its tensor."""
    groups: list[dict[int, int]] = []
    for group, refs in enumerate(kv_caches.group_data_refs):
        seen: dict[int, int] = {}
        for ref in refs:
            if not 0 <= ref.tensor_idx < len(pages):
                raise KVLayoutError(
                    f"kvtier: group {group} refers to tensor {ref.tensor_idx} of "
                    f"{len(pages)}"
                )
            page = pages[ref.tensor_idx].shape[1]
            if not 0 < ref.page_size_bytes <= page:
                raise KVLayoutError(
                    f"kvtier: group {group}'s layer page of {ref.page_size_bytes} B "
                    f"does not fit tensor {ref.tensor_idx}'s {page} B blocks"
                )
            seen[ref.tensor_idx] = max(seen.get(ref.tensor_idx, 0), ref.page_size_bytes)
        groups.append(seen)
    return groups


def group_views(
    kv_caches: CanonicalKVCaches,
    row_bytes: int,
    blocks_per_chunk: int,
    device_kind: str | None = None,
) -> list[list[torch.Tensor]]:
    """Validate ``kv_caches`` (:func:`tensor_pages`, :func:`group_tensors`)
    and return, per KV-cache group, its tensors as byte views
    ``(num_blocks, unpadded page)``, each tensor once, in the order of the
    group's references; a group's offloaded block must fit a CPU-tier row
    of ``row_bytes``."""
    pages = tensor_pages(kv_caches, device_kind)
    views: list[list[torch.Tensor]] = []
    for group, seen in enumerate(group_tensors(kv_caches, pages)):
        group_views = [pages[i][:, :size] for i, size in seen.items()]
        needed = blocks_per_chunk * sum(v.shape[1] for v in group_views)
        if needed > row_bytes:
            raise KVLayoutError(
                f"kvtier: KV-cache group {group} needs {needed} B per offloaded "
                f"block but the CPU tier's rows hold {row_bytes} B (vLLM's "
                "worker_kv_bytes_per_block disagrees with the tensors it passed)"
            )
        views.append(group_views)
    return views


def _block_bytes(idx: int, tensor: torch.Tensor, page_size: int) -> torch.Tensor:
    """``tensor`` as ``(num_blocks, page_size)`` bytes, or a clear error."""
    if page_size <= 0:
        raise KVLayoutError(f"kvtier: KV cache tensor {idx} has page size {page_size}")
    nbytes = tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous():
        raise KVLayoutError(
            f"kvtier: KV cache tensor {idx} (shape {tuple(tensor.shape)}, stride "
            f"{tensor.stride()}) is not contiguous; kvtier copies whole blocks "
            "of vLLM's block-contiguous layout (the one vLLM's CPU offloading "
            "requires): use a KV-cache layout and attention backend that vLLM's "
            "CPU offloading supports"
        )
    if tensor.dim() < 1 or nbytes != tensor.shape[0] * page_size:
        raise KVLayoutError(
            f"kvtier: KV cache tensor {idx} holds {nbytes} B, not its "
            f"{tensor.shape[0] if tensor.dim() else 0} blocks x {page_size} B "
            "pages: the first dimension must be the block"
        )
    raw = tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)
    return raw.reshape(tensor.shape[0], page_size)

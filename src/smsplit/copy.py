"""A persistent SM copy: exactly ``num_programs`` programs stream a buffer with 16-byte
non-caching loads and stores. It is the simplest bandwidth-bound kernel that runs on a comm budget,
and the building block of the SM transports."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from smsplit import ptx
from smsplit.trace import Trace, record_block


@triton.jit(do_not_specialize=["tag"])  # a new tag id must not recompile
def persistent_copy_kernel(src, dst, n_vec, trace_ptr, tag, BLOCK: tl.constexpr, TRACE: tl.constexpr,
                           EVICT_FIRST: tl.constexpr = False):
    """Copy ``n_vec`` 16-byte vectors (``src``/``dst`` point at int32 words). EVICT_FIRST marks the
    copied lines evict-first in L2."""
    if TRACE:
        start = ptx.globaltimer()
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(n_vec, BLOCK)
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        offs = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_vec
        if EVICT_FIRST:
            w0, w1, w2, w3 = ptx.ld_global_nc_v4_evict_first(src + 4 * offs, mask)
            ptx.st_global_na_v4_evict_first(dst + 4 * offs, w0, w1, w2, w3, mask)
        else:
            w0, w1, w2, w3 = ptx.ld_global_nc_v4(src + 4 * offs, mask)
            ptx.st_global_na_v4(dst + 4 * offs, w0, w1, w2, w3, mask)
    if TRACE:
        record_block(trace_ptr, tag, start)


def _as_words(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned")
    return t.view(torch.uint8).view(torch.int32) if t.dtype != torch.int32 else t


def sm_copy(dst: torch.Tensor, src: torch.Tensor, num_programs: int, trace: Trace | None = None,
            name: str = "copy", kind: str = "comm", block: int = 2048, num_warps: int = 8,
            evict_first: bool = False) -> torch.Tensor:
    """Copy ``src`` into ``dst`` (same byte size, a multiple of 16) with exactly ``num_programs``
    persistent programs on the current stream. With ``trace``, each program records where and when
    it ran under ``name``/``kind``. ``evict_first`` keeps the copied lines from displacing other
    kernels' data in L2."""
    if src.nbytes != dst.nbytes:
        raise ValueError(f"src has {src.nbytes} bytes and dst {dst.nbytes}; they must match")
    if src.nbytes % 16:
        raise ValueError(f"the copy moves 16-byte vectors; {src.nbytes} bytes is not a multiple of 16")
    if num_programs < 1:
        raise ValueError(f"num_programs must be >= 1, got {num_programs}")
    src_words, dst_words = _as_words(src, "src"), _as_words(dst, "dst")
    if trace is not None:
        trace_view, tag = trace.slots(num_programs, name, kind)
    else:
        trace_view, tag = dst_words, 0  # unused when TRACE is False
    persistent_copy_kernel[(num_programs,)](
        src_words, dst_words, src.nbytes // 16, trace_view, tag,
        BLOCK=block, TRACE=trace is not None, EVICT_FIRST=evict_first, num_warps=num_warps,
    )
    return dst

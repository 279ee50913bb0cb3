"""A persistent SM copy: exactly ``num_programs`` programs stream a buffer. It is the simplest
bandwidth-bound kernel that runs on a comm budget, and the building block of the SM transports.

Two methods:

* ``"ldst"`` (default): every thread moves 16-byte vectors with non-caching loads and stores
  (``smsplit.ptx``); one tile per program is in flight at a time.
* ``"tma"``: the Hopper tensor memory accelerator. Each program keeps ``stages - 1`` tiles of
  loads in flight into a shared-memory ring (``cp.async.bulk.tensor`` global -> shared, software
  pipelined by Triton) and writes each tile back with a bulk tensor store. More bytes in flight per
  SM than ``"ldst"``, so it tolerates the memory latency that a kernel beside it adds. Needs sm_90+.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from smsplit import ptx
from smsplit._args import check_int
from smsplit.trace import Trace, record_block

METHODS = ("ldst", "tma")
# Shape defaults per method: (block in 16-byte vectors, num_warps, stages).
DEFAULTS = {"ldst": (2048, 8, None), "tma": (1024, 4, 8)}
# Dynamic shared memory a Hopper block can use (227 KiB); the TMA ring takes stages * tile bytes.
MAX_SHARED_BYTES = 227 * 1024
# TMA coordinates and Triton's descriptor shapes are signed 32-bit; the TMA copy addresses 8-byte
# elements and keeps their count (plus a tile) below 2**31.
TMA_MAX_BYTES = 8 * 2**30


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


@triton.jit(do_not_specialize=["tag"])  # a new tag id must not recompile
def persistent_tma_copy_kernel(src_desc, dst_desc, trace_ptr, tag, BLOCK: tl.constexpr,
                               STAGES: tl.constexpr, TRACE: tl.constexpr):
    """Copy through TMA: ``src_desc``/``dst_desc`` are 1-D tensor descriptors over the same number
    of 8-byte elements, with block ``[BLOCK]``. Program ``p`` copies tiles ``p, p + P, p + 2P, ...``;
    the loop is software-pipelined with ``STAGES`` shared-memory buffers (``STAGES - 1`` loads ahead,
    one store buffer). The last tile may be partial: TMA loads fill the out-of-bounds part with zeros
    and TMA stores drop it, so nothing past the end is read or written."""
    if TRACE:
        start = ptx.globaltimer()
    n = src_desc.shape[0]
    n_tiles = tl.cdiv(n, BLOCK)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        off = tile * BLOCK  # < n < 2**31: the host checks the size
        dst_desc.store([off], src_desc.load([off]))
    if TRACE:
        record_block(trace_ptr, tag, start)


def _check_tensor(t: torch.Tensor, name: str) -> None:
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned")


def _as_words(t: torch.Tensor, name: str) -> torch.Tensor:
    _check_tensor(t, name)
    # flat first: viewing bytes as int32 needs the last dimension's bytes to be a multiple of 4, which a
    # [n, 1] bfloat16 tensor (any multiple of 16 bytes in all) is not
    t = t.reshape(-1)  # a view: t is contiguous
    return t.view(torch.uint8).view(torch.int32) if t.dtype != torch.int32 else t


def _as_elements(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat int64 tensor (the TMA copy's element type)."""
    return t.reshape(-1).view(torch.uint8).view(torch.int64)


def tma_shared_bytes(block: int, stages: int) -> int:
    """Shared memory the TMA copy uses: ``stages`` buffers of ``block`` 16-byte vectors
    (``stages - 1`` for loads in flight, one for the store)."""
    return stages * block * 16


def sm_copy(dst: torch.Tensor, src: torch.Tensor, num_programs: int, trace: Trace | None = None,
            name: str = "copy", kind: str = "comm", block: int | None = None, num_warps: int | None = None,
            evict_first: bool = False, method: str = "ldst", stages: int | None = None) -> torch.Tensor:
    """Copy ``src`` into ``dst`` (same byte size, a multiple of 16) with exactly ``num_programs``
    persistent programs on the current stream. With ``trace``, each program records where and when
    it ran under ``name``/``kind``.

    ``block`` and ``num_warps`` must be powers of two.

    ``method="ldst"`` (default; ``block`` 2048, ``num_warps`` 8): 16-byte loads and stores by every
    thread, ``block`` vectors per program per step. ``evict_first`` keeps the copied lines from
    displacing other kernels' data in L2.

    ``method="tma"`` (sm_90+; ``block`` 1024, ``num_warps`` 4, ``stages`` 8): TMA bulk copies through
    a ring of ``stages`` shared-memory tiles of ``block`` 16-byte vectors, so up to ``stages - 1``
    tiles (112 KiB with the defaults) are being loaded per program while it stores.
    ``stages * block * 16`` at most 227 KiB, the copy at most 8 GiB;
    ``evict_first`` is not available (Triton's descriptor loads take no cache hint).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    default_block, default_warps, default_stages = DEFAULTS[method]
    block = default_block if block is None else block
    num_warps = default_warps if num_warps is None else num_warps
    if src.nbytes != dst.nbytes:
        raise ValueError(f"src has {src.nbytes} bytes and dst {dst.nbytes}; they must match")
    if src.nbytes % 16:
        raise ValueError(f"the copy moves 16-byte vectors; {src.nbytes} bytes is not a multiple of 16")
    num_programs = check_int("num_programs", num_programs, 1)
    for what, value in (("block", block), ("num_warps", num_warps)):  # Triton needs both powers of two
        if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{what} must be a power of two, got {value!r}")
    if method == "ldst":
        if stages is not None:
            raise ValueError("stages applies to method='tma' only")
        src_words, dst_words = _as_words(src, "src"), _as_words(dst, "dst")
    else:
        stages = default_stages if stages is None else stages
        if evict_first:
            raise ValueError("evict_first is not available with method='tma'")
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"stages must be an int >= 1, got {stages!r}")
        if tma_shared_bytes(block, stages) > MAX_SHARED_BYTES:
            raise ValueError(f"stages * block * 16 = {tma_shared_bytes(block, stages)} bytes of shared memory; "
                             f"at most {MAX_SHARED_BYTES}")
        if src.nbytes > TMA_MAX_BYTES:
            raise ValueError(f"method='tma' copies at most {TMA_MAX_BYTES} bytes, got {src.nbytes}")
        _check_tensor(src, "src")
        _check_tensor(dst, "dst")
        if src.nbytes == 0:  # a TMA descriptor cannot be empty: the plain kernel records the programs
            method, src_words, dst_words = "ldst", _as_words(src, "src"), _as_words(dst, "dst")
    if trace is not None:
        trace_view, tag = trace.slots(num_programs, name, kind)
    else:
        trace_view, tag = None, 0  # unused when TRACE is False
    if method == "ldst":
        persistent_copy_kernel[(num_programs,)](
            src_words, dst_words, src.nbytes // 16, dst_words if trace_view is None else trace_view, tag,
            BLOCK=block, TRACE=trace is not None, EVICT_FIRST=evict_first, num_warps=num_warps,
        )
    else:
        src_el, dst_el = _as_elements(src), _as_elements(dst)
        n, tile = src_el.numel(), 2 * block  # 8-byte elements
        src_desc = TensorDescriptor(src_el, shape=[n], strides=[1], block_shape=[tile])
        dst_desc = TensorDescriptor(dst_el, shape=[n], strides=[1], block_shape=[tile])
        persistent_tma_copy_kernel[(num_programs,)](
            src_desc, dst_desc, dst_el if trace_view is None else trace_view, tag,
            BLOCK=tile, STAGES=stages, TRACE=trace is not None, num_warps=num_warps,
        )
    return dst

"""sm_copy(method="tma"): the pipelined TMA copy compiles for sm_90 with bulk tensor copies and a
shared-memory ring (CPU); it copies odd sizes exactly and keeps the persistent-grid contract (GPU)."""

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from smsplit import ptx
from smsplit.copy import DEFAULTS, persistent_tma_copy_kernel, sm_copy, tma_shared_bytes
from smsplit.trace import Trace

TMA_LOAD, TMA_STORE = ptx.TMA_LOAD_1D, ptx.TMA_STORE_1D  # (the load's spelling depends on the Triton release)


def _signature(tile):
    return {"src_desc": f"tensordesc<i64[{tile}]>", "dst_desc": f"tensordesc<i64[{tile}]>", "trace_ptr": "*i64",
            "tag": "i32", "BLOCK": "constexpr", "STAGES": "constexpr", "TRACE": "constexpr"}


def _compile(block, num_warps, stages, trace):
    tile = 2 * block  # 16-byte vectors -> 8-byte elements
    source = ASTSource(fn=persistent_tma_copy_kernel, signature=_signature(tile),
                       constexprs={"BLOCK": tile, "STAGES": stages, "TRACE": trace})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


@pytest.mark.compile
@pytest.mark.parametrize("trace", [False, True])
def test_tma_copy_compiles_for_sm90_with_bulk_tensor_copies(trace):
    block, num_warps, stages = DEFAULTS["tma"]
    compiled = _compile(block, num_warps, stages, trace)
    text, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
    assert ".target sm_90" in text and cubin[:4] == b"\x7fELF"
    assert "cp.async.bulk.tensor" in text
    assert TMA_LOAD in text and TMA_STORE in text
    assert "mbarrier.try_wait" in text  # loads complete on mbarriers: asynchronous, not per-thread
    assert ptx.INSTRUCTIONS["ld_global_nc_v4"] not in text  # no per-thread global loads
    assert ("%globaltimer" in text) == trace and ("%smid" in text) == trace


@pytest.mark.compile
@pytest.mark.parametrize("block,num_warps,stages", [(1024, 4, 8), (2048, 4, 6), (512, 4, 16), (4096, 8, 3)])
def test_tma_copy_keeps_stages_tiles_in_shared_memory(block, num_warps, stages):
    # the software pipeline is real: one shared-memory buffer per stage (stages - 1 loads in flight
    # plus the store buffer), i.e. what tma_shared_bytes promises and sm_copy checks against 227 KiB
    compiled = _compile(block, num_warps, stages, False)
    assert tma_shared_bytes(block, stages) <= compiled.metadata.shared < tma_shared_bytes(block, stages) + 1024
    loads = compiled.asm["ptx"].count(TMA_LOAD)
    one_stage = _compile(block, num_warps, 1, False).asm["ptx"].count(TMA_LOAD)
    assert loads > one_stage  # a prologue issues the first stages - 1 tiles before the loop


def test_tma_copy_tag_does_not_specialize():
    assert [p.name for p in persistent_tma_copy_kernel.params if p.do_not_specialize] == ["tag"]


def test_tma_copy_rejects_bad_arguments_before_launch():
    # these checks come before the device checks, so CPU tensors reach them
    src, dst = torch.empty(64), torch.empty(64)
    with pytest.raises(ValueError, match="method must be one of"):
        sm_copy(dst, src, 4, method="dma")
    with pytest.raises(ValueError, match="evict_first"):
        sm_copy(dst, src, 4, method="tma", evict_first=True)
    with pytest.raises(ValueError, match="power of two"):
        sm_copy(dst, src, 4, method="tma", block=1000)
    with pytest.raises(ValueError, match="shared memory"):
        sm_copy(dst, src, 4, method="tma", block=4096, stages=4)
    with pytest.raises(ValueError, match="stages must be"):
        sm_copy(dst, src, 4, method="tma", stages=0)
    with pytest.raises(ValueError, match="stages applies"):
        sm_copy(dst, src, 4, stages=4)
    with pytest.raises(ValueError, match="CUDA tensor"):
        sm_copy(dst, src, 4, method="tma")


# Sizes in bytes: below one 16-byte vector of a tile, one tile +- a vector, many tiles with a ragged end.
ODD_SIZES = [16, 48, 16 * 1023, 16 * 1025, 16 * 1000003, 16 * (3 * 2**20 + 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("nbytes", ODD_SIZES)
@pytest.mark.parametrize("num_programs", [1, 7, 24])
def test_tma_copy_matches_copy_for_odd_sizes(nbytes, num_programs):
    device = torch.device("cuda")
    guard = 4096  # poisoned bytes after dst: the ragged last tile must not write past the end
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    out = torch.full((nbytes + guard,), 0xA5, dtype=torch.uint8, device=device)
    dst = out[:nbytes]
    ref = torch.empty_like(src)
    ref.copy_(src)
    sm_copy(dst, src, num_programs, method="tma")
    torch.cuda.synchronize()
    assert torch.equal(dst, ref)
    assert (out[nbytes:] == 0xA5).all()


@pytest.mark.gpu
@pytest.mark.parametrize("block,num_warps,stages", [(1024, 4, 8), (64, 4, 2), (2048, 8, 6), (1024, 4, 1)])
def test_tma_copy_shapes_and_dtypes(block, num_warps, stages):
    device = torch.device("cuda")
    src = torch.randn(37, 1000, 24, device=device, dtype=torch.bfloat16)  # 1776000 bytes, not a tile multiple
    dst = torch.zeros_like(src)
    sm_copy(dst, src, 20, method="tma", block=block, num_warps=num_warps, stages=stages)
    ref = torch.zeros_like(src)
    ref.copy_(src)
    torch.cuda.synchronize()
    assert torch.equal(dst.view(torch.int16), ref.view(torch.int16))


@pytest.mark.gpu
def test_tma_copy_from_offset_views():
    # 16-byte aligned views into larger buffers (as the transports use them)
    device = torch.device("cuda")
    base_src = torch.randint(-2**31, 2**31 - 1, (1 << 20,), dtype=torch.int32, device=device)
    base_dst = torch.zeros_like(base_src)
    src, dst = base_src[4:4 + 4 * 77777], base_dst[8:8 + 4 * 77777]
    sm_copy(dst, src, 16, method="tma")
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
    assert (base_dst[:8] == 0).all() and (base_dst[8 + 4 * 77777:] == 0).all()


@pytest.mark.gpu
def test_tma_copy_of_nothing_still_records_every_program():
    device = torch.device("cuda")
    trace = Trace(device)
    src = torch.empty(0, device=device)
    assert sm_copy(torch.empty(0, device=device), src, 5, trace=trace, method="tma").numel() == 0
    torch.cuda.synchronize()
    assert len(trace.records()) == 5

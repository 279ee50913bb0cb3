"""The copy-engine transport: its kernels compile for sm_90 with the PTX they need (CPU); on 2 GPUs
dispatch/combine match an independent computation from all ranks' inputs (tests/test_ep_nvlink.py's
oracle), over many rounds with different layouts."""

import re

import pytest
import torch.multiprocessing as mp

from smsplit import ptx
from smsplit.ep import copy_engine
from smsplit.launch import free_port


@pytest.mark.compile
def test_copy_engine_kernels_compile_with_their_ptx():
    text, cubin = ptx.compile_for_sm90(
        copy_engine.gate_kernel,
        {"ctx_ptr": "*i64", "R": "i32", "combine": "i32", "epoch": "i32", "T": "i32", "chunk_tokens": "i32",
         "self_start": "i32", "num_local_experts": "i32"}, num_warps=1)
    assert ptx.INSTRUCTIONS["st_release_sys"] in text and ptx.INSTRUCTIONS["ld_acquire_sys"] in text and cubin
    sig = {"x_ptr": "*i32", "topk_ptr": "*i64", "weights_ptr": "*fp32", "pos_ptr": "*i32", "ctx_ptr": "*i64",
           "recv_x": "*bf16", "recv_scales": "*fp32", "recv_topk": "*i64", "recv_weights": "*fp32",
           "recv_src": "*i32", "H": "i32", "K": "i32", "R": "i32", "trace_tag": "i32"}
    consts = {"scales_ptr": None, "GROUPS": 64, "KP": 16, "RP": 2, "trace_ptr": None}
    text, _ = ptx.compile_for_sm90(copy_engine.pack_kernel, sig, consts, num_warps=8)
    for name in ("ld_global_nc_v4", "st_global_na_v4", "st_release_sys", "fence_acq_rel_sys"):
        assert ptx.INSTRUCTIONS[name] in text, name
    assert "cvt.rn.satfinite.e4m3x2.f32" not in text  # int32 words of x: moved as they are
    text, _ = ptx.compile_for_sm90(copy_engine.pack_kernel, dict(sig, x_ptr="*bf16", recv_x="*fp8e4nv"), consts,
                                   num_warps=8)
    assert "cvt.rn.satfinite.e4m3x2.f32" in text  # a bf16 x: FP8 quantization fused into the packing
    # the e4m3 rows are packed in 16-byte stores (smsplit.ep.kernels.rows.load_tokens), not one byte at a time
    assert ptx.INSTRUCTIONS["st_global_na_v4"] in text and not re.search(r"st\.global(\.\w+)*\.b8", text)
    sig = {"y_ptr": "*bf16", "yw_ptr": "*fp32", "pos_ptr": "*i32", "ctx_ptr": "*i64", "cx_ptr": "*bf16",
           "out_ptr": "*bf16", "out_w_ptr": "*fp32", "H": "i32", "K": "i32", "R": "i32", "rank": "i32", "M": "i32",
           "trace_tag": "i32"}
    text, _ = ptx.compile_for_sm90(copy_engine.reduce_kernel, sig, {"HB": 8192, "KP": 16, "RP": 2, "trace_ptr": None},
                                   num_warps=16)
    assert ptx.INSTRUCTIONS["ld_acquire_sys"] in text and ptx.INSTRUCTIONS["st_release_sys"] in text


# --- on GPUs --------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.multigpu
def test_copy_engine_dispatch_combine_match_reference_on_two_gpus():
    from test_ep_nvlink import DISPATCH_CASES, FP8_INPUT_CASES, _worker

    cases = DISPATCH_CASES + [((5, 2), 3, False, 0)] + FP8_INPUT_CASES  # and fewer tokens than chunks
    mp.spawn(_worker, args=(2, free_port(), cases, "copy_engine"), nprocs=2, join=True)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("hidden", [2048, 7168])  # 7168: DeepSeek-V3's width
def test_buffer_copy_engine_backend_equals_reference_backend(hidden):
    from test_ep_nvlink import _buffer_worker

    mp.spawn(_buffer_worker, args=(2, free_port(), "copy_engine", hidden), nprocs=2, join=True)

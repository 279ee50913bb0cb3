"""The benchmarks' own kernels (`bench/sm_bandwidth.py`, `bench/fp8_tma_stage.py`, `bench/combine_red.py`,
`bench/combine_timeline.py`, `bench/ep_timeline.py`, `bench/nvlink_store_width.py`, `bench/nvlink_push_pull.py`, `bench/nvlink_fp8_pattern.py`,
`bench/start_together.py`, `bench/sum_l2_warm.py`) compile for sm_90 with the instructions they measure (CPU):
the rates in BENCHMARKS.md are of these instructions."""

import sys
from pathlib import Path

from smsplit import ptx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

TMA_LOAD_2D = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
TMA_LOAD_1D = "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes"


def test_sm_bandwidth_kernels_read_and_write_as_described():
    import sm_bandwidth

    text, _ = ptx.compile_for_sm90(sm_bandwidth.read_kernel, {"src": "*i32", "out": "*i32", "n_vec": "i32"},
                                   {"BLOCK": 4096}, num_warps=16, aligned=("src", "out", "n_vec"))
    assert ptx.INSTRUCTIONS["ld_global_nc_v4"] in text and "cp.async" not in text
    loads = {}
    for stages in (1, 6):
        text, _ = ptx.compile_for_sm90(sm_bandwidth.read_tma_kernel,
                                       {"src_desc": "tensordesc<i64[4096]>", "out": "*i64"},
                                       {"BLOCK": 4096, "STAGES": stages}, num_warps=4, aligned=("out",))
        loads[stages] = text.count(TMA_LOAD_1D)
    # 6 stages: the pipeline's prologue issues the next 5 tiles' loads before the loop's own (bytes in flight)
    assert loads[1] > 0 and loads[6] == 6 * loads[1] and "mbarrier.try_wait" in text
    text, _ = ptx.compile_for_sm90(sm_bandwidth.write_kernel, {"dst": "*i32", "n_vec": "i32"}, {"BLOCK": 4096},
                                   num_warps=16, aligned=("dst", "n_vec"))
    assert ptx.INSTRUCTIONS["st_global_na_v4"] in text and "ld.global" not in text


def test_tma_quantize_prototypes_load_through_tma_and_quantize_to_e4m3():
    import fp8_tma_stage

    aligned = ("pos_ptr", "dst_ptr", "scales_ptr", "T", "H", "rows_per_dest")
    sig = {"x_desc": "tensordesc<bf16[16,1024]>", "pos_ptr": "*i32", "dst_ptr": "*fp8e4nv", "scales_ptr": "*fp32",
           "T": "i32", "H": "i32", "rows_per_dest": "i32"}
    text, _ = ptx.compile_for_sm90(fp8_tma_stage.tma_stage_kernel, sig, {"R": 2, "TB": 16, "QG": 8, "STAGES": 4},
                                   num_warps=8, aligned=aligned)
    assert TMA_LOAD_2D in text and "cvt.rn.satfinite.e4m3x2.f32" in text
    sig = {"xw_desc": "tensordesc<i32[16,512]>", "x_ptr": "*bf16", "pos_ptr": "*i32", "dst_ptr": "*i32",
           "scales_ptr": "*fp32", "T": "i32", "H": "i32", "rows_per_dest": "i32"}
    text, _ = ptx.compile_for_sm90(fp8_tma_stage.tma_words_stage_kernel, sig, {"R": 2, "TB": 16, "QG": 8, "STAGES": 3},
                                   num_warps=16, aligned=aligned)
    # the staging launch's packed-word quantization, fed from shared memory, stored as 8-byte halves
    assert TMA_LOAD_2D in text and ptx.INSTRUCTIONS["e4m3x4_from_bf16x4"] in text
    assert ptx.INSTRUCTIONS["st_global_na_v2"] in text and ptx.INSTRUCTIONS["ld_global_nc_v4"] not in text


def test_combine_sum_prototypes_read_vectors_and_reduce_in_l2():
    import combine_red

    aligned = ("pos_ptr", "own_ptr", "peer_ptr", "out_ptr", "H")
    sig = {"pos_ptr": "*i32", "own_ptr": "*i32", "peer_ptr": "*i32", "out_ptr": "*i32", "T": "i32", "H": "i32"}
    text, _ = ptx.compile_for_sm90(combine_red.sum_kernel, sig, {"TB": 4, "VEC": 1024}, num_warps=16, aligned=aligned)
    assert ptx.INSTRUCTIONS["ld_global_nc_v4"] in text and ptx.INSTRUCTIONS["bf16x2_add_as_fp32"] in text
    assert ptx.INSTRUCTIONS["st_global_na_v4"] in text
    red = {k: v for k, v in sig.items() if k != "own_ptr"}
    text, _ = ptx.compile_for_sm90(combine_red.red_kernel, red, {"TB": 4, "VEC": 1024}, num_warps=16,
                                   aligned=[a for a in aligned if a != "own_ptr"])
    # the landed rows go to the L2's adder in 16-byte reductions; nothing is stored by the SM
    assert "red.global.add.noftz.v4.bf16x2" in text and "st.global" not in text


def test_combine_timeline_observer_reads_the_clock_and_spins_on_each_flag():
    import combine_timeline

    sig = {"flags_ptr": "*i32", "seen_ptr": "*i32", "out_ptr": "*i64", "peer": "i32", "R": "i32", "timeout_ns": "i64"}
    text, _ = ptx.compile_for_sm90(combine_timeline.observe_kernel, sig, {"CHUNKS": 3}, num_warps=1)
    assert text.count("ld.acquire.sys.global.b32") == 3 and text.count("%globaltimer") >= 4


def test_ep_timeline_observer_polls_the_probe_uncached_then_waits_for_the_flag():
    import ep_timeline

    sig = {"probe_ptr": "*i32", "flag_ptr": "*i32", "seen_ptr": "*i32", "out_ptr": "*i64", "timeout_ns": "i64"}
    sig["WAIT_FLAG"] = "constexpr"
    text, _ = ptx.compile_for_sm90(ep_timeline.observe_kernel, sig, {"WAIT_FLAG": True}, num_warps=1)
    assert "ld.volatile.global" in text and text.count("ld.acquire.sys.global.b32") == 1
    assert text.count("%globaltimer") >= 4
    no_flag, _ = ptx.compile_for_sm90(ep_timeline.observe_kernel, sig, {"WAIT_FLAG": False}, num_warps=1)
    assert "ld.acquire.sys.global.b32" not in no_flag


def test_store_width_kernel_stores_16_or_8_bytes_as_asked():
    import nvlink_store_width

    sig = {"src_ptr": "*i32", "peer_ptr": "*i32", "own_ptr": "*i32", "n_vec": "i32", "WIDE": "constexpr",
           "OWN": "constexpr", "BLOCK": "constexpr"}
    aligned = ["src_ptr", "peer_ptr", "own_ptr"]
    for wide in (True, False):
        for own in (False, True):
            text, _ = ptx.compile_for_sm90(nvlink_store_width.push_kernel, sig, {"WIDE": wide, "OWN": own,
                                                                                  "BLOCK": 2048},
                                           num_warps=16, aligned=aligned)
            stores = ptx.INSTRUCTIONS["st_global_na_v4" if wide else "st_global_na_v2"]
            other = ptx.INSTRUCTIONS["st_global_na_v2" if wide else "st_global_na_v4"]
            per_thread = 2048 // (32 * 16)  # vectors each thread loads per step
            assert text.count(stores) == per_thread * (1 if wide else 2) * (2 if own else 1) and other not in text
            assert ptx.INSTRUCTIONS["ld_global_nc_v4"] in text


def test_start_together_barrier_signals_every_rank_waits_for_each_and_reads_the_clock():
    import start_together

    sig = {"bases_ptr": "*i64", "round_ptr": "*i32", "missed_ptr": "*i32", "stamp_ptr": "*i64", "rank": "i32",
           "R": "i32", "timeout_ns": "i64"}
    text, _ = ptx.compile_for_sm90(start_together.barrier_kernel, sig, {}, num_warps=1)
    assert "atom.release.sys.global.add.s32" in text and "ld.acquire.sys.global.b32" in text
    # the bounded wait's two clock reads, then the exit stamp after a barrier (every thread after thread 0's waits)
    assert text.count("%globaltimer") == 3 and text.index("bar.sync") < text.rindex("%globaltimer")
    text, _ = ptx.compile_for_sm90(start_together.stamp_kernel, {"stamp_ptr": "*i64"}, {}, num_warps=1)
    assert "%globaltimer" in text


def test_push_pull_kernel_stores_into_the_peer_and_loads_from_it():
    import nvlink_push_pull

    sig = {"src_ptr": "*i32", "peer_src_ptr": "*i32", "dst_ptr": "*i32", "peer_dst_ptr": "*i32", "n_push": "i32",
           "n_vec": "i32", "BLOCK": "constexpr"}
    text, _ = ptx.compile_for_sm90(nvlink_push_pull.push_pull_kernel, sig, {"BLOCK": 2048}, num_warps=16,
                                   aligned=["src_ptr", "peer_src_ptr", "dst_ptr", "peer_dst_ptr"])
    per_thread = 2048 // (32 * 16)
    # one 16-byte load and one 16-byte store per vector of each range (pushed, pulled)
    assert text.count(ptx.INSTRUCTIONS["ld_global_nc_v4"]) == 2 * per_thread
    assert text.count(ptx.INSTRUCTIONS["st_global_na_v4"]) == 2 * per_thread


def test_fp8_pattern_kernel_stores_as_the_dispatch_does():
    import nvlink_fp8_pattern

    sig = {"x_ptr": "*bf16", "peer_ptr": "*i32", "own_ptr": "*i32", "peer_s_ptr": "*i32", "own_s_ptr": "*i32",
           "peer_m_ptr": "*i32", "own_m_ptr": "*i32", "T": "i32", "H": "i32", "WIDE": "constexpr",
           "SCALES": "constexpr", "META": "constexpr", "TB": "constexpr", "QG": "constexpr"}
    aligned = [name for name, kind in sig.items() if kind.startswith("*")] + ["H"]
    for wide in (False, True):
        text, _ = ptx.compile_for_sm90(nvlink_fp8_pattern.fp8_pattern_kernel, sig,
                                       {"WIDE": wide, "SCALES": True, "META": True, "TB": 16, "QG": 8},
                                       num_warps=16, aligned=aligned)
        # the rows: 8-byte halves or 16-byte stores, never both; scales one word at a time; no shared memory
        assert (ptx.INSTRUCTIONS["st_global_na_v4"] in text) == wide
        assert (ptx.INSTRUCTIONS["st_global_na_v2"] in text) != wide
        assert ptx.INSTRUCTIONS["st_global_b32"] in text and "bar.sync" not in text


def test_fp8_pattern_expected_rows_place_each_vector_where_the_kernel_stores_it():
    import nvlink_fp8_pattern
    import torch

    H = 256
    x = torch.arange(2 * H, dtype=torch.int16).view(torch.bfloat16).view(2, H)  # value k of a row holds k
    words = x.view(torch.int32).view(2, H // 2)
    for wide in (False, True):
        rows = nvlink_fp8_pattern.expected_rows(x, wide)
        for t in range(2):
            for g in range(H // 128):
                for j in range(8):  # thread j of group g: words 0-1 of vectors j and j + 8 (4 words each)
                    first = words[t, 64 * g + 4 * j: 64 * g + 4 * j + 2]
                    second = words[t, 64 * g + 4 * (j + 8): 64 * g + 4 * (j + 8) + 2]
                    if wide:  # 16 contiguous bytes at byte 16 j of the group's 128
                        got = rows[t, 32 * g + 4 * j: 32 * g + 4 * j + 4]
                        assert torch.equal(got, torch.cat([first, second]))
                    else:  # 8 bytes at 8 j, 8 at 64 + 8 j
                        assert torch.equal(rows[t, 32 * g + 2 * j: 32 * g + 2 * j + 2], first)
                        assert torch.equal(rows[t, 32 * g + 16 + 2 * j: 32 * g + 16 + 2 * j + 2], second)


def test_l2_warm_sum_runs_the_combines_sum_and_reads_rows_evict_last():
    import sum_l2_warm

    sig = {"pos_ptr": "*i32", "y_ptr": "*bf16", "cx_ptr": "*bf16", "out_ptr": "*bf16", "dummy_ptr": "*fp32",
           "t_begin": "i32", "t_end": "i32", "H": "i32", "slots": "i32"}
    text, _ = ptx.compile_for_sm90(sum_l2_warm.sum_range_kernel, sig, {"HB": 8192, "TB": 8}, num_warps=16,
                                   aligned=("pos_ptr", "y_ptr", "cx_ptr", "out_ptr", "H"))
    assert ptx.INSTRUCTIONS["bf16x2_add_as_fp32"] in text  # the two-rank sum of `sum_returned_rows`
    sig = {"src_ptr": "*bf16", "sink_ptr": "*fp32", "r_begin": "i32", "r_end": "i32", "H": "i32"}
    text, _ = ptx.compile_for_sm90(sum_l2_warm.touch_rows_kernel, sig, {"HB": 8192, "TB": 2}, num_warps=16,
                                   aligned=("src_ptr", "H"))
    assert "L2::evict_last" in text and "st.global" in text

"""Every inline-PTX intrinsic compiles for sm_90 and puts its instruction into the PTX."""

import pytest
import triton
import triton.language as tl

from smsplit import ptx
from smsplit.fp8 import quantize_e4m3_bf16_vector_pairs

pytestmark = pytest.mark.compile  # every test here compiles the intrinsics for sm_90 or checks them


@triton.jit
def _where_when(out):
    pid = tl.program_id(0)
    tl.store(out + 2 * pid, ptx.smid().to(tl.int64))
    tl.store(out + 2 * pid + 1, ptx.globaltimer())


@triton.jit
def _copy_v4(src, dst, n_vec, BLOCK: tl.constexpr, L1: tl.constexpr):
    """16-byte copy; L1: loads that keep their lines in L1 (`ptx.ld_global_nc_l1_v4`)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_vec
    if L1:
        w0, w1, w2, w3 = ptx.ld_global_nc_l1_v4(src + 4 * offs, mask)
    else:
        w0, w1, w2, w3 = ptx.ld_global_nc_v4(src + 4 * offs, mask)
    ptx.st_global_na_v4(dst + 4 * offs, w0, w1, w2, w3, mask)


@triton.jit
def _copy_v2(src, dst, n_vec, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_vec
    w0 = tl.load(src + 2 * offs, mask=mask)
    w1 = tl.load(src + 2 * offs + 1, mask=mask)
    ptx.st_global_na_v2(dst + 2 * offs, w0, w1, mask)


@triton.jit
def _copy_v4_evict_first(src, dst, n_vec, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_vec
    w0, w1, w2, w3 = ptx.ld_global_nc_v4_evict_first(src + 4 * offs, mask)
    ptx.st_global_na_v4_evict_first(dst + 4 * offs, w0, w1, w2, w3, mask)


@triton.jit
def _quantize_vectors(src, dst, scales, GROUPS: tl.constexpr):
    # one row of GROUPS * 128 bf16 values, two 16-byte vectors per thread, as smsplit.ep.nvlink's dispatch
    # quantizes it
    g = tl.arange(0, GROUPS)[None, :, None]
    c = tl.arange(0, 8)[None, None, :]
    a0, a1, a2, a3 = ptx.ld_global_nc_v4(src + g * 64 + 8 * c, c < 8)
    b0, b1, b2, b3 = ptx.ld_global_nc_v4(src + g * 64 + 8 * c + 4, c < 8)
    q0, q1, q2, q3, scale = quantize_e4m3_bf16_vector_pairs(a0, a1, a2, a3, b0, b1, b2, b3)
    ptx.st_global_na_v4(dst + g * 32 + 4 * c, q0, q1, q2, q3, c < 8)
    ptx.st_global_b32(scales + tl.arange(0, GROUPS)[None, :], scale, tl.arange(0, GROUPS)[None, :] < GROUPS)


@triton.jit
def _add_pairs(a, b, out, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out + i, ptx.bf16x2_add_as_fp32(tl.load(a + i), tl.load(b + i)))


@triton.jit
def _flags(flag, out):
    ptx.st_release_gpu(flag, 1)
    ptx.st_release_sys(flag + 1, 2)
    a = ptx.ld_acquire_gpu(flag)
    b = ptx.ld_acquire_sys(flag + 1)
    c = ptx.atom_add_release_gpu(flag + 2, 3)
    d = ptx.atom_add_release_sys(flag + 3, 4)
    ptx.fence_acq_rel_sys()
    ptx.fence_acq_rel_gpu()
    e = ptx.wait_geq_sys(flag + 4, 1, 1000)
    tl.debug_barrier()
    tl.store(out, a + b + c + d + e)


@pytest.fixture(scope="module")
def compiled():
    return {
        "where_when": ptx.compile_for_sm90(_where_when, {"out": "*i64"}),
        **{name: ptx.compile_for_sm90(
            _copy_v4, {"src": "*i32", "dst": "*i32", "n_vec": "i32", "BLOCK": "constexpr", "L1": "constexpr"},
            {"BLOCK": 256, "L1": l1},
        ) for name, l1 in (("copy_v4", False), ("copy_v4_l1", True))},
        "copy_v2": ptx.compile_for_sm90(
            _copy_v2, {"src": "*i32", "dst": "*i32", "n_vec": "i32", "BLOCK": "constexpr"},
            {"BLOCK": 256},
        ),
        "copy_v4_evict_first": ptx.compile_for_sm90(
            _copy_v4_evict_first, {"src": "*i32", "dst": "*i32", "n_vec": "i32", "BLOCK": "constexpr"},
            {"BLOCK": 256},
        ),
        "flags": ptx.compile_for_sm90(_flags, {"flag": "*i32", "out": "*i32"}),
        "add_pairs": ptx.compile_for_sm90(_add_pairs, {"a": "*i32", "b": "*i32", "out": "*i32", "BLOCK": "constexpr"},
                                          {"BLOCK": 256}),
        "quantize": ptx.compile_for_sm90(
            _quantize_vectors, {"src": "*i32", "dst": "*i32", "scales": "*fp32", "GROUPS": "constexpr"},
            {"GROUPS": 8},
        ),
    }


KERNEL_OF = {
    "smid": "where_when",
    "globaltimer": "where_when",
    "ld_global_nc_v4": "copy_v4",
    "ld_global_nc_l1_v4": "copy_v4_l1",
    "st_global_na_v4": "copy_v4",
    "st_global_na_v2": "copy_v2",
    "st_global_b32": "quantize",
    "ld_global_nc_v4_evict_first": "copy_v4_evict_first",
    "st_global_na_v4_evict_first": "copy_v4_evict_first",
    "ld_acquire_gpu": "flags",
    "ld_acquire_sys": "flags",
    "st_release_gpu": "flags",
    "st_release_sys": "flags",
    "atom_add_release_gpu": "flags",
    "atom_add_release_sys": "flags",
    "fence_acq_rel_sys": "flags",
    "fence_acq_rel_gpu": "flags",
    "wait_geq_sys": "flags",
    "bf16x8_absmax_bits": "quantize",
    "e4m3x4_from_bf16x4": "quantize",
    "bf16x2_add_as_fp32": "add_pairs",
}


def test_every_intrinsic_has_a_compile_check():
    assert set(KERNEL_OF) == set(ptx.INSTRUCTIONS)


@pytest.mark.parametrize("name", sorted(ptx.INSTRUCTIONS))
def test_intrinsic_reaches_ptx_and_cubin(compiled, name):
    ptx_text, cubin = compiled[KERNEL_OF[name]]
    assert ptx.INSTRUCTIONS[name] in ptx_text
    assert ".target sm_90" in ptx_text
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"


def test_wait_is_inlined_twice_without_label_clashes():
    @triton.jit
    def two_waits(flag, out):
        a = ptx.wait_geq_sys(flag, 1, 1000)
        b = ptx.wait_geq_sys(flag + 1, 2, 1000)
        tl.store(out, a + b)

    text, cubin = ptx.compile_for_sm90(two_waits, {"flag": "*i32", "out": "*i32"})
    assert text.count("nanosleep.u32") == 2 and cubin[:4] == b"\x7fELF"


def test_flag_ops_are_not_optimised_away(compiled):
    ptx_text, _ = compiled["flags"]
    # four flag stores/atomics, each exactly once, in program order
    names = ("st_release_gpu", "st_release_sys", "atom_add_release_gpu", "atom_add_release_sys")
    assert [ptx_text.count(ptx.INSTRUCTIONS[n]) for n in names] == [1, 1, 1, 1]
    order = [ptx_text.index(ptx.INSTRUCTIONS[n]) for n in names]
    assert order == sorted(order)


def test_two_bf16_summed_and_rounded_once_is_their_fp32_sum_rounded():
    """The premise of `ptx.bf16x2_add_as_fp32` (the combine's two-rank sum), checked on the CPU: the sum of two
    bf16 values rounded once to bf16 (what `add.rn.bf16x2` does; here through float64, whose 53 bits round
    innocuously) equals their fp32 sum from +0 rounded to bf16 (what the reference backend does), for random bit
    patterns and for sums that nearly tie; the +0 start is what turns -0 + -0 into +0."""
    import torch

    torch.manual_seed(0)
    n = 1 << 20
    pairs = [torch.randint(-32768, 32768, (2, n), dtype=torch.int32).to(torch.int16).view(torch.bfloat16)]
    big = (torch.randn(n) * 100).to(torch.bfloat16)
    scale = torch.ldexp(torch.ones(n), torch.randint(-30, -5, (n,))) * (torch.randint(0, 2, (n,)) * 2 - 1)
    pairs.append(torch.stack([big, (big.float() * scale).to(torch.bfloat16)]))
    pairs.append(torch.tensor([[-0.0, -0.0, 0.0], [-0.0, 0.0, -0.0]], dtype=torch.bfloat16))
    for a, b in pairs:
        once = (torch.zeros(a.shape, dtype=torch.float64) + a.double() + b.double()).to(torch.bfloat16)
        fp32 = (torch.zeros(a.shape) + a.float() + b.float()).to(torch.bfloat16)
        nan = torch.isnan(once) | torch.isnan(fp32)
        assert torch.equal(torch.isnan(once), torch.isnan(fp32))
        assert torch.equal(once.view(torch.int16)[~nan], fp32.view(torch.int16)[~nan])

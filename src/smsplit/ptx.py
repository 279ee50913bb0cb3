"""Inline PTX for smsplit's Triton kernels: the one place where PTX is written.

Every intrinsic is a ``@triton.jit`` function that works elementwise on blocks (or on scalars),
so it composes with ordinary Triton code. ``tests/test_ptx.py`` compiles a small kernel around each
one for sm_90 and checks that the instruction reaches the PTX and the cubin assembles.

Flag writes (``st_release_*``, ``atom_add_release_*``) take a scalar address and run in thread 0
of the program only, so a flag is written once per program, not once per thread. A release orders
the writing thread's own earlier accesses: put ``tl.debug_barrier()`` (``bar.sync``) before it so
that every thread's data writes are ordered before the flag. Loads run in every thread.

Memory-ordering helpers come in two scopes: ``gpu`` (other blocks on the same GPU) and ``sys``
(peers over NVLink, the host). The 16-byte accessors move four 32-bit words per element; the
address must be 16-byte aligned. ``mask`` arguments are int1/int32 blocks: where zero, the load
returns zeros and the store does nothing.
"""

import inspect

import triton
import triton.language as tl

from smsplit.versions import release

# --- where and when ----------------------------------------------------------------------------


@triton.jit
def smid():
    """Id of the SM this thread runs on (``%smid``), int32."""
    return tl.inline_asm_elementwise(
        "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def globaltimer():
    """Global nanosecond timer (``%globaltimer``), int64. Shared by all SMs of a GPU; it ticks
    in steps of about a microsecond on Hopper."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


# --- 16-byte streaming accesses ------------------------------------------------------------------


def _masked_v4_load(instruction: str, prelude: tuple = ()) -> tl.constexpr:
    """Inline PTX for a 16-byte load ``instruction`` (into ``$0..$3`` from address ``$4``) that runs where the int32
    ``$5`` is non-zero and returns zeros elsewhere (``prelude``: a register declaration, then set-up lines, placed
    after the predicate's declaration and after its setting)."""
    lines = (".reg .pred p;", *prelude[:1], "setp.ne.b32 p, $5, 0;", *prelude[1:], "mov.b32 $0, 0;", "mov.b32 $1, 0;",
             "mov.b32 $2, 0;", "mov.b32 $3, 0;", f"@p {instruction}")
    return tl.constexpr("\n        {\n" + "".join(f"        {line}\n" for line in lines) + "        }\n        ")


_LD_NC_V4 = _masked_v4_load("ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {$0, $1, $2, $3}, [$4];")
_LD_NC_L1_V4 = _masked_v4_load("ld.global.nc.L2::256B.v4.b32 {$0, $1, $2, $3}, [$4];")
_LD_NC_V4_EVICT_FIRST = _masked_v4_load(
    "ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.b32 {$0, $1, $2, $3}, [$4], policy;",
    prelude=(".reg .b64 policy;", "createpolicy.fractional.L2::evict_first.b64 policy, 1.0;"))


@triton.jit
def _ld_v4(asm: tl.constexpr, ptr, mask):
    return tl.inline_asm_elementwise(asm, "=r,=r,=r,=r,l,r", [ptr, tl.cast(mask, tl.int32)],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)


@triton.jit
def ld_global_nc_v4(ptr, mask):
    """16-byte read-only load that bypasses L1 and prefetches 256 B into L2
    (``ld.global.nc.L1::no_allocate.L2::256B.v4.b32``). ``ptr`` points at int32 words, 16-byte
    aligned. Returns four int32 blocks (the words at ptr, ptr+1, ptr+2, ptr+3)."""
    return _ld_v4(_LD_NC_V4, ptr, mask)


@triton.jit
def st_global_b32(ptr, value, mask):
    """4-byte store of an fp32 or int32 ``value`` (``st.global.b32``), in the layout its operands have: Triton
    re-lays out a ``tl.store`` for coalescing (a shared-memory round trip and two barriers when the values come from
    a reduction), inline asm it leaves alone. Returns a dummy int32 block."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .pred p;
        setp.ne.b32 p, $3, 0;
        mov.b32 $0, 0;
        @p st.global.b32 [$1], $2;
        }
        """,
        "=r,l,r,r",
        [ptr, value.to(tl.int32, bitcast=True), tl.cast(mask, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def st_global_na_v2(ptr, w0, w1, mask):
    """8-byte store that does not allocate in L1 (``st.global.L1::no_allocate.v2.b32``): for words a thread holds
    two of, where gathering four would cost a trip through shared memory. Returns a dummy int32 block."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .pred p;
        setp.ne.b32 p, $4, 0;
        mov.b32 $0, 0;
        @p st.global.L1::no_allocate.v2.b32 [$1], {$2, $3};
        }
        """,
        "=r,l,r,r,r",
        [ptr, w0, w1, tl.cast(mask, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def st_global_na_v4(ptr, w0, w1, w2, w3, mask):
    """16-byte store that does not allocate in L1 (``st.global.L1::no_allocate.v4.b32``).
    Returns a dummy int32 block (inline asm needs an output)."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .pred p;
        setp.ne.b32 p, $6, 0;
        mov.b32 $0, 0;
        @p st.global.L1::no_allocate.v4.b32 [$1], {$2, $3, $4, $5};
        }
        """,
        "=r,l,r,r,r,r,r",
        [ptr, w0, w1, w2, w3, tl.cast(mask, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def ld_global_nc_l1_v4(ptr, mask):
    """`ld_global_nc_v4` that keeps the lines in L1 (``ld.global.nc.L2::256B.v4.b32``): for two loads of a thread
    that each use half of the 32-byte sectors the other touches (adjacent 16-byte vectors per thread), the second
    is then served from L1."""
    return _ld_v4(_LD_NC_L1_V4, ptr, mask)


@triton.jit
def ld_global_nc_v4_evict_first(ptr, mask):
    """``ld_global_nc_v4`` whose lines are marked evict-first in L2 (``createpolicy`` +
    ``.L2::cache_hint``), so a streaming copy does not push a compute kernel's tiles out of L2."""
    return _ld_v4(_LD_NC_V4_EVICT_FIRST, ptr, mask)


@triton.jit
def st_global_na_v4_evict_first(ptr, w0, w1, w2, w3, mask):
    """``st_global_na_v4`` whose lines are marked evict-first in L2."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .pred p;
        .reg .b64 policy;
        setp.ne.b32 p, $6, 0;
        createpolicy.fractional.L2::evict_first.b64 policy, 1.0;
        mov.b32 $0, 0;
        @p st.global.L1::no_allocate.L2::cache_hint.v4.b32 [$1], {$2, $3, $4, $5}, policy;
        }
        """,
        "=r,l,r,r,r,r,r",
        [ptr, w0, w1, w2, w3, tl.cast(mask, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


# --- packed bf16 -> e4m3 ------------------------------------------------------------------------


@triton.jit
def bf16x8_absmax_bits(w0, w1, w2, w3):
    """The largest magnitude of the eight bf16 values in words ``w0..w3`` (two per int32 word, as a 16-byte load
    returns them), as the int32 bits of an fp32. Magnitudes of floats order as their bits, so this is integer
    arithmetic on packed halves (``and`` of the sign bits, ``max.u16x2``): 10 instructions for 8 values where
    unpacking to fp32 first costs 3 per value. A NaN comes out as a NaN bit pattern above every finite value, so
    an integer ``max`` of these bits across threads keeps it, as torch's ``amax`` does."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 a, b, c, d;
        and.b32 a, $1, 0x7fff7fff;
        and.b32 b, $2, 0x7fff7fff;
        and.b32 c, $3, 0x7fff7fff;
        and.b32 d, $4, 0x7fff7fff;
        max.u16x2 a, a, b;
        max.u16x2 c, c, d;
        max.u16x2 a, a, c;
        shl.b32 b, a, 16;
        and.b32 a, a, 0xffff0000;
        max.u32 $0, a, b;
        }
        """,
        "=r,r,r,r,r",
        [w0, w1, w2, w3],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def e4m3x4_from_bf16x4(w0, w1, scale):
    """Four bf16 values (words ``w0``, ``w1``, low half first) times the fp32 ``scale``, rounded to e4m3 with
    saturation (``cvt.rn.satfinite.e4m3x2.f32``, as Triton's and torch's casts do): one int32 word of four e4m3
    bytes in the values' order. Each product is the IEEE fp32 product of the value and ``scale``, so the bytes
    equal ``(x.float() * scale).to(float8_e4m3fn)``."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 l0, h0, l1, h1;
        .reg .f32 fl0, fh0, fl1, fh1, s;
        .reg .b16 lo, hi;
        mov.b32 s, $3;
        shl.b32 l0, $1, 16;
        and.b32 h0, $1, 0xffff0000;
        shl.b32 l1, $2, 16;
        and.b32 h1, $2, 0xffff0000;
        mov.b32 fl0, l0;
        mov.b32 fh0, h0;
        mov.b32 fl1, l1;
        mov.b32 fh1, h1;
        mul.rn.f32 fl0, fl0, s;
        mul.rn.f32 fh0, fh0, s;
        mul.rn.f32 fl1, fl1, s;
        mul.rn.f32 fh1, fh1, s;
        cvt.rn.satfinite.e4m3x2.f32 lo, fh0, fl0;
        cvt.rn.satfinite.e4m3x2.f32 hi, fh1, fl1;
        mov.b32 $0, {lo, hi};
        }
        """,
        "=r,r,r,r",
        [w0, w1, scale.to(tl.int32, bitcast=True)],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def bf16x2_add_as_fp32(a, b):
    """The sum of two packed bf16 pairs (int32 words ``a``, ``b``) as an fp32 sum from +0 rounded to bf16 gives it:
    ``(+0 + a) + b`` in ``add.rn.bf16x2``. A sum of two bf16 values rounded once to bf16 equals it rounded to fp32
    (24 bits, at least 2 * 8 + 2) and then to bf16, and starting from +0 turns a sum of two -0 into +0 as the
    fp32 accumulator does. Two instructions for two values where unpacking to fp32 takes four or more."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 z, t;
        mov.b32 z, 0;
        add.rn.bf16x2 t, z, $1;
        add.rn.bf16x2 $0, t, $2;
        }
        """,
        "=r,r,r",
        [a, b],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


# --- flags: acquire / release ----------------------------------------------------------------------


@triton.jit
def ld_acquire_gpu(ptr):
    """``ld.acquire.gpu.global.b32``: int32 load ordered before all later accesses (GPU scope)."""
    return tl.inline_asm_elementwise(
        "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def ld_acquire_sys(ptr):
    """``ld.acquire.sys.global.b32``: acquire load that also sees peers' and the host's writes."""
    return tl.inline_asm_elementwise(
        "ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1
    )


def _in_thread0(instruction: str) -> tl.constexpr:
    """Inline PTX that runs ``instruction`` (operands: ``$0`` result, ``$1`` address, ``$2`` value) in thread 0
    of the program only; every other thread returns 0."""
    return tl.constexpr("{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; mov.b32 $0, 0;\n\t"
                        f"@p {instruction} }}")


_ST_RELEASE_GPU = _in_thread0("st.release.gpu.global.b32 [$1], $2;")
_ST_RELEASE_SYS = _in_thread0("st.release.sys.global.b32 [$1], $2;")
_ATOM_ADD_RELEASE_GPU = _in_thread0("atom.release.gpu.global.add.s32 $0, [$1], $2;")
_ATOM_ADD_RELEASE_SYS = _in_thread0("atom.release.sys.global.add.s32 $0, [$1], $2;")


@triton.jit
def _thread0(asm: tl.constexpr, ptr, value):
    return tl.inline_asm_elementwise(asm, "=r,l,r", [ptr, tl.cast(value, tl.int32)], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def st_release_gpu(ptr, value):
    """``st.release.gpu.global.b32`` by thread 0: int32 store ordered after all earlier accesses (GPU scope)."""
    return _thread0(_ST_RELEASE_GPU, ptr, value)


@triton.jit
def st_release_sys(ptr, value):
    """``st.release.sys.global.b32`` by thread 0: release store visible to peers over NVLink."""
    return _thread0(_ST_RELEASE_SYS, ptr, value)


@triton.jit
def atom_add_release_gpu(ptr, value):
    """``atom.release.gpu.global.add.s32`` by thread 0; returns the old value there, 0 elsewhere."""
    return _thread0(_ATOM_ADD_RELEASE_GPU, ptr, value)


@triton.jit
def atom_add_release_sys(ptr, value):
    """``atom.release.sys.global.add.s32`` by thread 0; returns the old value there, 0 elsewhere."""
    return _thread0(_ATOM_ADD_RELEASE_SYS, ptr, value)


@triton.jit
def fence_acq_rel_sys():
    """``fence.acq_rel.sys``: orders this thread's earlier and later accesses system-wide."""
    return tl.inline_asm_elementwise(
        "fence.acq_rel.sys;\n\tmov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def fence_acq_rel_gpu():
    """``fence.acq_rel.gpu``: orders this thread's earlier and later accesses GPU-wide."""
    return tl.inline_asm_elementwise(
        "fence.acq_rel.gpu;\n\tmov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def wait_geq_sys(ptr, target, timeout_ns):
    """Spin in thread 0 until the int32 at ``ptr`` is >= ``target`` (``ld.acquire.sys`` with
    ``nanosleep`` back-off) or ``timeout_ns`` passes. Returns the last value seen in thread 0 and
    ``target`` in every other thread; follow it with ``tl.debug_barrier()`` so that the whole
    program waits for thread 0. One spinning thread per program keeps the memory system free for
    the programs still copying."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .pred is_first, done, late;
        .reg .u32 tid;
        .reg .u64 start, now, waited;
        mov.u32 tid, %tid.x;
        setp.eq.u32 is_first, tid, 0;
        mov.b32 $0, $2;
        @!is_first bra WAIT_END;
        mov.u64 start, %globaltimer;
        WAIT_LOOP:
        ld.acquire.sys.global.b32 $0, [$1];
        setp.ge.s32 done, $0, $2;
        @done bra WAIT_END;
        mov.u64 now, %globaltimer;
        sub.u64 waited, now, start;
        setp.gt.u64 late, waited, $3;
        @late bra WAIT_END;
        nanosleep.u32 32;
        bra WAIT_LOOP;
        WAIT_END:
        }
        """,
        "=r,l,r,l",
        [ptr, tl.cast(target, tl.int32), tl.cast(timeout_ns, tl.int64)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


# The instruction each intrinsic must put into the PTX (checked by the compile tests).
INSTRUCTIONS = {
    "smid": "%smid",
    "globaltimer": "%globaltimer",
    "ld_global_nc_v4": "ld.global.nc.L1::no_allocate.L2::256B.v4.b32",
    "ld_global_nc_l1_v4": "ld.global.nc.L2::256B.v4.b32",
    "st_global_na_v4": "st.global.L1::no_allocate.v4.b32",
    "st_global_na_v2": "st.global.L1::no_allocate.v2.b32",
    "st_global_b32": "@p st.global.b32",
    "ld_global_nc_v4_evict_first": "ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.b32",
    "st_global_na_v4_evict_first": "st.global.L1::no_allocate.L2::cache_hint.v4.b32",
    "bf16x8_absmax_bits": "max.u16x2",
    "e4m3x4_from_bf16x4": "cvt.rn.satfinite.e4m3x2.f32",
    "bf16x2_add_as_fp32": "add.rn.bf16x2",
    "ld_acquire_gpu": "ld.acquire.gpu.global.b32",
    "ld_acquire_sys": "ld.acquire.sys.global.b32",
    "st_release_gpu": "st.release.gpu.global.b32",
    "st_release_sys": "st.release.sys.global.b32",
    "atom_add_release_gpu": "atom.release.gpu.global.add.s32",
    "atom_add_release_sys": "atom.release.sys.global.add.s32",
    "fence_acq_rel_sys": "fence.acq_rel.sys",
    "fence_acq_rel_gpu": "fence.acq_rel.gpu",
    "wait_geq_sys": "nanosleep.u32",
}


# --- Triton versions ------------------------------------------------------------------------------
# Where a Triton release changed what smsplit's kernels or their compile checks see, the difference lives here and
# nowhere else. Each entry names the release that changed it.

TRITON = release(triton.__version__)  # (major, minor)

# Triton 3.7 writes a TMA load's shared-memory destination as the CTA's own window (``.shared::cta``, PTX 8.6+),
# where 3.6 wrote the cluster window (``.shared::cluster``); for a kernel launched without clusters both name the
# same bytes, and the load is the same bulk tensor copy completing on an mbarrier.
TMA_LOAD_1D = ("cp.async.bulk.tensor.1d.shared::cta.global.mbarrier::complete_tx::bytes" if TRITON >= (3, 7) else
               "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes")
TMA_STORE_1D = "cp.async.bulk.tensor.1d.global.shared::cta.bulk_group"

# Parts of columns in which the combine's two-rank sum (`smsplit.ep.kernels.rows.sum_returned_rows`) loads and adds its
# rows: [8, H] from each rank at 8 tokens a step, 2 x 64 words a thread of its 16 warps. In one part, the ptxas that
# Triton 3.8 runs for sm_90 (12.9) spills 84 bytes of the weighted combine, 13 reloads of them in its rows' loop,
# where 3.6's and 3.7's (ptxas 12.8) fit it in 101 registers and 3.9's (ptxas 13.4) in 124 (a spill there cost a
# weighted combine 204 -> 258 us on H200, BENCHMARKS.md session 27). In two parts (the same instructions) 3.8's fits
# it in 126. The others keep the one part measured on H200; fewer tokens a step would also fit but cost the
# combine 250 against 219 us at 4 (docs/ep.md).
ROW_PARTS = tl.constexpr(2 if TRITON == (3, 8) else 1)


def compile_for_sm90(fn, signature, constexprs=None, num_warps=4, aligned=()):
    """Compile a ``@triton.jit`` kernel for Hopper (sm_90) without a GPU.

    Returns ``(ptx, cubin)``. Used by the CPU tests to check that every kernel builds and holds the
    instructions it was written for. ``aligned``: arguments (pointers, integers) to compile as
    multiples of 16, as Triton specializes them at launch when they are. A parameter with a default
    that ``signature`` leaves out is compiled at its default, as a launch that omits it is (from
    Triton 3.8 on, a signature without it fails: ``'NoneType' object has no attribute '_unflatten_ir'``).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = inspect.signature(getattr(fn, "fn", fn)).parameters
    constexprs = dict(constexprs or {})
    for name, param in params.items():
        if name not in signature and param.default is not param.empty:
            constexprs.setdefault(name, param.default)
    signature = {name: signature.get(name, "constexpr") for name in params if name in signature or name in constexprs}
    names = list(params)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}
    )
    return compiled.asm["ptx"], compiled.asm["cubin"]

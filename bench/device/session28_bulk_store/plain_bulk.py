"""Option (a): plain @triton.jit + inline PTX.  Staging buffer = a function-scope PTX `.shared` array
declared by one inline-asm statement (no braces, so it lives at function scope and later asm statements
can name it); data written with st.shared.v4, published with fence.proxy.async.shared::cta + bar.sync,
then thread 0 issues one cp.async.bulk.global.shared::cta per token row (1 KB) to an arbitrary address,
commit_group per step, wait_group.read 1 before a buffer is reused (double buffering).

Layout of a step's tile: 16 tokens x 64 sixteen-byte vectors (words w0..w3 per vector, [TB, 64] each),
like the dispatch kernel's WIDE e4m3 vectors.
"""
import triton
import triton.language as tl

STAGE_NAME = "smsplit_bulk_stage"  # must be unique within the PTX module (one kernel per module in Triton)
STAGE_BYTES = tl.constexpr(2 * 16 * 1024)  # two buffers of 16 rows x 1 KB
_DECLARE = tl.constexpr(".shared .align 1024 .b8 smsplit_bulk_stage[%d];\n mov.b32 $0, 0;" % STAGE_BYTES.value)
_WAIT_READ_1 = tl.constexpr("""
        {
        .reg .pred p;
        .reg .b32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        @p cp.async.bulk.wait_group.read 1;
        mov.b32 $0, 0;
        }
        """)


@triton.jit
def declare_stage():
    # No braces: the declaration is at function scope of the kernel's PTX. Emitted once (outside loops).
    # A dummy output is needed (inline asm needs a result); is_pure=False keeps it.
    return tl.inline_asm_elementwise(_DECLARE, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def st_stage_v4(off, w0, w1, w2, w3):
    """16-byte st.shared of words w0..w3 at byte offset `off` of the staging array, then the proxy fence
    (generic-proxy writes -> visible to the async proxy that the bulk copy reads with)."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 a;
        mov.u32 a, smsplit_bulk_stage;
        add.u32 a, a, $1;
        st.shared.v4.b32 [a], {$2, $3, $4, $5};
        mov.b32 $0, 0;
        }
        """,
        "=r,r,r,r,r,r", [off, w0, w1, w2, w3], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_proxy_async_shared():
    return tl.inline_asm_elementwise(
        "fence.proxy.async.shared::cta;\n mov.b32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def bulk_store_row(dst, off, nbytes):
    """Thread 0 of the CTA: cp.async.bulk of `nbytes` from staging offset `off` to global address `dst`
    (int64 scalar). dst, the smem address and nbytes must be multiples of 16."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .pred p;
        .reg .b32 t, a;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        mov.u32 a, smsplit_bulk_stage;
        add.u32 a, a, $2;
        @p cp.async.bulk.global.shared::cta.bulk_group [$1], [a], $3;
        mov.b32 $0, 0;
        }
        """,
        "=r,l,r,r", [dst, off, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def bulk_commit():
    return tl.inline_asm_elementwise(
        """
        {
        .reg .pred p;
        .reg .b32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        @p cp.async.bulk.commit_group;
        mov.b32 $0, 0;
        }
        """,
        "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def bulk_wait_read_1():
    """Thread 0: wait until at most 1 of its bulk groups still reads shared memory."""
    return tl.inline_asm_elementwise(_WAIT_READ_1, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def bulk_wait_all():
    """Thread 0: wait until all its bulk groups have completed (writes performed, not only smem read)."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .pred p;
        .reg .b32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        @p cp.async.bulk.wait_group 0;
        mov.b32 $0, 0;
        }
        """,
        "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def bulk_stage_kernel(src_ptr, dst_addr_ptr, n_steps, TB: tl.constexpr, ROW_BYTES: tl.constexpr):
    """src_ptr: int32 [n_steps * TB, ROW_BYTES // 4] (stands in for the quantized words in registers);
    dst_addr_ptr: int64 [n_steps * TB] destination byte addresses (16-byte aligned, any GPU mapped here)."""
    NV: tl.constexpr = ROW_BYTES // 16
    BUF: tl.constexpr = TB * ROW_BYTES
    tl.static_assert(2 * BUF <= STAGE_BYTES)
    declare_stage()
    tok = tl.arange(0, TB)[:, None]
    vec = tl.arange(0, NV)[None, :]
    for step in range(n_steps):
        b = step % 2
        # buffer b was last read by the group committed two steps ago: keep <= 1 group pending
        bulk_wait_read_1()
        tl.debug_barrier()
        words = src_ptr + (step * TB + tok) * (ROW_BYTES // 4) + 4 * vec
        w0 = tl.load(words)
        w1 = tl.load(words + 1)
        w2 = tl.load(words + 2)
        w3 = tl.load(words + 3)
        st_stage_v4(b * BUF + tok * ROW_BYTES + vec * 16, w0, w1, w2, w3)
        fence_proxy_async_shared()
        tl.debug_barrier()
        for i in tl.static_range(TB):
            dst = tl.load(dst_addr_ptr + step * TB + i)
            bulk_store_row(dst, b * BUF + i * ROW_BYTES, ROW_BYTES)
        bulk_commit()
    bulk_wait_all()


def compile_sm90(fn, signature, constexprs, num_warps=4, aligned=()):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


if __name__ == "__main__":
    k = compile_sm90(bulk_stage_kernel, {"src_ptr": "*i32", "dst_addr_ptr": "*i64", "n_steps": "i32",
                                         "TB": "constexpr", "ROW_BYTES": "constexpr"},
                     {"TB": 16, "ROW_BYTES": 1024}, aligned=("src_ptr", "dst_addr_ptr"))
    open("/tmp/tma_proto/plain_bulk.ptx", "w").write(k.asm["ptx"])
    open("/tmp/tma_proto/plain_bulk.cubin", "wb").write(k.asm["cubin"])
    print("shared (dynamic, Triton):", k.metadata.shared, "num_warps", k.metadata.num_warps)


# ---------------------------------------------------------------------------------------------------------
# Variant 2: destination addresses as a register tensor ([TB] int64, as the dispatch kernel computes them),
# no scalar extraction: every thread holding address i writes it into a small .shared table (replicas write
# the same value), and after the barrier thread i (< TB) reads entry i and issues row i's copy itself.
# Each issuing thread commits its own bulk group; every thread runs the waits (no-op without groups).
# Address 0 = masked row (token not bound for this peer). The same staged row can be sent to several
# destinations by adding table entries (TB * RP of them).
_DECLARE2 = tl.constexpr(
    ".shared .align 1024 .b8 smsplit_bulk_stage[%d];\n"
    ".shared .align 16 .b64 smsplit_bulk_dst[%d];\n mov.b32 $0, 0;" % (STAGE_BYTES.value, 2 * 16))
_ST_DST = tl.constexpr("""
        {
        .reg .b32 a;
        mov.u32 a, smsplit_bulk_dst;
        mad.lo.u32 a, $1, 8, a;
        st.shared.b64 [a], $2;
        mov.b32 $0, 0;
        }
        """)
_ISSUE = tl.constexpr("""
        {
        .reg .pred p, q;
        .reg .b32 t, a, s;
        .reg .b64 d;
        mov.u32 t, %tid.x;
        setp.lt.u32 p, t, $2;
        mov.b64 d, 0;
        mov.u32 a, smsplit_bulk_dst;
        add.u32 s, t, $1;
        mad.lo.u32 a, s, 8, a;
        @p ld.shared.b64 d, [a];
        setp.ne.b64 q, d, 0;
        mov.u32 a, smsplit_bulk_stage;
        mad.lo.u32 s, t, $3, $4;
        add.u32 a, a, s;
        @q cp.async.bulk.global.shared::cta.bulk_group [d], [a], $3;
        @p cp.async.bulk.commit_group;
        mov.b32 $0, 0;
        }
        """)
_WAIT_READ_1_ALL = tl.constexpr("cp.async.bulk.wait_group.read 1;\n mov.b32 $0, 0;")
_WAIT_ALL_DONE = tl.constexpr("cp.async.bulk.wait_group 0;\n fence.proxy.async.global;\n mov.b32 $0, 0;")


@triton.jit
def bulk_stage_kernel2(src_ptr, dst_addr_ptr, n_steps, TB: tl.constexpr, ROW_BYTES: tl.constexpr):
    NV: tl.constexpr = ROW_BYTES // 16
    BUF: tl.constexpr = TB * ROW_BYTES
    tl.static_assert(2 * BUF <= STAGE_BYTES)
    tl.static_assert(TB <= 16)
    tl.inline_asm_elementwise(_DECLARE2, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tok = tl.arange(0, TB)[:, None]
    vec = tl.arange(0, NV)[None, :]
    for step in range(n_steps):
        b = step % 2
        tl.inline_asm_elementwise(_WAIT_READ_1_ALL, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
        words = src_ptr + (step * TB + tok) * (ROW_BYTES // 4) + 4 * vec
        w0 = tl.load(words)
        w1 = tl.load(words + 1)
        w2 = tl.load(words + 2)
        w3 = tl.load(words + 3)
        st_stage_v4(b * BUF + tok * ROW_BYTES + vec * 16, w0, w1, w2, w3)
        t1 = tl.arange(0, TB)
        dst = tl.load(dst_addr_ptr + step * TB + t1)  # [TB] int64 register tensor (0: masked)
        tl.inline_asm_elementwise(_ST_DST, "=r,r,l", [b * TB + t1, dst], dtype=tl.int32, is_pure=False, pack=1)
        fence_proxy_async_shared()
        tl.debug_barrier()
        tl.inline_asm_elementwise(_ISSUE, "=r,r,r,r,r", [b * TB, TB, ROW_BYTES, b * BUF], dtype=tl.int32,
                                  is_pure=False, pack=1)
    tl.inline_asm_elementwise(_WAIT_ALL_DONE, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()  # (then one thread may release a flag to the peer)


def build_variant2(num_warps=16):
    k = compile_sm90(bulk_stage_kernel2, {"src_ptr": "*i32", "dst_addr_ptr": "*i64", "n_steps": "i32",
                                          "TB": "constexpr", "ROW_BYTES": "constexpr"},
                     {"TB": 16, "ROW_BYTES": 1024}, num_warps=num_warps, aligned=("src_ptr", "dst_addr_ptr"))
    open("/tmp/tma_proto/plain_bulk2.ptx", "w").write(k.asm["ptx"])
    open("/tmp/tma_proto/plain_bulk2.cubin", "wb").write(k.asm["cubin"])
    return k

"""Option (b): Gluon. Registers -> shared memory (allocate_shared_memory, double-buffered [2, TB, 256] int32),
fence_async_shared + thread_barrier, then one TMA *tensor* store per token row (block [1, 256] int32 = 1 KB)
through a tensor descriptor over the destination buffer (rows of ROW_WORDS int32), at [row, chunk * 256];
tma.store_wait(TB) before a buffer is rewritten, so the previous step's TB stores stay in flight.

Two kernels:
  gluon_tma_rows_kernel     - host-side descriptor argument (a descriptor per destination buffer / peer)
  gluon_bulk_rows_kernel    - plain (non-tensor) cp.async.bulk via inline asm from a Gluon smem buffer;
                              the address comes from a function-scope PTX .shared array as in plain_bulk.py
                              (Gluon gives no way to get the address of an allocate_shared_memory buffer).
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, fence_async_shared
from triton.experimental.gluon._runtime import GluonASTSource

SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@gluon.jit
def gluon_tma_rows_kernel(dst_desc, src_ptr, rows_ptr, n_steps, chunk, TB: gl.constexpr, num_warps: gl.constexpr):
    # register layout of a [TB, 256] int32 tile: each thread 4 consecutive words (one 16-byte vector)
    reg: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[1, 32],
                                         warps_per_cta=[num_warps, 1], order=[1, 0])
    bufs = gl.allocate_shared_memory(gl.int32, [2, TB, 256], dst_desc.layout)
    tok = gl.arange(0, TB, layout=gl.SliceLayout(1, reg))[:, None]
    col = gl.arange(0, 256, layout=gl.SliceLayout(0, reg))[None, :]
    for step in range(n_steps):
        b = step % 2
        tile = gl.load(src_ptr + (step * TB + tok) * 256 + col)  # stands in for the quantized words
        # buffer b was read by the TB stores of step - 2; those of step - 1 (other buffer) may stay pending
        tma.store_wait(TB)
        gl.thread_barrier()          # (the stores were issued by one thread; everybody waits for its wait)
        buf = bufs.index(b)
        buf.store(tile)
        fence_async_shared()         # generic-proxy smem writes -> visible to the async (TMA) proxy
        gl.thread_barrier()          # all threads' writes done before the elected thread issues the copies
        for i in gl.static_range(TB):
            row = gl.load(rows_ptr + step * TB + i)
            tma.async_copy_shared_to_global(dst_desc, [row, chunk * 256], buf.slice(i, 1))
    tma.store_wait(0)


_STAGE = gl.constexpr(".shared .align 1024 .b8 smsplit_bulk_stage[32768];\n mov.b32 $0, 0;")
_BULK = gl.constexpr("""
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
        """)
_ST = gl.constexpr("""
        {
        .reg .b32 a;
        mov.u32 a, smsplit_bulk_stage;
        add.u32 a, a, $1;
        st.shared.v4.b32 [a], {$2, $3, $4, $5};
        mov.b32 $0, 0;
        }
        """)
_COMMIT = gl.constexpr("""
        {
        .reg .pred p;
        .reg .b32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        @p cp.async.bulk.commit_group;
        mov.b32 $0, 0;
        }
        """)
_WAIT1 = gl.constexpr("""
        {
        .reg .pred p;
        .reg .b32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        @p cp.async.bulk.wait_group.read 1;
        mov.b32 $0, 0;
        }
        """)
_WAIT0 = gl.constexpr("""
        {
        .reg .pred p;
        .reg .b32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        @p cp.async.bulk.wait_group 0;
        mov.b32 $0, 0;
        }
        """)


@gluon.jit
def gluon_bulk_rows_kernel(src_ptr, dst_addr_ptr, n_steps, TB: gl.constexpr, num_warps: gl.constexpr):
    """Same as plain_bulk.bulk_stage_kernel, in Gluon (explicit layouts); 16 rows of 1 KB per step."""
    reg: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[1, 32],
                                         warps_per_cta=[num_warps, 1], order=[1, 0])
    gl.inline_asm_elementwise(_STAGE, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    tok = gl.arange(0, TB, layout=gl.SliceLayout(1, reg))[:, None]
    vec = gl.arange(0, 64, layout=gl.SliceLayout(0, reg))[None, :]
    for step in range(n_steps):
        b = step % 2
        gl.inline_asm_elementwise(_WAIT1, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.thread_barrier()
        words = src_ptr + (step * TB + tok) * 256 + 4 * vec
        w0 = gl.load(words)
        w1 = gl.load(words + 1)
        w2 = gl.load(words + 2)
        w3 = gl.load(words + 3)
        gl.inline_asm_elementwise(_ST, "=r,r,r,r,r,r", [b * TB * 1024 + tok * 1024 + vec * 16, w0, w1, w2, w3],
                                  dtype=gl.int32, is_pure=False, pack=1)
        fence_async_shared()
        gl.thread_barrier()
        for i in gl.static_range(TB):
            dst = gl.load(dst_addr_ptr + step * TB + i)
            gl.inline_asm_elementwise(_BULK, "=r,l,r,r", [dst, b * TB * 1024 + i * 1024, 1024], dtype=gl.int32,
                                      is_pure=False, pack=1)
        gl.inline_asm_elementwise(_COMMIT, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise(_WAIT0, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


def compile_gluon_sm90(fn, signature, constexprs, num_warps=4, aligned=()):
    from triton.backends.compiler import GPUTarget
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn=fn, signature=signature, constexprs=dict(constexprs, num_warps=num_warps), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def show(name, k, keys=("cp.async.bulk", "fence.proxy", "bar.sync", "bra ")):
    ptx = k.asm["ptx"]
    open(f"/tmp/tma_proto/{name}.ptx", "w").write(ptx)
    open(f"/tmp/tma_proto/{name}.ttgir", "w").write(k.asm["ttgir"])
    open(f"/tmp/tma_proto/{name}.cubin", "wb").write(k.asm["cubin"])
    print(f"== {name}: .target sm_90a={'.target sm_90a' in ptx} dynamic shared={k.metadata.shared} B")
    for line in ptx.splitlines():
        s = line.strip()
        if any(x in s for x in keys):
            print("   ", s)


if __name__ == "__main__":
    desc_ty = f"tensordesc<i32[1, 256],{SMEM_LAYOUT!r}>"
    sig = {"dst_desc": desc_ty, "src_ptr": "*i32", "rows_ptr": "*i32", "n_steps": "i32", "chunk": "i32",
           "TB": "constexpr", "num_warps": "constexpr"}
    show("gluon_tma_rows", compile_gluon_sm90(gluon_tma_rows_kernel, sig, {"TB": 16}, aligned=("src_ptr",)))
    sig2 = {"src_ptr": "*i32", "dst_addr_ptr": "*i64", "n_steps": "i32", "TB": "constexpr", "num_warps": "constexpr"}
    show("gluon_bulk_rows", compile_gluon_sm90(gluon_bulk_rows_kernel, sig2, {"TB": 16},
                                               aligned=("src_ptr", "dst_addr_ptr")),
         keys=("cp.async.bulk.global", "wait_group", "commit_group", "fence.proxy", "bar.sync", "smsplit_bulk_stage["))

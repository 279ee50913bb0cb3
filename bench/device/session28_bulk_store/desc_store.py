"""Option (c): plain Triton tensor descriptors. Per-token [1, 256] int32 (1 KB) TMA stores into a 2-D
descriptor over the destination buffer (rows of ROW_WORDS int32), at [row, chunk * 256].
Question: is the TMA store wait deferred?"""
import triton
import triton.language as tl
from plain_bulk import compile_sm90


@triton.jit
def desc_store_kernel(dst_desc, src_ptr, rows_ptr, n_steps, chunk, TB: tl.constexpr):
    """Host-side descriptor (block [1, 256] int32). Token i of step s goes to row rows_ptr[s*TB+i]."""
    cols = tl.arange(0, 256)[None, :]
    for step in range(n_steps):
        for i in tl.static_range(TB):
            row = tl.load(rows_ptr + step * TB + i)
            v = tl.load(src_ptr + (step * TB + i) * 256 + cols)  # [1, 256] "quantized" words
            dst_desc.store([row, chunk * 256], v)


@triton.jit
def desc_store_pipelined_kernel(dst_desc, src_ptr, rows_ptr, n_steps, chunk, TB: tl.constexpr,
                                STAGES: tl.constexpr):
    cols = tl.arange(0, 256)[None, :]
    for step in tl.range(0, n_steps, num_stages=STAGES):
        for i in tl.static_range(TB):
            row = tl.load(rows_ptr + step * TB + i)
            v = tl.load(src_ptr + (step * TB + i) * 256 + cols)
            dst_desc.store([row, chunk * 256], v)


@triton.jit
def device_desc_kernel(dst_base_ptr, src_ptr, rows_ptr, n_rows, n_steps, chunk, ROW_WORDS: tl.constexpr,
                       TB: tl.constexpr):
    """Device-side descriptor (needs triton.set_allocator at launch: 128 B of global scratch per program)."""
    # dst_base_ptr: peer buffer base as int64 (e.g. from symmetric memory), 16-byte aligned
    base = dst_base_ptr.to(tl.pointer_type(tl.int32))
    desc = tl.make_tensor_descriptor(base, shape=[n_rows, ROW_WORDS], strides=[ROW_WORDS, 1], block_shape=[1, 256])
    cols = tl.arange(0, 256)[None, :]
    for step in range(n_steps):
        for i in tl.static_range(TB):
            row = tl.load(rows_ptr + step * TB + i)
            v = tl.load(src_ptr + (step * TB + i) * 256 + cols)
            desc.store([row, chunk * 256], v)


def show(name, k):
    ptx = k.asm["ptx"]
    open(f"/tmp/tma_proto/{name}.ptx", "w").write(ptx)
    open(f"/tmp/tma_proto/{name}.ttgir", "w").write(k.asm["ttgir"])
    print(f"== {name}: shared={k.metadata.shared} B")
    for line in ptx.splitlines():
        s = line.strip()
        if any(x in s for x in ("cp.async.bulk", "fence.proxy", "bar.sync", "tensormap", "bra ")):
            print("   ", s)


if __name__ == "__main__":
    sig = {"dst_desc": "tensordesc<i32[1, 256]>", "src_ptr": "*i32", "rows_ptr": "*i32", "n_steps": "i32",
           "chunk": "i32", "TB": "constexpr"}
    show("desc_store", compile_sm90(desc_store_kernel, sig, {"TB": 4}, aligned=("src_ptr",)))
    sig2 = dict(sig, STAGES="constexpr")
    show("desc_store_pipelined", compile_sm90(desc_store_pipelined_kernel, sig2, {"TB": 4, "STAGES": 3},
                                              aligned=("src_ptr",)))
    sig3 = {"dst_base_ptr": "i64", "src_ptr": "*i32", "rows_ptr": "*i32", "n_rows": "i32", "n_steps": "i32",
            "chunk": "i32", "ROW_WORDS": "constexpr", "TB": "constexpr"}
    show("device_desc", compile_sm90(device_desc_kernel, sig3, {"ROW_WORDS": 1792, "TB": 4}, aligned=("src_ptr",)))

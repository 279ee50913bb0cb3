"""Can a Gluon allocate_shared_memory buffer be handed to inline asm (to get its address)? (expected: no)"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from gluon_tma import compile_gluon_sm90


@gluon.jit
def addr_kernel(out_ptr, num_warps: gl.constexpr):
    lay: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    buf = gl.allocate_shared_memory(gl.int32, [256], lay)
    a = gl.inline_asm_elementwise("mov.u32 $0, $1;", "=r,r", [buf], dtype=gl.int32, is_pure=False, pack=1)
    gl.store(out_ptr, a)


if __name__ == "__main__":
    try:
        compile_gluon_sm90(addr_kernel, {"out_ptr": "*i32", "num_warps": "constexpr"}, {})
        print("compiled?!")
    except Exception as e:
        print("FAILS:", type(e).__name__, str(e).strip().splitlines()[-1][:300])

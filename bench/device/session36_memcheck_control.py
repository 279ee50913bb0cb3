"""Session 36: a positive control for compute-sanitizer memcheck on Triton kernels. One Triton kernel writes 64
elements past the end of its tensor (PyTorch's caching allocator off, so the tensor is its own allocation); under
memcheck this must be reported. Also a clean launch of the same kernel, which must not.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python3 bench/device/session36_memcheck_control.py
"""
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _fill(out_ptr, n, limit, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, 1.0, mask=offs < limit)


if __name__ == "__main__":
    n = 1 << 20
    out = torch.empty(n, device="cuda")
    overrun = len(sys.argv) > 1 and sys.argv[1] == "overrun"
    limit = n + 64 if overrun else n
    _fill[(triton.cdiv(limit, 1024),)](out, n, limit, BLOCK=1024)
    torch.cuda.synchronize()
    print("overrun" if overrun else "clean", "launch done", flush=True)

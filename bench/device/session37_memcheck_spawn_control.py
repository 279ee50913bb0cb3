"""Session 37: does compute-sanitizer (`--target-processes all`) check the processes that `torch.multiprocessing.spawn`
starts, as the Buffer workers under memcheck assume? The parent starts one spawned worker that launches
`session36_memcheck_control.py`'s Triton kernel writing 64 elements past its tensor ("overrun") or in bounds
("clean"); under memcheck the overrun must be reported.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --target-processes all \\
        python3 bench/device/session37_memcheck_spawn_control.py overrun
"""
import sys
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _worker(index: int, overrun: bool) -> None:
    import torch
    import triton

    from session36_memcheck_control import _fill

    n = 1 << 20
    out = torch.empty(n, device="cuda")
    limit = n + 64 if overrun else n
    _fill[(triton.cdiv(limit, 1024),)](out, n, limit, BLOCK=1024)
    torch.cuda.synchronize()
    print("spawned worker:", "overrun" if overrun else "clean", "launch done", flush=True)


if __name__ == "__main__":
    mp.spawn(_worker, args=(len(sys.argv) > 1 and sys.argv[1] == "overrun",), nprocs=1, join=True)

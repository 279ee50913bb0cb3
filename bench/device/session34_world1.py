"""Session 34, one GPU: tests/test_ep_nvlink.py's `_buffer_rounds_worker` (one device Buffer through rounds of other
hidden sizes, top-k, FP8 modes, num_worst_tokens, expert_alignment, inputs written late behind `previous_event`,
`async_finish`, and calls rejected between rounds) as a one-rank NCCL group, for each device backend (every token
stays on its rank: no NVLink, but the transports' kernels, copies, checks and events run).

    PYTHONPATH=src python3 bench/device/session34_world1.py [backend ...] [graph]

"graph" also runs `_buffer_graph_worker` (BF16 and FP8: captured dispatch and combine against eager calls).
"""
import sys
import time
import traceback

import torch.multiprocessing as mp

sys.path.insert(0, "tests")
from test_ep_nvlink import _buffer_graph_worker, _buffer_rounds_worker  # noqa: E402

from smsplit.ep.testing import free_port  # noqa: E402

if __name__ == "__main__":
    failed = 0
    backends = [a for a in sys.argv[1:] if a != "graph"] or ["nvlink", "nvlink_copy_engine", "copy_engine"]
    cases = [(_buffer_rounds_worker, backend) for backend in backends]
    cases += [(_buffer_graph_worker, fp8) for fp8 in (False, True)] if "graph" in sys.argv else []
    for worker, arg in cases:
        t0 = time.time()
        try:
            mp.spawn(worker, args=(1, free_port(), arg), nprocs=1, join=True)
            print(f"PASSED {worker.__name__}({arg!r}) {time.time() - t0:.1f} s", flush=True)
        except Exception:  # noqa: BLE001 - reported, then the next case
            failed += 1
            print(f"FAILED {worker.__name__}({arg!r})\n{traceback.format_exc()[-4000:]}", flush=True)
    print(f"{len(cases) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)

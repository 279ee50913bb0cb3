"""Session 32, one GPU: the 2-GPU Buffer workers of tests/test_ep_nvlink.py run as a one-rank NCCL group (every
token stays on its rank: no NVLink, but the device transports' kernels, copies, poisoning, caching, autograd and
graph capture run). The workers' top-k / routing parameters came with session32_tests.patch (merged).

    PYTHONPATH=src python3 bench/device/session32_world1.py
"""
import sys
import traceback

import torch.multiprocessing as mp

sys.path.insert(0, "tests")
from test_ep_nvlink import _buffer_graph_worker, _buffer_worker  # noqa: E402

from smsplit.ep.testing import free_port  # noqa: E402

if __name__ == "__main__":
    cases = [(_buffer_worker, (backend, hidden, topk, routing))
             for backend in ("nvlink", "nvlink_copy_engine", "copy_engine")
             for hidden, topk, routing in ((2048, 6, "random"), (7168, 9, "random"), (2048, 1, "random"),
                                           (4096, 4, "one_rank"), (2048, 8, "silent_rank"))]
    cases += [(_buffer_graph_worker, (fp8,)) for fp8 in (False, True)]
    failed = 0
    for worker, args in cases:
        try:
            mp.spawn(worker, args=(1, free_port(), *args), nprocs=1, join=True)
            print(f"PASSED {worker.__name__}{args}", flush=True)
        except Exception:  # noqa: BLE001 - reported, then the next case
            failed += 1
            print(f"FAILED {worker.__name__}{args}\n{traceback.format_exc()[-3000:]}", flush=True)
    print(f"{len(cases) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)

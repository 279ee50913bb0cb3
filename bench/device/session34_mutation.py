"""Session 34, one GPU: can `_buffer_rounds_worker` fail? Each mutation breaks one behaviour it checks, inside the
spawned rank (one-rank NCCL group, as session34_world1.py); each must make the worker fail.

    PYTHONPATH=src python3 bench/device/session34_mutation.py
"""
import sys
import traceback

import torch.multiprocessing as mp

sys.path.insert(0, "tests")
from test_ep_nvlink import _buffer_rounds_worker  # noqa: E402

from smsplit.ep.testing import free_port  # noqa: E402


def mutated_worker(rank, world, port, backend, mutation):
    import smsplit.ep.buffer as buffer_module

    if mutation == "previous_event ignored":
        buffer_module.Buffer._wait_previous = lambda self, previous_event: None
    elif mutation == "expert_alignment ignored":  # by the device backends only
        original = buffer_module.Buffer.dispatch

        def dispatch(self, *args, expert_alignment=1, **kwargs):
            if self.backend == "reference":
                kwargs["expert_alignment"] = expert_alignment
            return original(self, *args, **kwargs)
        buffer_module.Buffer.dispatch = dispatch
    _buffer_rounds_worker(rank, world, port, backend)


if __name__ == "__main__":
    caught = 0
    cases = [(b, m) for b in ("nvlink", "nvlink_copy_engine") for m in ("previous_event ignored",
                                                                      "expert_alignment ignored")]
    for backend, mutation in cases:
        try:
            mp.spawn(mutated_worker, args=(1, free_port(), backend, mutation), nprocs=1, join=True)
            print(f"NOT CAUGHT {backend}: {mutation}", flush=True)
        except Exception:  # noqa: BLE001
            caught += 1
            lines = [line for line in traceback.format_exc().splitlines() if "Error" in line or "assert" in line]
            print(f"CAUGHT {backend}: {mutation}: {' | '.join(lines[-3:])[:400]}", flush=True)
    print(f"{caught} of {len(cases)} mutations caught")

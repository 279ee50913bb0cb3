"""Runs a test module's pipeline scenarios on gloo process groups, and the helpers those scenarios share.

A test module registers its scenarios in a `Scenarios` table (name -> world size, function(rank, world) -> dict of
measurements). The first test that asks for a scenario's records spawns one process group of that world size, which
runs every scenario of that size once (spawning and importing torch costs more than most scenarios) and writes each
rank's records; later tests read them.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
import traceback
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ep_harness import spawn  # (torch.multiprocessing.spawn from a fork server: ep_harness.py)
from smsplit.launch import free_port

TIMEOUT = timedelta(seconds=60)  # a collective that a broken pipeline never joins fails the scenario, not the run


class Scenarios(Dict[str, Tuple[int, Callable]]):
    """The scenarios of the test module named ``module`` (which must keep this table as its ``SCENARIOS``, so that the
    spawned processes find it); ``before_each`` runs on every rank before each scenario."""

    def __init__(self, module: str, before_each: Optional[Callable[[], None]] = None) -> None:
        super().__init__()
        self.module, self.before_each = module, before_each
        self._results: Dict[int, List[dict]] = {}

    def add(self, name: str, world: int):
        """Decorator: register ``fn(rank, world)`` as scenario ``name`` on ``world`` ranks."""
        def register(fn):
            self[name] = (world, fn)
            return fn
        return register

    def results_for(self, world: int) -> List[dict]:
        """Every rank's records of the scenarios of ``world`` ranks (run on first use)."""
        if world not in self._results:
            with tempfile.TemporaryDirectory() as outdir:
                spawn(_worker, args=(world, free_port(), outdir, self.module), nprocs=world, join=True)
                self._results[world] = [json.load(open(os.path.join(outdir, f"rank{r}.json"))) for r in range(world)]
        return self._results[world]

    def records(self, name: str) -> List[dict]:
        """Scenario ``name``'s record on each rank; fails with the rank's traceback where it raised."""
        recs = [per_rank[name] for per_rank in self.results_for(self[name][0])]
        for r, rec in enumerate(recs):
            assert rec["ok"], f"{name} failed on rank {r}:\n{rec.get('traceback')}"
        return recs


def _worker(rank: int, world: int, port: int, outdir: str, module: str) -> None:
    torch.set_num_threads(1)
    scenarios: Scenarios = importlib.import_module(module).SCENARIOS
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    results = {}
    try:
        for name, (w, fn) in scenarios.items():
            if w != world:
                continue
            if scenarios.before_each is not None:
                scenarios.before_each()
            try:
                results[name] = {"ok": True, **fn(rank, world)}
            except Exception:  # noqa: BLE001 - recorded, then asserted by the test
                results[name] = {"ok": False, "traceback": traceback.format_exc()}
    finally:
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        try:  # leave together: a rank tearing gloo down while a peer still talks to it can abort the peer
            dist.barrier()
        except Exception:  # noqa: BLE001 - a scenario left the group unusable; its record says why
            pass
        dist.destroy_process_group()


def expect_error(fn) -> dict:
    """What ``fn()`` raised (type name, message, ``phase`` where the error has one), for a test to assert."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts the type and the message
        return {"type": type(e).__name__, "message": str(e), "phase": getattr(e, "phase", None)}
    return {"type": None, "message": ""}


def count_freed(pipe) -> dict:
    """Counts, as the pipeline releases sent outputs, those whose storage it freed and those it kept."""
    counts = {"freed": 0, "kept": 0}
    release = pipe._release_output

    def counting(key):
        outputs = pipe._outputs[key]
        release(key)
        for t in outputs:
            counts["freed" if t.numel() == 0 else "kept"] += 1
    pipe._release_output = counting
    return counts


def stage_ids(kind: str, ranks: int, rank: int) -> Tuple[int, int]:
    """The two stages ``rank`` holds: DualPipe's rank r holds r and ranks-1-r, DualPipeV's r and 2*ranks-1-r."""
    return (rank, ranks - 1 - rank) if kind == "dualpipe" else (rank, 2 * ranks - 1 - rank)

"""Exposed communication and concurrent time: the interval arithmetic against a brute-force time grid (CPU), and
piece intervals that leave out the time a stream waits for another piece (GPU)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from smsplit import intervals
from smsplit.moe.overlap import COMM, COMPUTE, Interval, PieceRunner, piece_times


def covered(sets, horizon):
    """Oracle: a boolean per unit time cell [t, t+1) of [0, horizon), True where some interval of ``sets``
    covers the whole cell (intervals have whole-number ends)."""
    grid = np.zeros(horizon, dtype=bool)
    for start, end in sets:
        grid[start:end] = True
    return grid


def random_sets(rng, n, horizon):
    starts = rng.integers(0, horizon, n)
    return [(int(s), int(min(horizon, s + rng.integers(0, horizon // 4)))) for s in starts]


@pytest.mark.parametrize("seed", range(20))
def test_union_intersection_and_alone_match_a_time_grid(seed):
    rng = np.random.default_rng(seed)
    horizon = 200
    a, b = random_sets(rng, int(rng.integers(0, 12)), horizon), random_sets(rng, int(rng.integers(0, 12)), horizon)
    grid_a, grid_b = covered(a, horizon), covered(b, horizon)
    assert intervals.measure(a) == grid_a.sum()
    assert intervals.concurrent(a, b) == (grid_a & grid_b).sum()
    assert intervals.alone(a, b) == (grid_a & ~grid_b).sum()
    assert intervals.alone(b, a) == (grid_b & ~grid_a).sum()
    merged = intervals.union(a)
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(merged, merged[1:]))  # disjoint and sorted
    assert (covered(merged, horizon) == grid_a).all()
    assert (covered(intervals.intersection(a, b), horizon) == (grid_a & grid_b)).all()


def test_hand_made_intervals():
    comm = [(0, 10), (5, 12), (20, 30)]  # covers 0-12 and 20-30
    compute = [(8, 22), (25, 26), (40, 50)]
    assert intervals.union(comm) == [(0, 12), (20, 30)]
    assert intervals.intersection(comm, compute) == [(8, 12), (20, 22), (25, 26)]
    assert intervals.concurrent(comm, compute) == 7
    assert intervals.alone(comm, compute) == 22 - 7
    assert intervals.measure([(3, 3), (4, 2)]) == 0  # empty and reversed intervals cover nothing
    assert intervals.union([(0, 5), (5, 7)]) == [(0, 7)]  # touching intervals join


def test_piece_times_counts_compute_only_inside_compute_pieces():
    # comm 0-10 ms beside compute 2-4 and 6-8: exposed 0-2, 4-6, 8-10; compute 12-20 after it
    spans = [(COMM, 0.0, 0.010), (COMPUTE, 0.002, 0.004), (COMPUTE, 0.006, 0.008), (COMPUTE, 0.012, 0.020)]
    t = piece_times(spans)
    assert t["step_s"] == pytest.approx(0.020)
    assert t["comm_s"] == pytest.approx(0.010) and t["compute_s"] == pytest.approx(0.012)
    assert t["exposed_comm_s"] == pytest.approx(0.006)
    assert t["exposed_fraction"] == pytest.approx(0.3)
    assert piece_times([])["exposed_fraction"] == 0.0
    with pytest.raises(ValueError, match="ends .* before it starts"):
        piece_times([(COMM, 2.0, 1.0)])


def test_exposed_comm_of_host_clock_intervals():
    runner = PieceRunner(record=True)
    runner.intervals = [Interval(COMPUTE, "attn", 100.0, 101.0), Interval(COMM, "dispatch", 100.5, 102.0),
                        Interval(COMPUTE, "mlp", 101.5, 103.0)]
    t = runner.exposed_comm()
    assert t["step_s"] == pytest.approx(3.0) and t["exposed_comm_s"] == pytest.approx(0.5)  # 101.0-101.5
    assert PieceRunner().exposed_comm()["step_s"] == 0.0


def test_waits_given_to_a_piece_on_a_cpu_are_ignored_and_the_piece_runs():
    runner = PieceRunner(record=True)
    chain = SimpleNamespace(event=None)
    assert runner.run(COMPUTE, "w", chain, lambda: 7, waits=(None, "not an event on a CPU")) == 7
    assert [iv.name for iv in runner.intervals] == ["w"]


# --- GPU: a compute piece that waits on a slow comm piece -----------------------------------------------------

SLEEP_CYCLES = 20_000_000  # about 10 ms at Hopper's clocks; measured below, not assumed


def _timed(stream, fn) -> float:
    """Seconds ``fn``'s work takes on ``stream``, alone on the device."""
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@pytest.mark.gpu
def test_a_compute_piece_waiting_for_a_slow_comm_piece_does_not_hide_it():
    comm_stream, compute_stream = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def gemms():
        a @ a

    gemms()  # cuBLAS set up for the compute stream before anything is timed
    _timed(compute_stream, gemms)
    sleep_s = _timed(comm_stream, lambda: torch.cuda._sleep(SLEEP_CYCLES))
    gemm_s = _timed(compute_stream, gemms)
    assert sleep_s > 3 * gemm_s, (sleep_s, gemm_s)  # the GEMMs hide only part of the comm piece

    def step(inner_wait: bool):
        runner = PieceRunner(comm_stream, compute_stream, record=True)
        b, other = SimpleNamespace(event=None), SimpleNamespace(event=None)
        torch.cuda.synchronize()
        runner.sync_in(b)
        runner.sync_in(other)
        runner.run(COMM, "slow comm (B)", b, lambda: torch.cuda._sleep(SLEEP_CYCLES))
        runner.run(COMPUTE, "GEMMs beside it (A)", other, gemms)
        if inner_wait:  # the wait issued inside the piece: its interval holds the wait
            runner.run(COMPUTE, "waits inside", other, lambda: (compute_stream.wait_event(b.event), gemms()))
        else:
            runner.run(COMPUTE, "waits for B", other, gemms, waits=(b.event,))
        return runner.exposed_comm()

    step(False)  # warm-up
    t = step(False)
    # comm alone: the sleep less the first GEMMs beside it; the second GEMMs start only once the sleep ended
    expected = sleep_s - gemm_s
    assert abs(t["exposed_comm_s"] - expected) <= 0.1 * sleep_s, (t, sleep_s, gemm_s)
    assert t["step_s"] == pytest.approx(sleep_s + gemm_s, rel=0.15)
    # The same work with the wait inside the piece counts the waiting stream as computing: nothing exposed.
    # (This is the accounting the runner avoids by issuing every wait it is given before the piece starts.)
    assert step(True)["exposed_comm_s"] <= 0.1 * sleep_s


@pytest.mark.gpu
def test_a_chained_compute_piece_starts_its_interval_after_the_comm_piece():
    comm_stream, compute_stream = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.randn(4096, 4096, device="cuda")
    sleep_s = _timed(comm_stream, lambda: torch.cuda._sleep(SLEEP_CYCLES))
    for _ in range(2):  # the second is measured
        runner = PieceRunner(comm_stream, compute_stream, record=True)
        chain = SimpleNamespace(event=None)
        torch.cuda.synchronize()
        runner.sync_in(chain)
        runner.run(COMM, "dispatch", chain, lambda: torch.cuda._sleep(SLEEP_CYCLES))
        runner.run(COMPUTE, "experts", chain, lambda: x @ x)  # waits for the dispatch (same micro-batch)
        t = runner.exposed_comm()
    assert abs(t["exposed_comm_s"] - sleep_s) <= 0.1 * sleep_s, (t, sleep_s)
    assert t["compute_s"] < 0.5 * sleep_s  # the matmul alone, not the wait before it

import pytest
import torch

from smsplit.autotune import autotune_split


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_autotune_on_cpu_raises_a_clear_error():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        autotune_split(lambda c: None, [1, 2])


@pytest.mark.gpu
def test_autotune_picks_the_fastest_and_records_failures():
    def step(cycles):
        if cycles is None:
            raise ValueError("not a split")
        torch.cuda._sleep(cycles)

    best, table = autotune_split(step, [4_000_000, None, 500_000, 2_000_000], warmup=1, iters=3)
    assert best == 500_000
    assert [row["candidate"] for row in table] == [4_000_000, None, 500_000, 2_000_000]
    assert table[1]["ms"] == float("inf") and "not a split" in table[1]["error"]
    assert table[2]["ms"] < table[3]["ms"] < table[0]["ms"]


@pytest.mark.gpu
def test_autotune_raises_when_every_candidate_fails():
    def step(_):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="every candidate failed"):
        autotune_split(step, [1, 2], warmup=0, iters=1)


@pytest.mark.parametrize("kwargs,message", [(dict(iters=0), "iters must be an int >= 1"),
                                            (dict(warmup=-1), "warmup must be an int >= 0"),
                                            (dict(iters=2.5), "iters must be an int")])
def test_bad_counts_are_refused_before_any_step_runs(kwargs, message):
    ran = []
    with pytest.raises(ValueError, match=message):
        autotune_split(ran.append, [1, 2], **kwargs)
    assert ran == []


def test_an_empty_iterable_of_candidates_is_refused():
    with pytest.raises(ValueError, match="at least one candidate"):
        autotune_split(lambda c: None, iter([]))


def test_work_left_on_other_streams_is_timed(monkeypatch):
    """A step that queues its work on other streams (a budget's, not joined back to the current stream) must be
    timed by that work. Simulated: the current stream is empty, so an event on it fires when recorded; a device
    synchronize waits for the other streams' queued work."""
    import time

    queued = [0.0]

    class CurrentStreamEvent:
        def __init__(self, **kwargs):
            pass

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    def synchronize(device=None):
        time.sleep(queued[0])
        queued[0] = 0.0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", CurrentStreamEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)

    def step(seconds):  # queues `seconds` of work on a side stream
        queued[0] += seconds

    best, table = autotune_split(step, [0.03, 0.002], warmup=0, iters=2)
    assert best == 0.002 and table[0]["ms"] > 25 > table[1]["ms"]


@pytest.mark.gpu
def test_autotune_times_work_on_a_side_stream_gpu():
    side = torch.cuda.Stream()

    def step(cycles):
        with torch.cuda.stream(side):  # not joined back to the current stream
            torch.cuda._sleep(cycles)

    best, table = autotune_split(step, [4_000_000, 500_000], warmup=1, iters=3)
    assert best == 500_000 and table[0]["ms"] > 2 * table[1]["ms"]

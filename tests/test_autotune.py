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

"""The output checks of bench/pipeline.py, bench/moe_overlap.py and bench/ep_buffer.py, the pipeline and MoE-overlap
sections of bench/tables.py, and bench/common.py's helpers (CPU): the tables are the stored results' numbers, every
schedule and check is printed, a wrong or stale result fails its check and a failed check exits non-zero."""

import contextlib
import copy
import io
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import moe_overlap  # noqa: E402
import pipeline  # noqa: E402
import tables  # noqa: E402


def printed(fn, *args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args)
    return out.getvalue()


def table_lines(text: str) -> list[str]:
    """The rows of a section's table (not those of its pictures)."""
    return [line for line in text.splitlines() if line.startswith("|") and "](bench/figures/" not in line
            and line != "| measured | simulated from the measured op times |" and line != "|---|---|"]


def stored(name: str) -> dict:
    return json.loads((ROOT / "bench" / "results" / f"{name}.json").read_text())


# ---------------------------------------------------------------------------------------------- tables


def test_pipeline_table_is_the_published_table():
    text = printed(tables.pipeline)
    published = (ROOT / "BENCHMARKS.md").read_text()
    lines = table_lines(text)
    assert len(lines) == 2 + 4  # header, rule, 4 schedules
    for line in lines:
        assert line in published, line
    assert "| smsplit DualPipeV | 308.8 | 308.8, 306.5 | 106130 | 9.32, 8.94 |" in lines
    # the bubble, measured and simulated, as the stored run has it
    assert "measured 16.90 / 19.77 ms on ranks 0 / 1, predicted 17.36 / 20.23 ms" in text
    assert "(measured / predicted 0.97 / 0.98)" in text


def test_moe_overlap_table_is_the_published_table():
    text = printed(tables.moe_overlap)
    published = (ROOT / "BENCHMARKS.md").read_text()
    lines = table_lines(text)
    assert len(lines) == 2 + 6
    for line in lines:
        assert line in published, line
    assert "| reference | 16 | 92.34 | 25.7% | 69.92 | 0.2% | 1.32x |" in lines
    assert "picked nvlink with 24 comm SMs" in text
    assert "wait for a re-run" in text
    assert "exposed 0.0% from the piece events and 0.0% from the SM trace" in text


def test_pipeline_table_prints_every_schedule_and_its_check(tmp_path, monkeypatch):
    d = stored("pipeline")
    schedules = {"smsplit.DualPipeV": d["schedules"]["smsplit.DualPipeV"],
                 "smsplit.DualPipe": {"median_ms_per_rank": [300.0, 299.54], "median_ms": 300.0,
                                      "peak_memory_gib_per_rank": [9.0, 8.5], "tokens_per_s": 109226.7},
                 "torch.ScheduleDualPipeV": {"skipped": "torch 2.4 has no ScheduleDualPipeV"}}
    checks = {"smsplit.DualPipeV": (True, 0.0, 0.0), "smsplit.DualPipe": (False, 0.0, None)}
    for name, (equal, loss, grad) in checks.items():
        schedules[name]["check"] = {"equals_reference": equal, "loss_max_rel_diff": loss, "grad_max_rel_diff": grad}
    d["schedules"] = schedules
    (tmp_path / "p.json").write_text(json.dumps(d))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    lines = table_lines(printed(tables.pipeline, "p"))
    assert lines[0].endswith("| peak memory per rank (GiB) | losses, gradients vs one process |")
    assert lines[2:5] == [
        "| smsplit DualPipeV | 308.8 | 308.8, 306.5 | 106130 | 9.32, 8.94 | equal (loss 0.0e+00, gradients 0.0e+00) |",
        "| smsplit DualPipe | 300.0 | 300.0, 299.5 | 109227 | 9.00, 8.50 | DIFFER (loss 0.0e+00, gradients inf) |",
        "| torch ScheduleDualPipeV | torch 2.4 has no ScheduleDualPipeV |  |  |  |  |",
    ]
    assert len(lines) == 2 + 3


def test_moe_overlap_table_shows_the_check(tmp_path, monkeypatch):
    d = stored("moe_overlap")
    rows = d["rows"][:2]
    rows[0].update(overlapped_equals_serial=True, check={"max_rel_diff": 0.0})
    rows[1].update(overlapped_equals_serial=False, check={"max_rel_diff": None})  # infinite: written as null
    d["rows"] = rows + [{"transport": "reference", "comm_sms": 64, "error": "SmBudgetError: too many"}]
    (tmp_path / "m.json").write_text(json.dumps(d))
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    lines = table_lines(printed(tables.moe_overlap, "m"))
    assert lines[0].endswith("| speed-up | overlapped = serial (max rel diff) |")
    assert lines[2:] == ["| 16 | 92.34 | 25.7% | 69.92 | 0.2% | 1.32x | yes (0.0e+00) |",
                         "| 24 | 88.53 | 21.5% | 69.66 | 0.0% | 1.27x | NO (inf) |",
                         "| 64 | error: SmBudgetError: too many |  |  |  |  |  |"]


# ---------------------------------------------------------------------------------------------- pipeline checks


def test_max_difference_is_absolute_and_relative_to_the_reference():
    want = torch.tensor([1.0, -4.0, 2.0])
    assert pipeline.max_difference(torch.tensor([1.0, -4.5, 2.0]), want) == (0.5, 0.125)
    assert pipeline.max_difference(torch.tensor([2.0, -8.0, 4.0]), want, scale=2.0) == (0.0, 0.0)
    assert pipeline.max_difference(want.to(torch.bfloat16), want) == (0.0, 0.0)
    for got in (None, torch.tensor([1.0, math.nan, 2.0]), torch.tensor([1.0, math.inf, 2.0]), want[:2],
                want.reshape(3, 1)):
        assert pipeline.max_difference(got, want) == (math.inf, math.inf)
    assert pipeline.max_difference(torch.tensor([0.0, 2.0 ** -10]), torch.zeros(2)) == (2.0 ** -10, math.inf)


def test_poison_grads_fills_and_drops_them():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    kept = p.grad
    pipeline.poison_grads([p])
    assert p.grad is None and torch.isnan(kept).all()


def test_stage_params_name_the_reference_blocks():
    args = SimpleNamespace(hidden=8, heads=2, blocks_per_stage=2)
    module = torch.nn.Sequential(*pipeline.make_stage(args, 2, "cpu", torch.float32),
                                 *pipeline.make_stage(args, 3, "cpu", torch.float32))
    keys = [key for key, _ in pipeline.stage_params((2, 3), module, 2)]
    assert keys[:6] == [(2, "0.norm1.weight"), (2, "0.qkv.weight"), (2, "0.proj.weight"), (2, "0.norm2.weight"),
                        (2, "0.up.weight"), (2, "0.down.weight")]
    assert [k for k in keys if k[0] == 3][0] == (3, "0.norm1.weight") and keys[-1] == (3, "1.down.weight")
    assert len(keys) == 4 * 6


def rank_check(losses=2, stages=(0, 3), loss_rel=0.0, grad_rel=1e-6, tolerance=1e-4):
    return {"losses": losses, "loss_max_abs_diff": loss_rel, "loss_max_rel_diff": loss_rel, "stages": list(stages),
            "grads": 12, "grad_max_abs_diff": grad_rel, "grad_max_rel_diff": grad_rel, "grad_scale": 1.0,
            "tolerance": tolerance}


@pytest.mark.parametrize("ranks, equal", [
    ([rank_check(), rank_check(stages=(1, 2))], True),
    ([rank_check(), rank_check(losses=0, stages=(1, 2))], False),  # one micro-batch's loss never compared
    ([rank_check(losses=4), rank_check(losses=0, stages=(1,))], False),  # stage 2's gradients never compared
    ([rank_check(), rank_check(stages=(1, 2), grad_rel=2e-4)], False),
    ([rank_check(loss_rel=math.inf), rank_check(stages=(1, 2))], False),
])
def test_merge_checks_needs_every_loss_and_stage_within_tolerance(ranks, equal):
    merged = pipeline.merge_checks(ranks, chunks=4, stages=4)
    assert merged["equals_reference"] is equal
    assert merged["grad_max_rel_diff"] == max(r["grad_max_rel_diff"] for r in ranks)
    assert merged["losses"] == sum(r["losses"] for r in ranks)


def test_pipeline_exits_non_zero_naming_the_schedules_that_differ():
    ok = {"check": {"equals_reference": True}}
    bad = {"check": {"equals_reference": False}}
    pipeline.exit_if_mismatched({"a": ok, "b": {"skipped": "no such schedule"}, "c": {"error": "x"}})
    with pytest.raises(SystemExit) as e:
        pipeline.exit_if_mismatched({"a": ok, "torch.Schedule1F1B": bad, "smsplit.DualPipe": bad})
    assert e.value.code not in (None, 0) and "torch.Schedule1F1B, smsplit.DualPipe" in str(e.value.code)


@pytest.fixture
def one_rank_check():
    """`pipeline.Check` of a two-stage model (one rank's worth) on the CPU, and a correct one-process step."""
    args = SimpleNamespace(hidden=16, heads=2, blocks_per_stage=1, seq=4, micro_batch=2, chunks=4)
    with torch.random.fork_rng():
        pipeline.set_ranks(1)
        try:
            check = pipeline.Check(args, torch.device("cpu"), torch.float32, tolerance=1e-5)
            stages = [pipeline.make_stage(args, s, "cpu", torch.float32, pipeline.Linear) for s in range(2)]
        finally:
            pipeline.set_ranks(2)
    held = [((s,), m) for s, m in enumerate(stages)]

    def step(batch, skip=None):
        losses = []
        for c, (x, y) in enumerate(zip(*(t.chunk(args.chunks) for t in batch))):
            loss = pipeline.loss_fn(stages[1](stages[0](x)), y)
            if c != skip:
                loss.backward()
            losses.append(loss.detach())
        return torch.stack(losses)

    return check, held, step


def test_check_passes_the_same_computation_and_fails_a_wrong_or_stale_one(one_rank_check):
    check, held, step = one_rank_check
    good = check.run(step, held, range(4))
    assert good["grad_max_rel_diff"] <= 1e-6 and good["loss_max_rel_diff"] <= 1e-6 and good["stages"] == [0, 1]
    assert pipeline.merge_checks([good], chunks=4, stages=2)["equals_reference"]

    wrong = check.run(lambda batch: step(batch, skip=3), held, range(4))  # one micro-batch's backward missing
    assert wrong["loss_max_rel_diff"] <= 1e-6 and wrong["grad_max_rel_diff"] > 1e-2
    assert not pipeline.merge_checks([wrong], chunks=4, stages=2)["equals_reference"]

    halved = check.run(step, held, range(4), grad_scale=0.5)  # torch's scale_grads not applied
    assert halved["grad_max_rel_diff"] == pytest.approx(1.0, rel=1e-5)

    losses = step(check.batch)  # correct gradients are in place; a step that writes none must not pass on them
    stale = check.run(lambda batch: losses, held, range(4))
    assert stale["loss_max_rel_diff"] <= 1e-6 and stale["grad_max_rel_diff"] == math.inf
    assert not pipeline.merge_checks([stale], chunks=4, stages=2)["equals_reference"]


# ---------------------------------------------------------------------------------------------- MoE overlap checks


def test_taken_copies_and_poisons_the_originals():
    a, ids = torch.arange(4.0), torch.arange(3)
    copies = moe_overlap._taken({"a": a, "none": None, "ids": ids})
    assert torch.equal(copies["a"], torch.arange(4.0)) and copies["none"] is None
    assert torch.isnan(a).all() and torch.equal(ids, torch.arange(3))  # integer tensors cannot hold NaN: kept


def outcome(out, in_grad, **grads):
    return {"output": out, "input gradient": in_grad, **{f"gradient of {k}": v for k, v in grads.items()}}


def test_differences_per_group():
    serial = outcome(torch.tensor([2.0, -4.0]), torch.tensor([1.0]), w=torch.tensor([10.0, 1.0]), b=None)
    same = moe_overlap.differences(copy.deepcopy(serial), serial)
    assert same == {group: (0.0, 0.0) for group in moe_overlap.GROUPS}
    got = outcome(torch.tensor([2.0, -3.0]), torch.tensor([1.0]), w=torch.tensor([10.0, 1.5]), b=None)
    assert moe_overlap.differences(got, serial) == {"output": (1.0, 0.25), "input gradient": (0.0, 0.0),
                                                    "parameter gradients": (0.5, 0.05)}
    for got in (outcome(serial["output"], serial["input gradient"], w=None, b=None),  # a gradient not written
                outcome(serial["output"], serial["input gradient"], w=torch.tensor([math.nan, 1.0]), b=None),
                outcome(serial["output"], serial["input gradient"], w=serial["gradient of w"]),  # b missing
                outcome(serial["output"], serial["input gradient"], w=serial["gradient of w"], b=torch.ones(1))):
        d = moe_overlap.differences(got, serial)
        assert d["parameter gradients"] == (math.inf, math.inf) and d["output"] == (0.0, 0.0)


def test_mismatched_rows_are_only_those_that_differed():
    rows = [dict(transport="reference", comm_sms=8, overlapped_equals_serial=True),
            dict(transport="reference", comm_sms=16, overlapped_equals_serial=False),
            dict(transport="nvlink", comm_sms=8, error="EPArgumentError: needs NCCL"),
            dict(transport="nvlink", comm_sms=24, overlapped_equals_serial=False)]
    assert moe_overlap.mismatched(rows) == ["reference comm_sms=16", "nvlink comm_sms=24"]


@pytest.mark.parametrize("bad", [[], ["reference comm_sms=16"]])
def test_moe_overlap_exits_non_zero_after_its_workers_report_a_mismatch(bad, monkeypatch):
    spawned = {}

    def spawn(fn, args, nprocs, join):  # the workers: rank 0 reports the rows that differed
        spawned.update(fn=fn, nprocs=nprocs)
        args[-1].put(bad)

    monkeypatch.setattr(moe_overlap.mp, "spawn", spawn)
    if not bad:
        moe_overlap.main(["--smoke"])
    else:
        with pytest.raises(SystemExit) as e:
            moe_overlap.main(["--smoke"])
        assert e.value.code not in (None, 0) and "reference comm_sms=16" in str(e.value.code)
    assert spawned == {"fn": moe_overlap._worker, "nprocs": 2}


def test_max_difference_over_several_pieces_is_that_of_the_whole():
    common = pytest.importorskip("common")
    g = torch.Generator().manual_seed(3)
    want = torch.randn(3 * (1 << 24) // 2, generator=g)  # one and a half of its pieces
    got = want.clone()
    got[(1 << 24) + 5] += 0.75  # in the second piece
    assert common.max_difference(got, want) == pytest.approx((0.75, 0.75 / want.abs().max().item()), rel=1e-6)
    got[-1] = math.nan
    assert common.max_difference(got, want) == (math.inf, math.inf)


def _ep_buffer_roundtrip(rank, world, fault):
    """bench/ep_buffer.py's `roundtrip` on a reference Buffer of a gloo group; ``fault`` breaks its combine."""
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import ep_buffer
    from common import routed_tokens

    from smsplit.ep import Buffer

    x, topk, weights, _, g = routed_tokens(rank, world, "cpu", tokens=64, hidden=256, experts=8, topk=3)
    buf = Buffer(dist.group.WORLD, 0, timeout_s=60)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, 8)
    *_, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                 num_tokens_per_expert=per_expert, topk_idx=topk, topk_weights=weights)
    if fault:
        combine = buf.combine

        def broken(y, h, **kw):
            out, *rest = combine(y, h, **kw)
            return (out.roll(1, 0) if fault == "rows" else out * 1.05, *rest)
        buf.combine = broken
    return ep_buffer.roundtrip(buf, handle, in_rank, g, x.shape, "cpu")


@pytest.mark.parametrize("fault", [None, "rows", "scale"])
def test_ep_buffer_roundtrip_passes_a_buffer_and_fails_a_broken_combine(fault):
    from ep_harness import gloo_pool

    results = gloo_pool(2).run(_ep_buffer_roundtrip, fault)
    assert results[0] == results[1]  # every rank reports every rank's worst
    if fault is None:
        assert results[0]["bf16"] and results[0]["fp8"] and results[0]["fp8_max_rel_diff"] < 1e-2
    else:
        assert not results[0]["bf16"] and not results[0]["fp8"]


def test_exit_if_roundtrips_failed_names_every_false_case_only():
    common = pytest.importorskip("common")
    rows = [{"backend": "nvlink", "comm_sms": 20, "roundtrip_equal": {"bf16": True, "fp8": True, "fp8_max_rel_diff": 0.0}},
            {"backend": "copy_engine", "comm_sms": 24,
             "roundtrip_equal": {"bf16": False, "fp8": True, "fp8_max_rel_diff": 0.5}}]
    common.exit_if_roundtrips_failed(rows[:1], "r.json", "backend")  # all equal (a 0.0 float is no failure)
    with pytest.raises(SystemExit) as e:
        common.exit_if_roundtrips_failed(rows, "r.json", "backend")
    assert str(e.value) == "round trips that did not return their tokens: copy_engine P=24: bf16 (times recorded in r.json)"


def test_sm_split_concurrent_fields_keep_ratios_and_missing_samples():
    sm_split = pytest.importorskip("sm_split")
    n, nbytes = 1000, 10 ** 6
    row = sm_split.concurrent_fields(2.0, [2.6, 2.5, 2.4], 1.0, [1.25], ["w"], n, nbytes)
    assert row["gemm_concurrent_ms"] == 2.5 and row["gemm_concurrent_samples"] == 3
    assert row["gemm_alone_tflops"] == pytest.approx(2 * n ** 3 / 2.0e-3 / 1e12)
    assert row["gemm_kept"] == pytest.approx(2.0 / 2.5) and row["copy_kept"] == pytest.approx(1.0 / 1.25)
    assert row["windows"] == ["w"]
    none = sm_split.concurrent_fields(2.0, [], 1.0, [], [], n, nbytes)
    assert none["gemm_concurrent_ms"] is none["gemm_kept"] is none["copy_concurrent_gbps"] is none["copy_kept"] is None
    assert none["gemm_concurrent_samples"] == none["copy_concurrent_samples"] == 0


def test_start_together_barrier_signals_every_rank_waits_for_each_and_reads_the_clock():
    common = pytest.importorskip("common")
    from smsplit import ptx

    sig = {"bases_ptr": "*i64", "round_ptr": "*i32", "missed_ptr": "*i32", "stamp_ptr": "*i64", "rank": "i32",
           "R": "i32", "timeout_ns": "i64"}
    text, _ = ptx.compile_for_sm90(common.barrier_kernel, sig, {}, num_warps=1)
    assert "atom.release.sys.global.add.s32" in text and "ld.acquire.sys.global.b32" in text
    # the bounded wait's two clock reads, then the exit stamp after a barrier (every thread after thread 0's waits)
    assert text.count("%globaltimer") == 3 and text.index("bar.sync") < text.rindex("%globaltimer")
    text, _ = ptx.compile_for_sm90(common.stamp_kernel, {"stamp_ptr": "*i64"}, {}, num_warps=1)
    assert "%globaltimer" in text


def test_internode_all_to_all_sends_the_hierarchical_network_leg_peer_by_peer():
    """bench/internode.py's baseline moves what the hierarchical dispatch sends across nodes: one row per token and
    other target node, to the rank of the sender's local index there (`count_node_bytes` counts the same rows)."""
    import internode

    from smsplit.nodes import NodeLayout, count_node_bytes

    g = torch.Generator().manual_seed(5)
    nodes = NodeLayout(ranks_per_node=2, num_nodes=3)
    in_rank = torch.rand(40, 6, generator=g) < 0.3
    for rank in range(6):
        splits = internode.network_splits(in_rank, rank, nodes, 10)
        assert sum(splits) == count_node_bytes(in_rank, rank, nodes, 10).internode_bytes
        for peer, size in enumerate(splits):
            if nodes.node_of(peer) == nodes.node_of(rank) or nodes.local_index(peer) != nodes.local_index(rank):
                assert size == 0
            else:
                assert size == 10 * int(in_rank[:, nodes.ranks_of_node(nodes.node_of(peer))].any(1).sum())

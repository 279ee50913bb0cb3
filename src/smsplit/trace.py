"""SM-by-time traces: where and when every thread block ran.

Our Triton kernels take a trace slice and, when tracing is on, write one record per program:
``(sm id, start ns, end ns, tag)`` read from ``%smid`` and ``%globaltimer`` (see ``ptx.py``). Kernels
we cannot instrument (cuBLAS) are covered by a *span*: a probe kernel launched on the same stream
just before and just after them records which SMs that stream can reach and when the work ran.

    trace = Trace(device="cuda")
    view, tag = trace.slots(n_programs, "copy", kind="comm")  # one record per program of the launch
    copy_kernel[(n_programs,)](..., view, tag, TRACE=True)
    with trace.span(budget.compute_stream, "gemm", kind="compute"):
        torch.matmul(a, b)
    trace.save_png("trace.png"); trace.save_chrome("trace.json")

Records can also be built from plain arrays (``Trace.from_records``) to draw or test on a CPU.
``concurrent_ns`` and ``alone_ns`` say how long two kinds of work ran at once, or one without the other.
The workload `smsplit trace` draws (a copy kernel beside cuBLAS GEMMs) is `smsplit.apps.trace.comm_beside_gemm`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from smsplit import intervals, ptx
from smsplit._args import check_int

KIND_COLOURS = {"comm": "#e4572e", "compute": "#2e86ab", "probe": "#9e9e9e", "other": "#76b041"}
RECORD_WORDS = tl.constexpr(4)  # sm, start_ns, end_ns, tag


@triton.jit
def record_block(trace_ptr, tag, start_ns):
    """Write this program's record ``(smid, start_ns, now, tag)`` at ``trace_ptr + 4 * program_id``.
    Call it last in a kernel, with ``start_ns = ptx.globaltimer()`` taken first."""
    end_ns = ptx.globaltimer()
    slot = trace_ptr + RECORD_WORDS * tl.program_id(0)
    tl.store(slot, ptx.smid().to(tl.int64))
    tl.store(slot + 1, start_ns)
    tl.store(slot + 2, end_ns)
    tl.store(slot + 3, tl.cast(tag, tl.int64))


@triton.jit(do_not_specialize=["tag"])  # a new tag id must not recompile
def _probe_kernel(trace_ptr, tag, spin_ns):
    start = ptx.globaltimer()
    now = start
    while now - start < spin_ns:
        now = ptx.globaltimer()
    record_block(trace_ptr, tag, start)


@triton.jit
def _spin_kernel(spin_ns):
    start = ptx.globaltimer()
    now = start
    while now - start < spin_ns:
        now = ptx.globaltimer()


@dataclass
class _Span:
    tag: int
    before: slice
    after: slice


class Trace:
    """Per-block records of one or more kernels on one device.

    Args:
        device: the CUDA device the kernels run on (None: records come from ``from_records``).
        capacity: records the device buffer holds; ``slots`` raises when it is full.
    """

    def __init__(self, device=None, capacity: int = 1 << 16):
        self.device = None if device is None else torch.device(device)
        self.capacity = capacity
        self.tags: list[tuple[str, str]] = []  # (name, kind), indexed by tag id
        self._buffer = None
        if self.device is not None:
            self._buffer = torch.full((capacity, int(RECORD_WORDS)), -1, dtype=torch.int64, device=self.device)
        self._used = 0
        self._spans: list[_Span] = []
        self._host_records = None

    # --- recording --------------------------------------------------------------------------------

    def tag(self, name: str, kind: str = "other") -> int:
        """Index of a (name, kind) tag, added if new. kind: comm, compute, probe or other."""
        if kind not in KIND_COLOURS:
            raise ValueError(f"kind must be one of {sorted(KIND_COLOURS)}, got {kind!r}")
        if (name, kind) not in self.tags:
            self.tags.append((name, kind))
        return self.tags.index((name, kind))

    def slots(self, n_programs: int, name: str, kind: str = "other"):
        """Reserve ``n_programs`` records for one launch; returns ``(buffer_view, tag_id)`` to pass
        to the kernel (it writes record ``program_id`` of the view)."""
        if self._buffer is None:
            raise RuntimeError("this Trace has no device buffer (made from records)")
        n_programs = check_int("n_programs", n_programs, 1)
        if self._used + n_programs > self.capacity:
            raise RuntimeError(
                f"trace buffer full: {self._used} of {self.capacity} records used, {n_programs} more "
                "asked; make the Trace with a larger capacity"
            )
        view = self._buffer[self._used : self._used + n_programs]
        self._used += n_programs
        self._host_records = None
        return view, self.tag(name, kind)

    def probe(self, stream: torch.cuda.Stream, name: str, kind: str = "probe", programs: int | None = None,
              spin_ns: int = 20_000) -> slice:
        """Launch a probe kernel on ``stream``: many short programs, each recording its SM. Returns
        the slice of records it fills. With enough programs it lands on every SM the stream can use.

        Args:
            programs: how many probe programs (default: 8 per SM of the device).
            spin_ns: how long each program spins before it records its end, in ns (long enough that the
                programs spread over the SMs instead of reusing the first ones).
        """
        if self._buffer is None:
            raise RuntimeError("this Trace has no device buffer (made from records)")
        if programs is None:
            programs = 8 * torch.cuda.get_device_properties(self.device).multi_processor_count
        start = self._used
        view, tag_id = self.slots(programs, name, kind)
        with torch.cuda.stream(stream):
            _probe_kernel[(programs,)](view, tag_id, spin_ns, num_warps=1)
        return slice(start, start + programs)

    def span(self, stream: torch.cuda.Stream, name: str, kind: str = "compute"):
        """Context manager: records the work launched on ``stream`` inside it as running on the
        SMs a probe on that stream reaches, from the probe before it ends to the probe after starts."""
        trace = self

        class _SpanContext:
            def __enter__(self_):
                self_.before = trace.probe(stream, f"{name} probe")
                return self_

            def __exit__(self_, *exc):
                after = trace.probe(stream, f"{name} probe")
                trace._spans.append(_Span(trace.tag(name, kind), self_.before, after))
                trace._host_records = None

        return _SpanContext()

    # --- reading ----------------------------------------------------------------------------------

    @classmethod
    def from_records(cls, records, tags) -> "Trace":
        """A trace from rows ``(sm, start_ns, end_ns, tag_id)`` and tags ``[(name, kind)]``."""
        trace = cls(device=None)
        trace.tags = [tuple(t) for t in tags]
        for _, kind in trace.tags:
            if kind not in KIND_COLOURS:
                raise ValueError(f"tag kind must be one of {sorted(KIND_COLOURS)}, got {kind!r}")
        given = np.asarray(records)
        if given.size == 0:
            given = given.reshape(0, int(RECORD_WORDS))
        if given.ndim != 2 or given.shape[1] != int(RECORD_WORDS):
            raise ValueError(f"records must be rows of {int(RECORD_WORDS)} values (sm, start_ns, end_ns, tag_id), "
                             f"got an array of shape {given.shape}")
        whole = np.issubdtype(given.dtype, np.integer) or (
            np.issubdtype(given.dtype, np.floating) and np.isfinite(given).all() and (given == np.round(given)).all())
        if not whole:  # (a float time in us would be cut to whole ns, silently)
            raise ValueError(f"records must hold whole numbers (SM ids, times in ns, tag ids), got {given.dtype} values "
                             "that are not")
        rows = given.astype(np.int64)
        if len(rows) and (rows[:, 3].min() < 0 or rows[:, 3].max() >= len(trace.tags)):
            raise ValueError("a record's tag id has no entry in tags")
        if len(rows) and (rows[:, 2] < rows[:, 1]).any():
            raise ValueError("a record ends before it starts")
        trace._host_records = rows
        return trace

    def records(self, reread: bool = False) -> np.ndarray:
        """All records as an int64 array ``[n, 4]`` of (sm, start_ns, end_ns, tag_id), spans
        expanded to one row per SM. Synchronizes the device the first time (later calls return what
        it read), or again with ``reread=True``: a CUDA graph replayed rewrites the same records."""
        if self._host_records is not None and (not reread or self._buffer is None):
            return self._host_records
        if self._buffer is None:  # no device and no records: nothing was traced
            return np.zeros((0, int(RECORD_WORDS)), dtype=np.int64)
        torch.cuda.synchronize(self.device)
        raw = self._buffer[: self._used].cpu().numpy()
        unwritten = (raw[:, 0] < 0).sum()
        if unwritten:
            raise RuntimeError(f"{unwritten} trace records were reserved but never written: a kernel "
                               "was launched without TRACE=True or did not run")
        rows = [raw]
        for span in self._spans:
            before, after = raw[span.before], raw[span.after]
            start, end = before[:, 2].max(), after[:, 1].min()
            sms = np.union1d(before[:, 0], after[:, 0])
            rows.append(np.stack([sms, np.full_like(sms, start), np.full_like(sms, max(end, start)),
                                  np.full_like(sms, span.tag)], axis=1))
        self._host_records = np.concatenate(rows).astype(np.int64)
        return self._host_records

    def sms(self, name: str | None = None, kind: str | None = None) -> set[int]:
        """SM ids used by records whose tag matches ``name`` and/or ``kind`` (probes excluded
        unless asked for by kind). ``kind`` must be one of the kinds tags may have."""
        if kind is not None and kind not in KIND_COLOURS:
            raise ValueError(f"kind must be one of {sorted(KIND_COLOURS)}, got {kind!r}")
        rows = self.records()
        wanted = [i for i, (n, k) in enumerate(self.tags)
                  if (name is None or n == name) and (kind is None or k == kind)
                  and (kind == "probe" or k != "probe")]
        return set(rows[np.isin(rows[:, 3], wanted)][:, 0].tolist())

    def shared_sms(self, kind_a: str = "comm", kind_b: str = "compute") -> set[int]:
        """SMs that ran both kinds of work."""
        return self.sms(kind=kind_a) & self.sms(kind=kind_b)

    def busy_intervals(self, kind: str) -> list[tuple[int, int]]:
        """``(start_ns, end_ns)`` of every record of ``kind`` (any SM), merged where they overlap: when at
        least one block (or span) of that kind was running."""
        if kind not in KIND_COLOURS:
            raise ValueError(f"kind must be one of {sorted(KIND_COLOURS)}, got {kind!r}")
        rows = self.records()
        wanted = [i for i, (_, k) in enumerate(self.tags) if k == kind]
        mine = rows[np.isin(rows[:, 3], wanted)]
        return intervals.union(zip(mine[:, 1].tolist(), mine[:, 2].tolist()))

    def busy_ns(self, kind: str) -> int:
        """Time in ns in which some record of ``kind`` was running (overlaps counted once)."""
        return intervals.measure(self.busy_intervals(kind))

    def concurrent_ns(self, kind_a: str = "comm", kind_b: str = "compute") -> int:
        """Time in ns in which work of both kinds ran at once (on any SMs)."""
        return intervals.concurrent(self.busy_intervals(kind_a), self.busy_intervals(kind_b))

    def alone_ns(self, kind_a: str = "comm", kind_b: str = "compute") -> int:
        """Time in ns in which work of ``kind_a`` ran and none of ``kind_b`` did: with the defaults, the
        exposed communication of what was traced."""
        return intervals.alone(self.busy_intervals(kind_a), self.busy_intervals(kind_b))

    def timing_line(self) -> str:
        """One line: how long comm and compute ran, at once and comm alone (ms), from the records."""
        comm, compute = self.busy_ns("comm"), self.busy_ns("compute")
        return (f"comm ran {comm / 1e6:.2f} ms, compute {compute / 1e6:.2f} ms; both at once "
                f"{self.concurrent_ns() / 1e6:.2f} ms, comm alone {self.alone_ns() / 1e6:.2f} ms")

    # --- output -----------------------------------------------------------------------------------

    def _visible(self, include_probes: bool) -> np.ndarray:
        rows = self.records()
        if include_probes:
            return rows
        probe_tags = [i for i, (_, k) in enumerate(self.tags) if k == "probe"]
        return rows[~np.isin(rows[:, 3], probe_tags)]

    def save_png(self, path, title: str | None = None, include_probes: bool = False, num_sms: int | None = None):
        """Draw an SM-by-time timeline: one row per SM, one bar per record, coloured by kind.

        Args:
            path: the PNG file to write.
            title: a first title line (the second says how many SMs each kind used and shared, the third
                how long comm and compute ran at once and comm alone: `timing_line`).
            include_probes: also draw the probe kernels' records (default False: the picture shows the work;
                `save_chrome` keeps them by default, for inspection).
            num_sms: rows to draw (the device's SM count, so idle SMs show); default: up to the highest SM
                in the records. A record on an SM at or past ``num_sms`` raises ValueError.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        rows = self._visible(include_probes)
        if len(rows) == 0:
            raise ValueError("the trace has no records to draw")
        t0 = rows[:, 1].min()
        if num_sms is not None and int(rows[:, 0].max()) >= num_sms:
            raise ValueError(f"num_sms={num_sms}: a record ran on SM {int(rows[:, 0].max())}, which would not be drawn")
        n_rows = num_sms or int(rows[:, 0].max()) + 1
        fig, ax = plt.subplots(figsize=(12, max(4.0, n_rows * 0.06)))
        for tag_id, (_, kind) in enumerate(self.tags):
            mine = rows[rows[:, 3] == tag_id]
            if len(mine) == 0:
                continue
            starts = (mine[:, 1] - t0) / 1e3
            widths = np.maximum((mine[:, 2] - mine[:, 1]) / 1e3, 1e-3)
            ax.barh(mine[:, 0], widths, left=starts, height=0.8, color=KIND_COLOURS[kind],
                    alpha=0.85, linewidth=0)
        kinds_seen = sorted({self.tags[t][1] for t in np.unique(rows[:, 3])})
        ax.legend(handles=[Patch(color=KIND_COLOURS[k], label=k) for k in kinds_seen], loc="upper right")
        ax.set_xlabel("time (us)")
        ax.set_ylabel("SM id")
        ax.set_ylim(-1, n_rows)
        ax.invert_yaxis()
        comm, compute = self.sms(kind="comm"), self.sms(kind="compute")
        subtitle = (f"comm on {len(comm)} SMs, compute on {len(compute)} SMs, "
                    f"shared {len(comm & compute)}")
        if comm and compute:
            subtitle += "\n" + self.timing_line()
        ax.set_title(f"{title}\n{subtitle}" if title else subtitle)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def to_chrome(self, include_probes: bool = True) -> dict:
        """Chrome / Perfetto trace-event JSON (one thread row per SM)."""
        rows = self._visible(include_probes)
        t0 = int(rows[:, 1].min()) if len(rows) else 0
        events = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": int(sm), "args": {"name": f"SM {int(sm):3d}"}}
            for sm in np.unique(rows[:, 0])
        ]
        for sm, start, end, tag_id in rows.tolist():
            name, kind = self.tags[tag_id]
            events.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": sm,
                           "ts": (start - t0) / 1e3, "dur": (end - start) / 1e3})
        return {"traceEvents": events, "displayTimeUnit": "ns"}

    def save_chrome(self, path, include_probes: bool = True):
        """Write `to_chrome` as JSON to ``path`` (for chrome://tracing or Perfetto; probes included by default)."""
        with open(path, "w") as f:
            json.dump(self.to_chrome(include_probes), f)

"""The header exchange through host shared memory, for ranks on one machine.

Every `Buffer` call starts with a small exchange of int64 rows between all ranks (arguments, counts, status).
Through NCCL that is a collective launch, two copies between host and device and a wait on a stream; ranks of one
machine can meet in a file in ``/dev/shm`` that every rank maps instead: each rank writes its rows into a slot of
its own and reads its peers' slots. No GPU work, no stream, a few microseconds when the ranks arrive together.

Each rank owns two slots, used in alternate rounds: ``[round, words, crc32, payload...]``. In round n a rank writes
its payload into slot n % 2, then the crc and the round word; a peer takes the payload once the round word says n
and the crc matches (the crc guards against seeing the round word before the payload on hosts that reorder
stores). A rank rewrites slot n % 2 in round n + 2 at the earliest, which it reaches only after reading every
peer's round n + 1 payload, which each peer writes only after it has read round n: a slot is never rewritten while
a peer still reads it.

The file is created by rank 0 and removed from ``/dev/shm`` as soon as every rank has mapped it (the mappings stay
valid), so nothing is left behind when a process dies.

After the slots, each rank owns an abort entry, ``[state, code, cause, nbytes, message...]``: a rank whose `Buffer`
call raises on it alone writes it once (`abort`; the state word last), and every wait for a peer reads the
entries (`failure`), so that the peers raise at once instead of at their timeout. Every rank also records, at
`connect`, each peer's process id and start time (``/proc``), so that a wait can see a peer's process end
(`ended`), which shared memory alone never shows.
"""

import mmap
import os
import secrets
import time
import zlib
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from .transport import EPError, EPTimeoutError, poll_until

SHM_DIR = "/dev/shm"
MAX_WORDS = 1 << 16  # payload capacity of a slot in int64 words (512 KiB; pages are touched only as used)
SLOT_HEAD = 3  # round, words, crc32
GAVE_UP = -2  # the words of a slot whose rank timed out waiting in that round (a late peer then raises too)
ABORT_HEAD = 4  # state (1 once written), code, cause, nbytes
ABORT_MESSAGE_WORDS = 128  # the message: up to 1 KiB of UTF-8
ABORT_WORDS = ABORT_HEAD + ABORT_MESSAGE_WORDS


class HostHeaders:
    """
    Rows exchanged through a shared file mapped by every rank of a group on one machine.

    Made by `connect`, which every rank of the group calls together; `exchange` is then called by every rank in
    the same order, like a collective.
    """

    def __init__(self, rank: int, num_ranks: int, mapping: mmap.mmap,
                 processes: Optional[List[Optional[Tuple[int, int]]]] = None) -> None:
        self.rank = rank
        self.num_ranks = num_ranks
        self._mapping = mapping
        self._words = np.frombuffer(mapping, dtype=np.int64)
        self._slot_words = SLOT_HEAD + MAX_WORDS
        self._abort_base = 2 * num_ranks * self._slot_words
        self._round = 0
        # per rank: (pid, start time) where this process can watch it (`ended`), else None
        self._processes = processes or [None] * num_ranks

    @staticmethod
    def file_bytes(num_ranks: int) -> int:
        return (2 * num_ranks * (SLOT_HEAD + MAX_WORDS) + num_ranks * ABORT_WORDS) * 8

    @classmethod
    def connect(cls, rank: int, num_ranks: int, gather: Callable[[str, torch.Tensor], torch.Tensor]) \
            -> Optional["HostHeaders"]:
        """
        Set up the shared file, or return None where the ranks cannot share one (other machines, no ``/dev/shm``,
        another user). Collective: every rank calls it with the same `gather`.

        Arguments:
            gather: `gather(what, rows)`: the group's own header exchange (`[num_ranks, width]` int64 rows, row p
                to rank p; returns row q from rank q). Called twice.
        """
        token, fd, created = 0, -1, None
        if rank == 0:
            token = secrets.randbits(62) | 1
            try:
                fd = os.open(_path(os.getpid(), token), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                created = _path(os.getpid(), token)
                os.ftruncate(fd, cls.file_bytes(num_ranks))
            except OSError:
                token = 0
        mapping = None
        try:
            first = gather("the shared header file's name",
                           torch.tensor([[os.getpid(), token, process_start(os.getpid()) or 0]] * num_ranks))
            owner_pid, token = int(first[0, 0]), int(first[0, 1])
            # a peer's process is watched where this one sees it in /proc with the start time it sent (no other
            # pid namespace, no reused pid)
            processes = [(int(pid), int(start)) if start and process_start(int(pid)) == int(start) else None
                         for pid, _, start in first.tolist()]
            try:
                if token:
                    if rank != 0:
                        fd = os.open(_path(owner_pid, token), os.O_RDWR)
                    if os.fstat(fd).st_size == cls.file_bytes(num_ranks):
                        mapping = mmap.mmap(fd, cls.file_bytes(num_ranks))
            except OSError:
                mapping = None
            finally:
                if fd >= 0:
                    os.close(fd)
            second = gather("whether each rank mapped the shared header file",
                            torch.tensor([[int(mapping is not None)]] * num_ranks))
        except BaseException:
            if mapping is not None:
                mapping.close()
            raise
        finally:
            if created is not None:  # every rank has mapped it or given up: nothing is left in /dev/shm
                try:
                    os.unlink(created)
                except OSError:
                    pass
        if not all(int(v) for v in second[:, 0].tolist()):
            if mapping is not None:
                mapping.close()
            return None
        return cls(rank, num_ranks, mapping, processes)

    def fits(self, rows: torch.Tensor) -> bool:
        return rows.numel() <= MAX_WORDS

    def exchange(self, op: str, what: str, rows: torch.Tensor, timeout_s: float,
                 watch: Optional[Callable[[List[int]], None]] = None) -> torch.Tensor:
        """
        `Transport.exchange_headers` through the file: `rows` is `[num_ranks, width]` int64 (row p for rank p);
        returns `[num_ranks, width]` int64, row q from rank q. ``watch(waiting)``, called while peers are missing
        (``waiting``: their ranks), raises to end the wait early (a peer that aborted or ended).

        Raises:
            EPTimeoutError: a peer did not write its rows within `timeout_s` (the first such peer is named).
            EPError: a peer wrote a different number of words (the ranks make different calls).
        """
        self._round += 1
        n = self._round
        if rows.dtype != torch.int64:  # (`to` costs the host a microsecond even where it has nothing to do)
            rows = rows.to(torch.int64)
        payload = np.ascontiguousarray(rows.numpy()).reshape(-1)
        words = payload.size
        own = self._slot(self.rank, n)
        self._words[own + SLOT_HEAD:own + SLOT_HEAD + words] = payload
        self._words[own + 1] = words
        self._words[own + 2] = _crc(payload, n)
        self._words[own] = n

        width = rows.size(1)
        out = np.empty((self.num_ranks, width), dtype=np.int64)  # (numpy: a tensor's row copies cost microseconds)
        out[self.rank] = payload[self.rank * width:(self.rank + 1) * width]
        waiting = [q for q in range(self.num_ranks) if q != self.rank]

        def arrived() -> bool:
            for q in list(waiting):
                got = self._read(q, n, words, op, what)
                if got is not None:
                    out[q] = got[self.rank * width:(self.rank + 1) * width]
                    waiting.remove(q)
            if waiting and watch is not None:
                watch(waiting)
            return not waiting

        if waiting and not poll_until(arrived, time.monotonic() + timeout_s):  # (one rank: no peer to wait for)
            self._words[own + 1] = GAVE_UP  # a peer that comes later finds this and raises instead of going on
            phase = f"{op}: waiting for {what} from rank {waiting[0]}"
            raise EPTimeoutError(f"{phase} (no answer within timeout_s={timeout_s:g})", waiting[0], phase)
        return torch.from_numpy(out)

    def _slot(self, rank: int, n: int) -> int:
        return ((n % 2) * self.num_ranks + rank) * self._slot_words

    def _read(self, q: int, n: int, words: int, op: str, what: str) -> Optional[np.ndarray]:
        slot = self._slot(q, n)
        if int(self._words[slot]) != n:
            return None
        sent = int(self._words[slot + 1])
        if sent == GAVE_UP:
            phase = f"{op}: exchanging {what}"
            raise EPTimeoutError(f"{phase}: rank {q} timed out waiting for this rank (rank {self.rank}) in this call "
                                 f"before it arrived; the buffer is unusable", q, phase)
        if not 0 <= sent <= MAX_WORDS:
            return None  # not all of the slot's stores are visible yet
        payload = self._words[slot + SLOT_HEAD:slot + SLOT_HEAD + sent].copy()
        if _crc(payload, n) != int(self._words[slot + 2]):
            return None
        if sent != words:
            raise EPError(f"{op}: rank {q} sent {sent} words of {what} where rank {self.rank} sent {words}; every "
                          f"rank must make the same Buffer calls in the same order")
        return payload


    # -- aborts and ended processes ------------------------------------------------------------------------

    def _entry(self, rank: int) -> int:
        return self._abort_base + rank * ABORT_WORDS

    def abort(self, code: int, cause: int, message: str) -> None:
        """Write this rank's abort entry, once (later calls keep the first): ``code`` (the caller's measure of how
        far this rank got, see `ReferenceTransport.abort`), ``cause`` (the rank whose error it is), ``message``."""
        own = self._entry(self.rank)
        if self._words[own]:
            return
        data = message.encode("utf-8", "replace")[:ABORT_MESSAGE_WORDS * 8]
        padded = np.frombuffer(data.ljust(-(-len(data) // 8) * 8, b"\0"), dtype=np.int64)
        self._words[own + ABORT_HEAD:own + ABORT_HEAD + padded.size] = padded
        self._words[own + 1:own + ABORT_HEAD] = (code, cause, len(data))
        self._words[own] = 1  # last: a reader that sees it sees the rest on x86 (stores in order); a host that
        # reorders stores may show a peer the entry before its words, which costs the message, not the abort

    def failure(self, rank: int) -> Optional[Tuple[int, int, str]]:
        """Rank ``rank``'s abort entry ``(code, cause, message)``, or None if it has written none."""
        entry = self._entry(rank)
        if not self._words[entry]:
            return None
        code, cause, nbytes = (int(v) for v in self._words[entry + 1:entry + ABORT_HEAD])
        nbytes = min(max(nbytes, 0), ABORT_MESSAGE_WORDS * 8)
        data = self._words[entry + ABORT_HEAD:entry + ABORT_HEAD + -(-nbytes // 8)].tobytes()[:nbytes]
        return code, cause, data.decode("utf-8", "replace")

    def ended(self, rank: int) -> Optional[int]:
        """The process id of rank ``rank`` if its process has ended (it can be watched: see `connect`), else None."""
        process = self._processes[rank]
        if process is None or rank == self.rank:
            return None
        pid, start = process
        return pid if process_start(pid) != start else None


def process_start(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat``), or None where it is not running
    (ended, a zombie its parent has not reaped yet, in another pid namespace, no ``/proc``). A pid and its start time
    name one process: pids are reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()  # from field 3, after the command's ")"
        return None if fields[0] in (b"Z", b"X") else int(fields[19])  # state (field 3), start time (field 22)
    except (OSError, ValueError, IndexError):
        return None


def _crc(payload: np.ndarray, n: int) -> int:
    return zlib.crc32(payload.tobytes(), (n * 0x9E3779B1 + payload.size) & 0xFFFFFFFF)


def _path(pid: int, token: int) -> str:
    return os.path.join(SHM_DIR, f"smsplit-ep-{pid}-{token:x}")

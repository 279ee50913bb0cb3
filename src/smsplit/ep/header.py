"""The header every `Buffer` call exchanges before any token moves: one int64 row per rank, which every rank sends to
every rank, and the verdict every rank reaches from the same rows (`agree`).

A row: `HEADER_WORDS` fixed words (the operation, the call's number, a status, the arguments that must agree, the SM
count) followed by `num_ranks` words, the sender's tokens per destination rank (an uncached dispatch's counts).
"""

import functools
import operator
from typing import List, Optional

import numpy as np
import torch

from .transport import EPAbortError, EPArgumentError, EPError, on_every_rank, reject

OP_INIT, OP_DISPATCH, OP_COMBINE = 1, 2, 3
OP_NAMES = {OP_INIT: "init", OP_DISPATCH: "dispatch", OP_COMBINE: "combine"}
(H_OP, H_ROUND, H_STATUS, H_NUM_TOKENS, H_NUM_EXPERTS, H_HIDDEN, H_DTYPE, H_NUM_TOPK, H_FLAGS,
 H_NUM_WORST, H_NVL_BYTES, H_HANDLE, H_NUM_SMS) = range(13)  # (in this order: the fills store adjacent words at once)
HEADER_WORDS = 13  # followed by num_ranks words: the sender's num_tokens_per_rank
# the words `agree` needs equal on every rank (op, round and status first)
AGREED_WORDS = operator.itemgetter(H_OP, H_ROUND, H_STATUS, H_HIDDEN, H_DTYPE, H_FLAGS, H_NUM_TOPK, H_NUM_EXPERTS,
                                   H_HANDLE, H_NUM_SMS)
FLAG_SCALES, FLAG_TOPK_IDX, FLAG_TOPK_WEIGHTS, FLAG_CACHED, FLAG_BIAS = 1, 2, 4, 8, 16
DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float8_e4m3fn: 4}

# Status word: 0 = arguments fine, else 1 + the index of the rejected argument here.
ARGUMENTS = ("x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
             "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens",
             "previous_event", "fp8", "dequantize", "bias", "num_nvl_bytes", "group", "backend", "num_sms",
             "num_rdma_bytes", "low_latency_mode", "config", "timeout_s", "ranks_per_node")
STATUS_TRANSPORT_FAILED = 1000  # a GPU kernel of this rank recorded a timeout; every rank raises EPError


def status_code(error: EPArgumentError) -> int:
    return 1 + (ARGUMENTS.index(error.argument) if error.argument in ARGUMENTS else len(ARGUMENTS))


def new_header(num_ranks: int, op: int, round_: int, failed: bool) -> np.ndarray:
    """A call's header rows, one per rank (numpy: filling a tensor's columns costs microseconds each); ``failed``:
    a kernel of this rank recorded a timeout (every rank then raises `EPError`)."""
    header = np.zeros((num_ranks, HEADER_WORDS + num_ranks), dtype=np.int64)
    header[:, H_OP:H_STATUS + 1] = (op, round_, STATUS_TRANSPORT_FAILED if failed else 0)  # (one column store)
    return header


def init_header(header: np.ndarray, num_nvl_bytes: int, num_sms: int, backend_code: int,
                error: Optional[EPArgumentError]) -> np.ndarray:
    """The constructor's words: `num_nvl_bytes`, the SM count (`H_NUM_SMS`, as in every call's header), the backend
    (its index in the registry's names, in `H_FLAGS`), and the status of this rank's arguments."""
    header[:, H_NVL_BYTES] = num_nvl_bytes if error is None else 0
    header[:, H_NUM_SMS] = num_sms if error is None else 0
    header[:, H_FLAGS] = backend_code
    if error is not None:
        header[:, H_STATUS] = status_code(error)
    return header


def fill_dispatch(header: np.ndarray, spec, handle, sms: int) -> None:
    """A dispatch's words: its `checks.DispatchSpec`, the call number of its handle (0: none) and its SM count."""
    # (the words H_NUM_TOKENS .. H_NUM_SMS are adjacent: one store, where one per word costs a microsecond each; a
    # dispatch carries no buffer size)
    dtype = DTYPE_CODES[spec.values.dtype] if spec.values is not None else 0
    header[:, H_NUM_TOKENS:H_NUM_SMS + 1] = (spec.num_tokens, spec.num_experts, spec.hidden, dtype, spec.num_topk,
                                             spec.flags, spec.num_worst_tokens, 0,
                                             handle.round if handle is not None else 0, sms)
    if spec.host_layout is not None:
        header[:, HEADER_WORDS:] = spec.host_layout["num_tokens_per_rank"]

def fill_combine(header: np.ndarray, x, handle, topk_weights, sms: int) -> None:
    """A combine's words."""
    header[:, H_HANDLE:H_NUM_SMS + 1] = (handle.round, sms)  # (adjacent words: one store each, see fill_dispatch)
    if x is not None:
        header[:, H_HIDDEN:H_DTYPE + 1] = (x.size(1), DTYPE_CODES[x.dtype])
    header[:, H_NUM_TOPK:H_FLAGS + 1] = ((topk_weights.size(1), FLAG_TOPK_WEIGHTS) if topk_weights is not None
                                          else (-1, 0))


INIT_AGREED = ((H_NVL_BYTES, "num_nvl_bytes", "num_nvl_bytes"), (H_FLAGS, "backend", "backend"),
               (H_NUM_SMS, "num_sms", "num_sms (or budget.comm_sms)"))


def agree_init(rows: List[List[int]], backend_names) -> None:
    """The constructor's words must be the same on every rank (the device kernels wait for as many programs from
    each peer as they run themselves)."""
    for word, argument, what in INIT_AGREED:
        values = [row[word] for row in rows]
        if len(set(values)) != 1:
            shown = [backend_names[v] for v in values] if word == H_FLAGS else values
            raise reject(argument, f"{what} must be the same on every rank, got {shown}")


def agree(op: int, round_: int, rank: int, rows: List[List[int]], own_error: Optional[EPArgumentError],
          own_failure: Optional[str], control) -> None:
    """
    The verdict on a call's headers (``rows``: row q from rank q, as Python ints), the same on every rank since
    every rank sees the same rows: ranks out of step (`EPError`; ``control``, the header transport, is marked
    failed), a kernel's earlier timeout on some rank (`EPError`), an argument rejected on some rank or arguments that
    differ between ranks (`EPArgumentError` naming it, on every rank).
    """
    first = AGREED_WORDS(rows[0])
    if own_error is None and first[:3] == (op, round_, 0) and all(AGREED_WORDS(row) == first for row in rows):
        return  # every rank made this call with arguments that agree: what the checks below find, sooner
    name = OP_NAMES[op]
    for r, row in enumerate(rows):
        if row[H_OP] != op or row[H_ROUND] != round_:
            control.failure = "ranks out of step"
            raise EPError(f"{name}: rank {r} is in {OP_NAMES.get(row[H_OP], '?')} call #{row[H_ROUND]} while rank "
                          f"{rank} is in {name} call #{round_}; every rank must make the same Buffer calls in the "
                          f"same order")
    failed = [r for r, row in enumerate(rows) if row[H_STATUS] == STATUS_TRANSPORT_FAILED]
    if failed:
        control.failure = f"a device kernel failed on rank {failed[0]}"
        here = f" (here: {own_failure})" if own_failure else ""
        raise EPError(f"{name}: a device kernel of rank(s) {failed} timed out in an earlier call{here}; this buffer "
                      f"is unusable, make a new group and Buffer")
    if own_error is not None:
        raise on_every_rank(own_error)
    for r, row in enumerate(rows):
        status = row[H_STATUS]
        if status:
            argument = ARGUMENTS[status - 1] if status <= len(ARGUMENTS) else "arguments"
            raise on_every_rank(reject(argument, f"rejected on rank {r} (that rank's error says why); {name} did "
                                                 f"not start"))
    if op == OP_INIT:
        return
    checks = [(H_FLAGS, FLAG_CACHED, "handle", "the cached mode (handle=)"),
              (H_HIDDEN, None, "x", "the hidden size"), (H_DTYPE, None, "x", "the dtype"),
              (H_FLAGS, FLAG_SCALES, "fp8", "FP8 on the wire"),
              (H_FLAGS, FLAG_TOPK_IDX, "topk_idx", "whether topk_idx is given"),
              (H_FLAGS, FLAG_TOPK_WEIGHTS, "topk_weights", "whether topk_weights is given"),
              # (a combine's num_topk is its topk_weights' width)
              (H_NUM_TOPK, None, "topk_idx" if op == OP_DISPATCH else "topk_weights", "num_topk")]
    if op == OP_DISPATCH:
        checks.append((H_NUM_EXPERTS, None, "num_tokens_per_expert", "num_experts"))
    # the handle of a cached dispatch or a combine: made by the same dispatch call on every rank
    checks.append((H_HANDLE, None, "handle", "the dispatch call that made the handle (call numbers)"))
    # the device kernels of every rank wait for the same number of programs from each peer
    checks.append((H_NUM_SMS, None, "config", "the SM count (config.num_sms, or Buffer.set_num_sms)"))
    for word, mask, argument, what in checks:
        values = [row[word] if mask is None else row[word] & mask for row in rows]
        if len(set(values)) != 1:
            raise on_every_rank(reject(argument, f"{what} differs between ranks: {values} on ranks "
                                                 f"0..{len(rows) - 1}"))


def aborts(method):
    """
    Make the `Buffer` call ``method`` (its buffer's ``transport``: the header transport, which carries the aborts) abort the buffer when it raises an error of this rank's own: the peers' waits
    then raise `EPAbortError` at once, naming this rank and the error, instead of `EPTimeoutError` at `timeout_s`,
    and this buffer refuses every later call. Not an error that every rank raises with it (`on_every_rank`), nor one
    of a wait for a peer (a timeout, a lost peer, ranks out of step: the transport records it as its failure, and the
    other ranks' waits see the same peer themselves); an `EPAbortError` is passed on, with its cause.
    """
    call_name = method.__name__.lstrip("_")

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        rounds = self.transport.header_rounds
        try:
            return method(self, *args, **kwargs)
        except BaseException as error:
            own = self.transport.failure is None or isinstance(error, EPAbortError)
            if own and not getattr(error, "on_every_rank", False):
                if isinstance(error, EPAbortError):  # a peer failed first: pass its rank and error on
                    cause, text = error.peer, error.error
                else:
                    cause, text = self.rank, f"{call_name}: {type(error).__name__}: {error}"
                self.transport.abort(cause, text, inside_call=self.transport.header_rounds > rounds)
            raise

    return call

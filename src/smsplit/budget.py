"""SmBudget: split one GPU's SMs between communication and compute.

Two modes:

* ``"green"`` -- a hardware partition. One split of the device's SM resource gives two
  *complementary* green contexts (CUDA driver API through ``cuda.bindings``): the comm group and
  the remainder. Each gets a stream made with ``cuGreenCtxStreamCreate`` and wrapped as a
  ``torch.cuda.ExternalStream``, so any kernel launched on ``budget.comm_stream`` (ours, cuBLAS,
  Triton) runs only on the comm SMs and any kernel on ``budget.compute_stream`` only on the rest.
  Such streams keep their partition under CUDA graph capture.
  Hopper hands out SMs in groups (8 on H100/H200): asking for 20 comm SMs grants 24. The granted
  counts are ``budget.comm_sms`` / ``budget.compute_sms``; the request stays in
  ``budget.requested_comm_sms``.
* ``"grid"`` -- no partition. The comm kernels of this library launch exactly ``comm_sms``
  persistent programs on ``comm_stream`` (high priority); compute runs beside them on
  ``compute_stream``. Kernels on either stream may use any SM. Both streams are torch's pooled
  streams (``torch.cuda.Stream``, which hands out the same 32 per priority in turn), so another
  ``torch.cuda.Stream()`` of the same priority may be one of them, and work on the two then runs in
  order (no wait of this library depends on it: the EP transports' copies run on streams of their own).

Example::

    with SmBudget(comm_sms=20) as budget:
        with torch.cuda.stream(budget.compute_stream):
            c = a @ b                      # 108 SMs
        with torch.cuda.stream(budget.comm_stream):
            dispatch(...)                  # 24 SMs
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from smsplit.cuda_driver import check, cuda_driver

MODES = ("green", "grid")


class SmBudgetError(RuntimeError):
    """The driver cannot give the requested split (no green contexts, failed driver call)."""


@dataclass(frozen=True)
class SplitPlan:
    """SM counts of a split, before any context is made."""

    requested_comm_sms: int
    comm_sms: int
    compute_sms: int
    total_sms: int


def plan_split(comm_sms: int, total_sms: int, min_partition: int = 1, alignment: int = 1) -> SplitPlan:
    """The split the driver grants for ``comm_sms``: the comm group is rounded up to a multiple of
    ``alignment`` and to at least ``min_partition`` SMs; compute gets the remainder.

    Raises ValueError when the request is out of range or leaves no SM for compute.
    """
    for name, value in (("comm_sms", comm_sms), ("total_sms", total_sms), ("min_partition", min_partition),
                        ("alignment", alignment)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    for name, value in (("total_sms", total_sms), ("min_partition", min_partition), ("alignment", alignment)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0 < comm_sms < total_sms:
        raise ValueError(
            f"comm_sms must be between 1 and {total_sms - 1} (the device has {total_sms} SMs), "
            f"got {comm_sms}"
        )
    granted = max(min_partition, math.ceil(comm_sms / alignment) * alignment)
    if granted >= total_sms:
        largest = (total_sms - 1) // alignment * alignment  # the largest request whose groups leave an SM
        advice = (f"ask for at most {largest}" if largest >= 1 and max(min_partition, largest) < total_sms
                  else "no request fits")
        raise ValueError(
            f"comm_sms={comm_sms} rounds up to {granted} SMs (groups of {alignment}, at least {min_partition}), "
            f"which leaves no SM for compute on a {total_sms}-SM device; {advice}"
        )
    return SplitPlan(comm_sms, granted, total_sms - granted, total_sms)


def _resolve_device(device) -> torch.device:
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cuda"
    try:
        if isinstance(device, bool):  # (an int to torch, not a device)
            raise TypeError(f"a bool is not a device: {device!r}")
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as e:  # "cuda0", -1, 2.5: torch's own errors, as ValueError like the rest
        raise ValueError(f"device must be a CUDA device index, string or torch.device, got {device!r} ({e})") from e
    if device.type != "cuda":
        raise ValueError(f"SmBudget splits the SMs of a CUDA device; got device={device}")
    if not torch.cuda.is_available():
        raise ValueError("SmBudget needs a CUDA GPU, and torch sees none on this machine")
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device={device}: this machine has {torch.cuda.device_count()} CUDA devices")
    return torch.device("cuda", index)


def _driver():
    return cuda_driver(SmBudgetError, "; mode='green' needs it, mode='grid' works without it")


def _check(result, what: str):
    """Unpack a cuda.bindings return tuple, raising SmBudgetError on a driver error (`smsplit.cuda_driver.check`)."""
    return check(result, what, SmBudgetError)


def driver_version_text(version: int) -> str:
    """``12040`` -> ``"12.4"`` (the integer of ``cuDriverGetVersion``)."""
    return f"{version // 1000}.{version % 1000 // 10}"


@dataclass(frozen=True)
class GreenSmResource:
    """A device's whole SM resource, as the driver offers it for green contexts."""

    driver_version: int  # ``cuDriverGetVersion``, e.g. 12040
    cu_device: object    # ``CUdevice``
    resource: object     # ``CUdevResource`` of type SM, the input of ``cuDevSmResourceSplitByCount``

    @property
    def sm_count(self) -> int:
        return int(self.resource.sm.smCount)

    @property
    def min_partition_sms(self) -> int:
        """As the driver reports it (may be 0)."""
        return int(self.resource.sm.minSmPartitionSize)

    @property
    def sm_alignment(self) -> int:
        """As the driver reports it (may be 0)."""
        return int(self.resource.sm.smCoscheduledAlignment)


def green_sm_resource(device_index: int) -> GreenSmResource:
    """Query the driver for green-context support and device ``device_index``'s SM resource.

    Raises SmBudgetError when cuda-bindings is missing, the driver has no green contexts (older than
    12.4) or a driver call fails. Makes no context; does not touch torch.
    """
    driver = _driver()
    _check(driver.cuInit(0), "cuInit")
    version = _check(driver.cuDriverGetVersion(), "cuDriverGetVersion")
    if version < 12040 or not hasattr(driver, "cuGreenCtxCreate"):
        raise SmBudgetError(
            f"the CUDA driver (version {driver_version_text(version)}) has no green "
            "contexts (they need 12.4 or newer); use SmBudget(..., mode='grid')"
        )
    cu_device = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
    sm = _check(
        driver.cuDeviceGetDevResource(cu_device, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
        "cuDeviceGetDevResource(SM)",
    )
    return GreenSmResource(version, cu_device, sm)


class _GreenPartition:
    """Two complementary green contexts from one split of a device, each with one stream."""

    def __init__(self, device_index: int, comm_sms: int, comm_priority: int):
        driver = _driver()
        self.driver = driver
        torch.cuda.init()
        torch.cuda.synchronize(device_index)  # primary context exists and is current
        green = green_sm_resource(device_index)
        self.cu_device = green.cu_device
        sm = green.resource
        self.total_sms = green.sm_count
        self.min_partition = max(1, green.min_partition_sms)
        self.alignment = max(1, green.sm_alignment)
        plan_split(comm_sms, self.total_sms, self.min_partition, self.alignment)  # the rounding leaves compute SMs

        groups, n_groups, remainder = _check(
            driver.cuDevSmResourceSplitByCount(1, sm, 0, comm_sms), "cuDevSmResourceSplitByCount"
        )
        if n_groups != 1:
            raise SmBudgetError(f"the driver could not make a group of {comm_sms} SMs")
        comm_resource = groups[0]
        self.comm_sms = comm_resource.sm.smCount
        self.compute_sms = remainder.sm.smCount
        self.contexts = []
        self.streams = []
        try:
            for resource, priority in ((comm_resource, comm_priority), (remainder, 0)):
                desc = _check(driver.cuDevResourceGenerateDesc([resource], 1), "cuDevResourceGenerateDesc")
                ctx = _check(
                    driver.cuGreenCtxCreate(desc, self.cu_device, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
                    "cuGreenCtxCreate",
                )
                self.contexts.append(ctx)
                stream = _check(
                    driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, priority),
                    "cuGreenCtxStreamCreate",
                )
                self.streams.append(stream)
        except Exception:
            for stream in self.streams:
                driver.cuStreamDestroy(stream)
            for ctx in self.contexts:
                driver.cuGreenCtxDestroy(ctx)
            raise

    def synchronize(self):
        for stream in self.streams:
            self.driver.cuStreamSynchronize(stream)


# Green contexts and their streams are never destroyed before the process ends: a tensor used on a
# budget's stream (record_stream) may be freed after the budget closes, and the caching allocator
# then records an event on that stream, which must still exist.
_RETIRED_PARTITIONS: list = []


class SmBudget:
    """Split one GPU's SMs between communication and compute.

    Args:
        comm_sms: SMs asked for communication (1 .. device SMs - 1). In green mode the driver
            rounds this up to its group size; read the granted count from ``comm_sms``.
        device: CUDA device (index, ``"cuda:1"``, torch.device); the current device if None.
        mode: ``"green"`` (hardware partition, complementary green contexts) or ``"grid"``
            (no partition: comm kernels use exactly ``comm_sms`` persistent programs).
        comm_priority: stream priority of the comm stream (lower is higher; clamped by the
            driver). Default -1: comm work is picked first when both streams have work ready.

    Attributes:
        comm_stream / compute_stream: torch streams to launch work on.
        comm_sms / compute_sms: SMs granted to each side (green) or planned (grid).
        requested_comm_sms: what was asked for.
        total_sms: SMs of the device.
        isolated: True when the SM sets are enforced by hardware (green mode).
    """

    def __init__(self, comm_sms: int = 20, device=None, mode: str = "green", comm_priority: int = -1):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(comm_sms, bool) or not isinstance(comm_sms, int):
            raise ValueError(f"comm_sms must be an int, got {comm_sms!r}")
        self.device = _resolve_device(device)
        self.mode = mode
        self.total_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.requested_comm_sms = comm_sms
        self._partition = None
        self._closed = False
        if mode == "green":
            plan_split(comm_sms, self.total_sms)  # range check before touching the driver
            self._partition = _GreenPartition(self.device.index, comm_sms, comm_priority)
            self.comm_sms = self._partition.comm_sms
            self.compute_sms = self._partition.compute_sms
            self._comm_stream, self._compute_stream = (
                torch.cuda.ExternalStream(int(s), device=self.device) for s in self._partition.streams
            )
        else:
            plan = plan_split(comm_sms, self.total_sms)
            self.comm_sms, self.compute_sms = plan.comm_sms, plan.compute_sms
            self._comm_stream = torch.cuda.Stream(self.device, priority=comm_priority)
            self._compute_stream = torch.cuda.Stream(self.device, priority=0)

    @property
    def isolated(self) -> bool:
        return self.mode == "green"

    @property
    def comm_stream(self) -> torch.cuda.Stream:
        self._check_open()
        return self._comm_stream

    @property
    def compute_stream(self) -> torch.cuda.Stream:
        self._check_open()
        return self._compute_stream

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this SmBudget was closed; make a new one")

    def close(self):
        """Wait for both streams and retire the budget: its streams may no longer be used. (The
        green contexts themselves live until the process ends; see ``_RETIRED_PARTITIONS``.)
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._partition is not None:
            self._partition.synchronize()
            _RETIRED_PARTITIONS.append(self._partition)
        else:
            self._comm_stream.synchronize()
            self._compute_stream.synchronize()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        rounding = "" if self.comm_sms == self.requested_comm_sms else f" (asked {self.requested_comm_sms})"
        return (
            f"SmBudget(mode={self.mode!r}, device={self.device}, comm_sms={self.comm_sms}{rounding}, "
            f"compute_sms={self.compute_sms}, total_sms={self.total_sms})"
        )

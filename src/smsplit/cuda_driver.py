"""The CUDA driver through cuda-bindings: the one place that imports it and turns its error codes into Python
errors (`check`), and `StreamOps`, copy-engine copies and stream memory operations on torch streams.

No Triton here and nothing imported at module level but torch: the CPU reference transport and `smsplit.budget`
use it on machines where the bindings may be missing (the import happens at the first call).
"""

import torch


_driver = None  # the module, once imported (`check` runs on hot host paths: no import statement per call)


def cuda_driver(error: type = RuntimeError, hint: str = ""):
    """The ``cuda.bindings.driver`` module; ``error(...)`` (with ``hint`` appended) where cuda-bindings is missing."""
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver
        except ImportError as e:  # pragma: no cover - depends on the install
            raise error(f"the CUDA driver bindings are missing (pip install cuda-bindings){hint}") from e
        _driver = driver
    return _driver


def check(result, what: str, error: type = RuntimeError):
    """A cuda-bindings call's return (``err`` or ``(err, *values)``): raise ``error("<what> failed: <name>")`` on a
    driver error, else return its values (None, the one value, or a list of them)."""
    driver = cuda_driver(error)
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise error(f"{what} failed: {name.decode() if name else err}")
    if not values:
        return None
    return values[0] if len(values) == 1 else list(values)


class StreamOps:
    """Copy-engine copies and stream memory operations on torch streams, through the CUDA driver.

    A copy (``cuMemcpyDtoDAsync``) between this GPU's memory and a peer's memory mapped into this
    process runs on a copy engine: no SM is used. ``wait_geq`` makes later work on a stream wait until
    a 32-bit word reaches a value (``cuStreamWaitValue32``); ``write`` stores a 32-bit word once the
    stream's earlier work is done, with a system-wide fence before it (``cuStreamWriteValue32``).
    """

    def __init__(self, device: torch.device) -> None:
        self._driver = driver = cuda_driver()
        torch.cuda.init()
        check(driver.cuInit(0), "cuInit")
        self._geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self._fenced = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self._streams = {}  # torch stream handle -> CUstream (made once: these calls are on the host's hot path)
        self._batch_attrs = None
        self.batched = None  # whether cuMemcpyBatchAsync works here (None: not tried yet)
        self.device = torch.device(device)
        self._owned = []  # streams made by new_stream, destroyed with this object

    def new_stream(self) -> torch.cuda.ExternalStream:
        """A stream of its own (``cuStreamCreate``, non-blocking), for copies that kernels on other streams wait
        for. Not one of torch's pooled streams: ``torch.cuda.Stream()`` hands out the same 32 streams per priority
        in turn, so a caller's stream could be this one, and a kernel that waits for copies queued behind it on
        that stream would wait until its timeout."""
        d = self._driver
        with torch.cuda.device(self.device):
            torch.cuda.current_stream()  # the device's primary context current on this thread
            stream = check(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
            self._owned.append(stream)
            return torch.cuda.ExternalStream(int(stream), device=self.device)

    def __del__(self):
        for stream in getattr(self, "_owned", ()):
            try:  # work still queued there finishes first (the driver releases the stream after it)
                self._driver.cuStreamDestroy(stream)
            except Exception:  # interpreter shutdown: the driver module may be gone
                pass

    def _stream(self, stream: torch.cuda.Stream):
        handle = stream.cuda_stream
        cu = self._streams.get(handle)
        if cu is None:
            cu = self._streams[handle] = self._driver.CUstream(handle)
        return cu

    def memcpy(self, stream: torch.cuda.Stream, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``src`` to ``dst`` in stream order (nothing when nbytes == 0)."""
        if nbytes > 0:
            d = self._driver
            check(d.cuMemcpyDtoDAsync(dst, src, nbytes, self._stream(stream)), "cuMemcpyDtoDAsync")

    def memcpy_batch(self, stream: torch.cuda.Stream, copies: list) -> None:
        """The copies ``(dst, src, nbytes)`` in stream order, in one ``cuMemcpyBatchAsync`` where the driver
        has it (one host call instead of one per copy; the copies of a batch may run in any order, so none
        may depend on another), else one ``memcpy`` each."""
        copies = [c for c in copies if c[2] > 0]
        d = self._driver
        if len(copies) > 1 and self.batched is not False:
            try:
                if self._batch_attrs is None:
                    attrs = d.CUmemcpyAttributes()
                    attrs.srcAccessOrder = d.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                    self._batch_attrs = [attrs]
                result = d.cuMemcpyBatchAsync([d.CUdeviceptr(c[0]) for c in copies], [d.CUdeviceptr(c[1]) for c in copies],
                                              [c[2] for c in copies], len(copies), self._batch_attrs, [0], 1,
                                              self._stream(stream))
                err = result[0] if isinstance(result, tuple) else result
                if err == d.CUresult.CUDA_SUCCESS:
                    self.batched = True
                    return
                if self.batched:  # it worked before: a real failure
                    check(result, "cuMemcpyBatchAsync")
            except (AttributeError, TypeError):  # bindings without the call (CUDA < 12.8) or another signature
                pass
            self.batched = False  # not available here: copy one at a time from now on
        for dst, src, nbytes in copies:
            self.memcpy(stream, dst, src, nbytes)

    def wait_geq(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """Later work on ``stream`` waits until the int32 at ``addr`` is >= ``value`` (cyclic compare)."""
        d = self._driver
        check(d.cuStreamWaitValue32(self._stream(stream), addr, value & 0xFFFFFFFF, self._geq), "cuStreamWaitValue32")

    def write(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """Store ``value`` to the int32 at ``addr`` after the stream's earlier work, fenced."""
        d = self._driver
        check(d.cuStreamWriteValue32(self._stream(stream), addr, value & 0xFFFFFFFF, self._fenced),
              "cuStreamWriteValue32")

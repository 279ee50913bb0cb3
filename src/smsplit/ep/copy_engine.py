"""Copy-engine transport: SMs pack, the GPU's copy engines move the bytes across NVLink, SMs unpack.

(The transport itself follows StreamOps below.)
"""

from __future__ import annotations

import torch


class StreamOps:
    """Copy-engine copies and stream memory operations on torch streams, through the CUDA driver.

    A copy (``cuMemcpyDtoDAsync``) between this GPU's memory and a peer's memory mapped into this
    process runs on a copy engine: no SM is used. ``wait_geq`` makes later work on a stream wait until
    a 32-bit word reaches a value (``cuStreamWaitValue32``); ``write`` stores a 32-bit word once the
    stream's earlier work is done, with a system-wide fence before it (``cuStreamWriteValue32``).
    """

    def __init__(self, device: torch.device) -> None:
        from cuda.bindings import driver

        self._driver = driver
        torch.cuda.init()
        self._check(driver.cuInit(0), "cuInit")
        self._geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self._fenced = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        self.device = torch.device(device)

    def _check(self, result, what: str) -> None:
        err = result[0] if isinstance(result, tuple) else result
        if err != self._driver.CUresult.CUDA_SUCCESS:
            _, name = self._driver.cuGetErrorName(err)
            raise RuntimeError(f"{what} failed: {name.decode() if name else err}")

    def memcpy(self, stream: torch.cuda.Stream, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``src`` to ``dst`` in stream order (nothing when nbytes == 0)."""
        if nbytes > 0:
            d = self._driver
            self._check(d.cuMemcpyDtoDAsync(d.CUdeviceptr(dst), d.CUdeviceptr(src), nbytes,
                                            d.CUstream(stream.cuda_stream)), "cuMemcpyDtoDAsync")

    def wait_geq(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """Later work on ``stream`` waits until the int32 at ``addr`` is >= ``value`` (cyclic compare)."""
        d = self._driver
        self._check(d.cuStreamWaitValue32(d.CUstream(stream.cuda_stream), d.CUdeviceptr(addr),
                                          value & 0xFFFFFFFF, self._geq), "cuStreamWaitValue32")

    def write(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """Store ``value`` to the int32 at ``addr`` after the stream's earlier work, fenced."""
        d = self._driver
        self._check(d.cuStreamWriteValue32(d.CUstream(stream.cuda_stream), d.CUdeviceptr(addr),
                                           value & 0xFFFFFFFF, self._fenced), "cuStreamWriteValue32")

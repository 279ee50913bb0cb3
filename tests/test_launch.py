"""`smsplit.launch.FastLaunch`: which launches reuse a compiled kernel (CPU, a stand-in for Triton's JIT) and that
reused kernels compute what the JIT's do (GPU)."""

import pytest
import torch
import triton
import triton.language as tl

from smsplit import launch
from smsplit.launch import FastLaunch

pytestmark = pytest.mark.versioned  # (CI runs these under every supported torch and Triton)


class FakeKernel:
    """What `FastLaunch` uses of a Triton `CompiledKernel`."""

    def __init__(self, jit):
        self.jit, self.function, self.packed_metadata = jit, object(), object()

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, grid_x, grid_y, grid_z, stream, function, packed_metadata, metadata, enter, leave, *args):
        assert function is self.function and packed_metadata is self.packed_metadata
        self.jit.direct.append((grid_x, stream, args))


class FakeJit:
    """A stand-in for a `triton.jit` function: records launches through the JIT and compiles one fake kernel per
    call (so a test sees which calls `FastLaunch` sent through it)."""

    def __init__(self, fn, do_not_specialize=()):
        self.fn, self.device_caches, self.debug, self.pre_run_hooks = fn, {}, False, []
        self.do_not_specialize = list(do_not_specialize)
        self.jit_calls, self.direct = [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit_calls.append((grid, args, kwargs))
            return FakeKernel(self)
        return run


def kernel_signature(x_ptr, out_ptr, n, tag, BLOCK, HAS_X=True, trace_ptr=None):
    pass


@pytest.fixture
def no_gpu_driver(monkeypatch):
    class Active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 1234

    class Driver:
        active = Active()

    monkeypatch.setattr(launch, "driver", Driver())
    monkeypatch.setattr(launch, "_launch_hooks", lambda: (None, None))


def test_a_repeated_launch_skips_the_jit_and_passes_every_argument_in_signature_order(no_gpu_driver):
    fn = FakeJit(kernel_signature, do_not_specialize=["tag"])
    fast = FastLaunch(fn)
    x, out = torch.empty(64), torch.empty(64)
    fast(20, x, out, 48, 5, BLOCK=128)
    assert len(fn.jit_calls) == 1 and not fn.direct
    fast(20, x, out, 48, 9, BLOCK=128)  # tag is in do_not_specialize: a new value is not a new kernel
    assert len(fn.jit_calls) == 1 and fast.hits == 1
    grid, stream, args = fn.direct[0]
    assert grid == 20 and stream == 1234
    assert args == (x, out, 48, 9, 128, True, None)  # defaults filled in, in the signature's order


@pytest.mark.parametrize("change", ["misaligned pointer", "dtype", "int value", "int width of a loose argument",
                                    "bool for int", "constexpr", "option", "grid", "keyword set", "tuple element type",
                                    "negative zero", "debug knob", "instrumentation mode"])
def test_anything_triton_specializes_on_goes_through_the_jit(no_gpu_driver, monkeypatch, change):
    fn = FakeJit(kernel_signature, do_not_specialize=["tag"])
    fast = FastLaunch(fn)
    x, out = torch.empty(64), torch.empty(64)
    base = dict(grid=20, args=[x, out, 48, 5], kwargs=dict(BLOCK=128, num_warps=4))
    fast(base["grid"], *base["args"], **base["kwargs"])
    grid, args, kwargs = base["grid"], list(base["args"]), dict(base["kwargs"])
    if change == "misaligned pointer":
        args[0] = x[1:]
    elif change == "dtype":
        args[0] = x.to(torch.bfloat16)
    elif change == "int value":
        args[2] = 49
    elif change == "int width of a loose argument":
        args[3] = 2 ** 40
    elif change == "bool for int":
        args[2] = True
        fast(grid, x, out, 1, 5, **kwargs)
        assert len(fn.jit_calls) == 2
    elif change == "constexpr":
        kwargs["BLOCK"] = 256
    elif change == "option":
        kwargs["num_warps"] = 8
    elif change == "grid":
        grid = 21
    elif change == "keyword set":
        kwargs["HAS_X"] = True  # the default's value, but given: another signature-order assembly
    elif change == "tuple element type":  # (1, 2) and (True, 2) are equal tuples; Triton specializes them apart
        fast(grid, *args[:3], (1, 2), **kwargs)
        calls = len(fn.jit_calls)
        args[3] = (True, 2)
    elif change == "negative zero":  # 0.0 == -0.0, but the constexpr kernels differ
        kwargs["BLOCK"] = 0.0
        fast(grid, *args, **kwargs)
        kwargs["BLOCK"] = -0.0
    elif change == "debug knob":
        monkeypatch.setattr(launch.knobs.runtime, "debug", True)
    elif change == "instrumentation mode":  # (set by profilers such as proton while they run)
        monkeypatch.setattr(launch.knobs.compilation, "instrumentation_mode", "fpsan-test")
    calls = len(fn.jit_calls)
    hits = fast.hits
    fast(grid, *args, **kwargs)
    assert len(fn.jit_calls) == calls + 1 and fast.hits == hits
    fast(grid, *args, **kwargs)  # now known
    assert len(fn.jit_calls) == calls + 1 and fast.hits == hits + 1


def test_the_environment_switch_sends_every_launch_through_the_jit(no_gpu_driver, monkeypatch):
    monkeypatch.setenv(launch.ENV_SWITCH, "0")
    fn = FakeJit(kernel_signature)
    fast = FastLaunch(fn)
    x = torch.empty(64)
    for _ in range(3):
        fast(4, x, x, 16, 0, BLOCK=64)
    assert len(fn.jit_calls) == 3 and not fn.direct


def test_a_function_without_compiled_kernels_goes_through_the_jit(no_gpu_driver):
    """Triton's interpreter (TRITON_INTERPRET=1) hands out functions with no compiled kernels to keep."""
    fn = FakeJit(kernel_signature)
    del fn.device_caches
    fast = FastLaunch(fn)
    x = torch.empty(64)
    for _ in range(2):
        fast(4, x, x, 16, 0, BLOCK=64)
    assert len(fn.jit_calls) == 2 and not fn.direct and not fast.enabled


def test_a_stream_on_another_device_goes_through_the_jit(no_gpu_driver, monkeypatch):
    """The JIT's launch switches to the stream's device; a direct launch would use the current one's context."""
    fn = FakeJit(kernel_signature)
    fast = FastLaunch(fn)
    through = []
    monkeypatch.setattr(fast, "_through_jit",
                        lambda grid, args, kwargs, stream: through.append(stream) or FakeKernel(fn))  # (kept)

    class Stream:
        def __init__(self, device_index):
            self.device_index, self.cuda_stream = device_index, 99

    x = torch.empty(64)
    other = Stream(1)
    for _ in range(2):
        fast(4, x, x, 16, 0, stream=other, BLOCK=64)
    assert through == [other, other] and not fn.direct


def test_a_kernel_with_pre_run_hooks_goes_through_the_jit(no_gpu_driver):
    fn = FakeJit(kernel_signature)
    fn.pre_run_hooks.append(lambda *args, **kwargs: None)
    fast = FastLaunch(fn)
    x = torch.empty(64)
    for _ in range(2):
        fast(4, x, x, 16, 0, BLOCK=64)
    assert len(fn.jit_calls) == 2 and fast.hits == 0


def test_the_cache_is_bounded_and_keeps_the_kernels_in_use(no_gpu_driver, monkeypatch):
    monkeypatch.setattr(launch, "MAX_KERNELS", 4)
    fn = FakeJit(kernel_signature)
    fast = FastLaunch(fn)
    x = torch.empty(64)
    fast(4, x, x, 100, 0, BLOCK=64)  # the kernel in use, launched again between the others
    for n in range(10):
        fast(4, x, x, n, 0, BLOCK=64)
        fast(4, x, x, 100, 0, BLOCK=64)
    assert len(fast._kernels) == 4 and fast.hits == 10
    fast(4, x, x, 9, 0, BLOCK=64)  # the newest are kept too
    assert fast.hits == 11 and len(fn.jit_calls) == 11


def test_an_unhashable_constexpr_goes_through_the_jit(no_gpu_driver):
    fn = FakeJit(kernel_signature)
    fast = FastLaunch(fn)
    x = torch.empty(64)
    for _ in range(2):
        fast(4, x, x, 16, 0, BLOCK=[64])
    assert len(fn.jit_calls) == 2 and fast.hits == 0


@triton.jit(do_not_specialize=["shift"])
def scaled_copy_kernel(x_ptr, out_ptr, n, scale, shift, BLOCK: tl.constexpr, ADD: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask) * scale + shift
    if ADD:
        v += tl.load(out_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, v, mask=mask)


@pytest.mark.gpu
def test_fast_launches_compute_what_the_jit_computes_gpu():
    fast = FastLaunch(scaled_copy_kernel)
    g = torch.Generator(device="cpu").manual_seed(0)
    base = torch.randn(4096 + 8, generator=g).cuda()
    side = torch.cuda.Stream()
    cases = [(1, 0, 16, 3.0, 1, False), (1, 0, 16, 3.0, 7, False),  # the second reuses the first's kernel
             (4, 0, 1, 2.0, 0, False), (4, 1, 17, 2.0, 0, True),  # n == 1; a misaligned x and n % 16 != 0
             (4, 1, 4095, -1.5, 3, True), (8, 0, 4096, 0.5, 2, False), (8, 0, 4096, 0.5, 2, False)]
    for grid_programs, offset, n, scale, shift, add in cases:
        x = base[offset:offset + n]
        for on_side in (False, True):
            out = torch.full((n,), float("nan"), device="cuda") if not add else torch.randn(n, generator=g).cuda()
            expected = x * scale + shift + (out if add else 0)
            stream = side if on_side else None
            if on_side:
                side.wait_stream(torch.cuda.current_stream())
            fast(-(-n // 64) if grid_programs > 1 else 1, x, out, n, scale, shift, stream=stream,
                 BLOCK=64 if grid_programs > 1 else 4096, ADD=add)
            if on_side:
                torch.cuda.current_stream().wait_stream(side)
            torch.testing.assert_close(out, expected)
    assert fast.hits > 0


@pytest.mark.gpu
def test_a_fast_launch_is_captured_in_a_cuda_graph_gpu():
    fast = FastLaunch(scaled_copy_kernel)
    x = torch.randn(1000, device="cuda")
    out = torch.full_like(x, float("nan"))
    fast(16, x, out, 1000, 2.0, 1, BLOCK=64, ADD=False)  # known from here on
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        fast(16, x, out, 1000, 2.0, 1, BLOCK=64, ADD=False)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    assert fast.hits == 1
    out.fill_(float("nan"))
    x.copy_(torch.randn(1000, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, x * 2.0 + 1)

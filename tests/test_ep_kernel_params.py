"""Every Triton kernel of `smsplit.ep` reads top to bottom with the parameters it needs: at most 20, constexprs
included (a kernel's signature is what a reader and a launch must get right; the transports' constants live in their
context tables, per-call values that loops need not hold in the call words or their kernel's parameters)."""

import importlib
import pkgutil

import triton

import smsplit.ep
from smsplit.launch import FastLaunch

MAX_PARAMS = 20


def _ep_modules():
    names = [info.name for info in pkgutil.walk_packages(smsplit.ep.__path__, "smsplit.ep.")]
    return [importlib.import_module(name) for name in sorted(names)]


def _jit_functions(module):
    return {name: obj for name, obj in vars(module).items()
            if isinstance(obj, triton.runtime.jit.JITFunction) and obj.fn.__module__ == module.__name__}


def test_every_ep_kernel_takes_at_most_20_parameters():
    modules = _ep_modules()
    kernels = {f"{module.__name__}.{name}": fn for module in modules
               for name, fn in _jit_functions(module).items() if name.endswith("_kernel")}
    # every kernel a transport launches is one of them (a launched function named otherwise would escape the count)
    launched = {obj.fn for module in modules for obj in vars(module).values() if isinstance(obj, FastLaunch)}
    assert launched and launched <= set(kernels.values()), sorted(fn.fn.__name__ for fn in launched)
    for name in ("layout.layout_kernel", "kernels.notify.notify_kernel", "kernels.dispatch.dispatch_kernel",
                 "kernels.dispatch_fp8.dispatch_fp8_kernel", "kernels.dispatch_copied.dispatch_copied_kernel",
                 "kernels.combine.combine_kernel", "kernels.combine.combine_copied_kernel",
                 "kernels.copy_engine.gate_kernel", "kernels.copy_engine.pack_kernel",
                 "kernels.copy_engine.reduce_kernel"):
        assert "smsplit.ep." + name in kernels, name
    counts = {name: len(fn.params) for name, fn in kernels.items()}
    assert all(n == len(fn.arg_names) for n, fn in zip(counts.values(), kernels.values()))
    too_many = {name: n for name, n in counts.items() if n > MAX_PARAMS}
    assert not too_many, too_many

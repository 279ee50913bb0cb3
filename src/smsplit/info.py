"""What this machine offers smsplit: GPUs, SMs, NVLink peers, green-context support, versions."""

from __future__ import annotations

import platform

import torch

from smsplit.budget import SmBudgetError, driver_version_text, green_sm_resource


def _green_context_support(index: int) -> dict:
    try:
        green = green_sm_resource(index)
    except SmBudgetError as e:
        return {"supported": False, "why": str(e)}
    return {"driver_api": driver_version_text(green.driver_version), "supported": True,
            "sm_count": green.sm_count, "min_partition_sms": green.min_partition_sms,
            "sm_alignment": green.sm_alignment}


def _nvlink_count(index: int) -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        links = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                links += pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
            except pynvml.NVMLError:
                break
        return links
    except Exception:
        return None


def collect() -> dict:
    import triton

    import smsplit

    versions = {"smsplit": smsplit.__version__, "python": platform.python_version(),
                "torch": torch.__version__, "triton": triton.__version__, "cuda (torch)": torch.version.cuda}
    try:
        from cuda import bindings
        versions["cuda-bindings"] = bindings.__version__
    except ImportError:
        versions["cuda-bindings"] = None
    gpus = []
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        for i in range(n):
            props = torch.cuda.get_device_properties(i)
            gpus.append({
                "index": i, "name": props.name, "sms": props.multi_processor_count,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "compute_capability": f"{props.major}.{props.minor}",
                "peers": [j for j in range(n) if j != i and torch.cuda.can_device_access_peer(i, j)],
                "nvlinks": _nvlink_count(i),
                "green_contexts": _green_context_support(i),
            })
    return {"versions": versions, "gpus": gpus}


def render(info: dict) -> str:
    lines = ["smsplit " + info["versions"]["smsplit"]]
    lines += [f"  {k}: {v}" for k, v in info["versions"].items() if k != "smsplit"]
    if not info["gpus"]:
        lines.append("GPUs: none visible to torch (CPU-only machine: the reference backends run; "
                     "SM budgets, traces and the NVLink kernels need a Hopper GPU)")
    for g in info["gpus"]:
        green = g["green_contexts"]
        green_text = (f"yes (driver {green['driver_api']}, groups of {green['sm_alignment']} SMs, "
                      f"at least {green['min_partition_sms']})" if green.get("supported")
                      else f"no ({green.get('why')})")
        lines.append(f"GPU {g['index']}: {g['name']}, {g['sms']} SMs, {g['memory_gib']} GiB, "
                     f"sm_{g['compute_capability'].replace('.', '')}")
        lines.append(f"  peers (P2P): {g['peers'] or 'none'}; NVLinks up: "
                     f"{g['nvlinks'] if g['nvlinks'] is not None else 'unknown (no pynvml)'}")
        lines.append(f"  green contexts: {green_text}")
    return "\n".join(lines)

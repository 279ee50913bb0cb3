"""Host time the pipeline's saved-tensor hooks add to a stage's forward (CPU is enough: the hooks are host work).

    PYTHONPATH=src python bench/pipeline_hook_cost.py

Runs a small stage (8 LayerNorm-Linear-GELU-Linear blocks on tiny tensors, so that the host time dominates) with and
without `smsplit.pipeline.dualpipe._saved_storages`, the hooks a stage whose outputs go to another rank runs under,
and prints the medians and the number of tensors autograd saved.
"""

import time

import torch
from torch import nn

from smsplit.pipeline.dualpipe import _saved_storages


def median_us(fn, reps: int = 200) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e6


def main() -> None:
    torch.manual_seed(0)
    d = 8
    stage = nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                            for _ in range(8)])
    x = torch.randn(4, d, requires_grad=True)
    saved = []

    def hooked():
        with _saved_storages() as storages:
            stage(x)
        saved.append(len(storages))

    for _ in range(3):
        plain, with_hooks = median_us(lambda: stage(x)), median_us(hooked)
        print(f"forward: plain {plain:.0f} us, under the hooks {with_hooks:.0f} us, "
              f"+{with_hooks - plain:.0f} us for {saved[-1]} saved tensors "
              f"({(with_hooks - plain) / saved[-1]:.2f} us a tensor)")


if __name__ == "__main__":
    main()

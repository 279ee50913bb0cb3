"""The NVLink and copy-engine transports' Triton kernels, one module per family.

- `common`: the words and slots both sides agree on, the context table, bounded waits and signals.
- `rows`: what a dispatch reads of a token (rows, FP8 quantization in chunks) and a combine's sum of returned rows.
- `notify`: the count exchange (where each rank's tokens land) and the copy chains' counter bump.
- `dispatch`: the SM-push dispatch of BF16 or FP8 rows as they are (its start and end shared with the others);
  `dispatch_fp8`: the SM-push dispatch that quantizes BF16 rows to FP8 on the way; `dispatch_copied`: the dispatch
  beside copy engines that move each peer's first rows (it fills their holes and waits for their copies).
- `combine`: the combine, SM push (`combine_kernel`) or beside copy engines that return the rows in chunks, summed as
  they land (`combine_copied_kernel`).
- `copy_engine`: the copy-engine transport's gate, pack and reduce kernels (and their context table and call words).

Each kernel takes at most 20 parameters (tests/test_ep_kernel_params.py): the transports' constants are in their
context tables, and what a mode flag would select is either derived (a pointer that is None, a dtype) or its own
kernel.

Host code (which kernel runs, the plans, the buffers) is in `smsplit.ep.nvlink`, `smsplit.ep.nvlink_plan` and
`smsplit.ep.copy_engine`.
"""

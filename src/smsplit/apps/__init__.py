"""The applications built on the library, behind the `smsplit` command line: `demo` (train the tiny MoE model
with expert parallelism and DualPipeV) and `trace` (the SM split made visible). The library (`smsplit.budget`,
`smsplit.ep`, `smsplit.pipeline`, `smsplit.moe`, ...) never imports them; they may use matplotlib and rich."""

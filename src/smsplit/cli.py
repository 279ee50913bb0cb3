"""`smsplit` command line: demo (the main job, `smsplit.apps.demo`), trace (`smsplit.apps.trace`), info."""

from __future__ import annotations

import argparse
import json
import sys


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="smsplit", description="DeepSeek-V3's GPU systems tricks for Hopper")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="GPUs, SMs, NVLink peers, green-context support, versions")
    p_info.add_argument("--json", action="store_true", help="print JSON instead of text")
    p_demo = sub.add_parser("demo", help="the main job: train a tiny DeepSeek-style MoE model with expert "
                            "parallelism and DualPipeV (2 gloo processes on CPU, NCCL on 2+ GPUs)")
    p_demo.add_argument("--out", default="smsplit-report", help="report folder (default: smsplit-report)")
    p_demo.add_argument("--steps", type=positive_int, default=200, help="training steps (default 200)")
    p_demo.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: cuda when 2 GPUs are present, else cpu")
    p_demo.add_argument("--comm-sms", type=positive_int, default=20,
                        help="SMs asked for communication on GPU (default 20)")
    p_demo.add_argument("--seed", type=int, default=0, help="random seed in [0, 2**32) (default 0)")
    p_trace = sub.add_parser("trace", help="show the SM split: a comm kernel beside a GEMM, traced per SM (GPU)")
    p_trace.add_argument("--out", default="smsplit-report/trace", help="report folder (default: smsplit-report/trace)")
    p_trace.add_argument("--comm-sms", type=positive_int, default=20, help="SMs asked for communication (default 20)")
    args = parser.parse_args(argv)

    if args.command == "info":
        from smsplit import info

        machine = info.collect()
        print(json.dumps(machine, indent=1) if args.json else info.render(machine))
    elif args.command == "demo":
        from smsplit.apps import demo

        try:  # the config and `run` check everything before any process starts
            demo.run(demo.DemoConfig(out_dir=args.out, steps=args.steps, device=args.device, comm_sms=args.comm_sms,
                                     seed=args.seed))
        except ValueError as e:
            p_demo.error(str(e))
        print(f"report: {args.out}")
    elif args.command == "trace":
        from smsplit.apps import trace

        try:
            trace.run(trace.TraceConfig(out_dir=args.out, comm_sms=args.comm_sms))
        except ValueError as e:
            p_trace.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())

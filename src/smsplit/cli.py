"""`smsplit` command line: info, demo."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="smsplit", description="DeepSeek-V3's GPU systems tricks for Hopper")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="GPUs, SMs, NVLink peers, green-context support, versions")
    p_info.add_argument("--json", action="store_true", help="print JSON instead of text")
    p_demo = sub.add_parser("demo", help="the main job: show the SM split at work (CPU-only machines too)")
    p_demo.add_argument("--out", default="smsplit-report", help="report folder (default: smsplit-report)")
    p_demo.add_argument("--comm-sms", type=int, default=20, help="SMs asked for communication (default 20)")
    args = parser.parse_args(argv)

    if args.command == "info":
        from smsplit import info

        machine = info.collect()
        print(json.dumps(machine, indent=1) if args.json else info.render(machine))
    elif args.command == "demo":
        from smsplit import demo

        demo.run(out=args.out, comm_sms=args.comm_sms)
    return 0


if __name__ == "__main__":
    sys.exit(main())

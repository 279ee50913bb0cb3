"""DeepSeek-style MoE: router, MoE layer on `smsplit.ep`, overlapped forward/backward, a tiny model (trained by
`smsplit demo`, `smsplit.apps.demo`)."""

from smsplit.moe.layer import MoE, grouped_mm
from smsplit.moe.model import ModelConfig, Stage, build_stages
from smsplit.moe.overlap import PieceRunner, overlapped_forward_backward, serial_forward_backward
from smsplit.moe.router import Router, group_limited_topk, node_limited_groups

__all__ = ["MoE", "ModelConfig", "PieceRunner", "Router", "Stage", "build_stages", "group_limited_topk",
           "grouped_mm", "node_limited_groups", "overlapped_forward_backward", "serial_forward_backward"]

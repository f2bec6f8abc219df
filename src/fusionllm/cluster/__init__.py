"""Cluster files: which devices exist, how fast each is, and how fast the links between them are.

Shared by the emulated testbed, the planner and the simulator; imports only `fusionllm.core`.
"""

from fusionllm.cluster.spec import (
    DEVICE_PRESETS,
    MAX_DEVICES,
    ClusterSpec,
    DeviceSpec,
    LinkSpec,
    SiteSpec,
    format_rate,
    load_cluster,
    parse_cluster,
    parse_flops,
    parse_latency,
    parse_memory,
    parse_rate,
)

__all__ = [
    "DEVICE_PRESETS",
    "MAX_DEVICES",
    "ClusterSpec",
    "DeviceSpec",
    "LinkSpec",
    "SiteSpec",
    "format_rate",
    "load_cluster",
    "parse_cluster",
    "parse_flops",
    "parse_latency",
    "parse_memory",
    "parse_rate",
]

"""An emulated geo-distributed cluster on one machine: network namespaces, tc rate limits, CPU quotas."""

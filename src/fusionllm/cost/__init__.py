"""The workload estimator: FLOPs, bytes and memory per op; measured times per op and per transfer."""

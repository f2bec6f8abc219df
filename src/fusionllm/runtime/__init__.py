"""Executes stages of an OpGraph: forward, backward, remote autodiff semantics."""

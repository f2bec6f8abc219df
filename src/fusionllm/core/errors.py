"""Errors a user can act on: each says what was wrong, which input, and what to do."""

from __future__ import annotations


class FusionError(Exception):
    """Base class of every error fusionllm raises on purpose."""


class GraphError(FusionError):
    """An OpGraph is malformed (cycle, dangling edge, unknown op kind, bad JSON)."""


class TraceError(FusionError):
    """A module could not be traced into an OpGraph."""


class RegistryError(FusionError):
    """An op kind or model spec cannot be resolved."""


class WireError(FusionError):
    """A serialised tensor or value is malformed, truncated or too large."""


class DataError(FusionError):
    """A corpus is missing, empty or unreadable."""


class ConfigError(FusionError):
    """A configuration value is out of range or inconsistent."""


class TransportError(FusionError):
    """A peer could not be reached, or a call failed on the way."""


class AuthError(TransportError):
    """A peer presented a wrong token or protocol version, or was refused for it."""


class RemoteError(FusionError):
    """The peer ran the call and reported an error."""

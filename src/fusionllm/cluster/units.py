"""Quantities with units in a cluster file: rates as tc writes them, latencies, flop/s, memory sizes.

Each parser names the key it read in its `ConfigError`, so the message points into the file.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from fusionllm.core.errors import ConfigError

# Decimal, as tc reads them: 1kbit = 1000 bit/s.
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_LATENCY_UNITS_MS = {"s": Decimal(1000), "ms": Decimal(1), "us": Decimal("0.001")}
_FLOPS_UNITS = {"flops": 1, "gflops": 10**9, "tflops": 10**12}
_MEMORY_UNITS = {
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}

_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*([a-z]+)", re.IGNORECASE)


def _quantity(
    text: object, key: str, units: dict[str, Any], what: str, example: str
) -> tuple[Decimal, Any]:
    """Split "20 mbit" into (Decimal("20"), multiplier); reject anything else, naming `key`."""
    names = ", ".join(units)
    hint = f"expected {what} like {example!r} (units {names})"
    if not isinstance(text, str):
        raise ConfigError(
            f"{key}: {hint}, got {text!r} ({type(text).__name__}); write it as a quoted string"
        )
    match = _QUANTITY.fullmatch(text.strip())
    if match is None or match.group(2).lower() not in units:
        raise ConfigError(f"{key}: {hint}, got {text!r}")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:  # pragma: no cover - the regex admits only plain decimals
        raise ConfigError(f"{key}: {hint}, got {text!r}") from None
    return number, units[match.group(2).lower()]


def parse_rate(text: str, key: str = "bandwidth") -> int:
    """A tc-style rate ("20mbit", "1.5gbit", "8 Mbit") in bits per second; > 0 and whole."""
    match = _QUANTITY.fullmatch(text.strip()) if isinstance(text, str) else None
    if match and match.group(2).lower().endswith("bps"):
        raise ConfigError(
            f"{key}: {text!r} is ambiguous (tc reads 'mbps' as megabytes/s); "
            f"write bits per second with bit, kbit, mbit or gbit, e.g. '{match.group(1)}mbit'"
        )
    number, unit = _quantity(text, key, _RATE_UNITS, "a rate", "20mbit")
    bps = number * unit
    if bps <= 0:
        raise ConfigError(f"{key}: must be > 0, got {text!r}")
    if bps != bps.to_integral_value():
        raise ConfigError(f"{key}: must be a whole number of bit/s, got {text!r}")
    return int(bps)


def format_rate(bps: int) -> str:
    """The shortest tc-style text for `bps` bit/s ("20mbit", "1.5gbit"); `parse_rate` reads it back."""
    if isinstance(bps, bool) or not isinstance(bps, int) or bps <= 0:
        raise ConfigError(f"format_rate: expected a positive whole number of bit/s, got {bps!r}")
    for unit, scale in sorted(_RATE_UNITS.items(), key=lambda item: -item[1]):
        if bps >= scale:
            value = (Decimal(bps) / scale).normalize()
            return f"{value:f}{unit}"
    raise AssertionError("unreachable: bps >= 1")  # pragma: no cover


def parse_latency(text: str, key: str = "latency") -> float:
    """A latency ("5ms", "250us", "0.1s") in milliseconds; >= 0."""
    number, unit = _quantity(text, key, _LATENCY_UNITS_MS, "a latency", "5ms")
    if number < 0:
        raise ConfigError(f"{key}: must be >= 0, got {text!r}")
    return float(number * unit)


def parse_flops(text: str, key: str = "device_flops") -> float:
    """A device's peak throughput ("312tflops") in flop/s; > 0."""
    number, unit = _quantity(text, key, _FLOPS_UNITS, "a throughput", "312tflops")
    if number <= 0:
        raise ConfigError(f"{key}: must be > 0, got {text!r}")
    return float(number * unit)


def parse_memory(text: str, key: str = "device_memory") -> int:
    """A memory size ("80GiB", "16GB") in bytes; > 0 and whole."""
    number, unit = _quantity(text, key, _MEMORY_UNITS, "a memory size", "80GiB")
    size = number * unit
    if size <= 0:
        raise ConfigError(f"{key}: must be > 0, got {text!r}")
    if size != size.to_integral_value():
        raise ConfigError(f"{key}: must be a whole number of bytes, got {text!r}")
    return int(size)

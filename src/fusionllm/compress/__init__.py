"""Codecs and the wire encoding of tensors. Knows nothing about networking or torch."""

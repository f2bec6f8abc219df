"""gRPC transport: authenticated control calls and chunked tensor streams. Knows no torch."""

PROTOCOL_VERSION = 2

"""Codecs and the wire encoding of tensors. Knows nothing about networking or torch.

Importing the package registers the built-in codecs (``compress/codecs/``: one module each), so a
codec is known wherever ``compress.base``'s registry is read; the registry itself imports no codec.
"""

from fusionllm.compress import codecs as _builtin_codecs  # noqa: F401  (registers every built-in codec)

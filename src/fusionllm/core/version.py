"""The package's version, in the lowest layer: a worker and the coordinator compare it at join.

It lives in ``core`` so that every layer may read it without importing the package face
(``fusionllm/__init__.py``, the Python API's layer); pyproject.toml reads it from here too.
"""

__version__ = "0.1.0"

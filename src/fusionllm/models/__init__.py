"""Model families (GPT) and model specs (`gpt-micro` or `package.module:factory`)."""

from fusionllm.models.spec import MODEL_NAMES, build_model, resolve_factory

__all__ = ["MODEL_NAMES", "build_model", "resolve_factory"]

"""A NumPy backend: run any set of OpGraph nodes forward and backward without torch.

For workers without torch (or with another torch): the ops of the GPT family at layer and fine
granularity (``ops.supported_kinds()``), a stage executor with the contract of
``runtime.executor.StageExecutor`` (``executor.NumpyStageExecutor``), and AdamW (``optim``).
Nothing in this package imports torch, directly or through other fusionllm modules.
"""

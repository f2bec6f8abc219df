"""The `fusionllm` command."""

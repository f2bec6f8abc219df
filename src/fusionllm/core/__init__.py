"""Ids, tensor metadata, errors and logging: the bottom layer, importing nothing of fusionllm."""

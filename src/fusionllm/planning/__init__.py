"""Choosing a plan: OP-Fence's search and its baselines, groups and H, codecs per link, offline plans.

Pure functions of ``schedule`` (the Plan data, partitioners, lowering), ``sim`` (what a plan's step or
round would take) and ``cost``; nothing here talks to a worker. The coordinator (``control``) calls it
with the hardware it probed; ``fusionllm plan`` and ``simulate`` call it with a cluster file.
"""

"""Discrete-event simulation of the same lowered action lists the runtime executes."""

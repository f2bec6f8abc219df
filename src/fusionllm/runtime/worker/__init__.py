"""The worker process and its parts: the coordinator link, NAT, worlds, the step running now, its own data and state."""

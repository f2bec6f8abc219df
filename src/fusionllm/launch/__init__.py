"""Starting runs: the RunConfig built once from the command line, a user's task bound to the
coordinator, the in-process cluster, and planning without workers (trace, time, plan a cluster file)."""

"""Plans (stages on workers) and pipeline schedules as action lists."""

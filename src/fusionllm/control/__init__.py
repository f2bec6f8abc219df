"""The coordinator: membership, heartbeats, planning, driving the workers step by step."""

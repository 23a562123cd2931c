"""Chaos rig and correctness tests: kills, zombies, restarts, cut connections, models, hostile input."""

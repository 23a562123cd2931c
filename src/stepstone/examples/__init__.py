"""Example workflows: read them, copy them, run them with `stepstone demo`."""

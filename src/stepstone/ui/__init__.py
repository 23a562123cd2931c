"""The web UI: server-rendered pages over the same operations as the API (no JavaScript build)."""

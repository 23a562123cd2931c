"""The chaos rig: a dedicated PostgreSQL server, a TCP proxy, a fleet of worker processes and a checker."""

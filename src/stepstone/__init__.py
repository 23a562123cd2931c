"""stepstone: a durable workflow engine for Python whose replicas coordinate only through PostgreSQL."""

__version__ = "0.1.0"

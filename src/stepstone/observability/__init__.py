"""Observability: OpenTelemetry spans (`tracing`), Prometheus metrics (`metrics`, the `prometheus`
extra) and worker health (`health`). Nothing here is needed for correctness."""

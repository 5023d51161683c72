"""Observability: Prometheus metrics, OpenTelemetry traces, timelines and critical paths."""

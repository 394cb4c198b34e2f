"""Traces (OpenTelemetry over OTLP) and Prometheus metrics."""

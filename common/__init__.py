"""Helpers shared by the splitserve services: env config, logging, gRPC server plumbing,
metrics (metrics.py) and tracing (telemetry.py)."""

"""What the gateway tells the outside about itself: Prometheus metrics (its own series, the
per-adapter ones, vLLM's names), OpenTelemetry traces, and the engine watchdog behind /health."""

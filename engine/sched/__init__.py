"""Scheduling: continuous batching over the KV cache (scheduler), what a step takes (batch),
the step as every rank runs it (plan), and the step in flight under async scheduling
(pipeline)."""

"""Measurement: runners for each runtime, quality (metric + fidelity), latency, memory, profiles."""

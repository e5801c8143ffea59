"""Helpers for tests and benchmarks that need no downloaded model."""

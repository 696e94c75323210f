"""Benchmarks: `tessera bench serving | offline` (see docs/benchmarks.md)."""

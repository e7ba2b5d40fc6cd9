"""Benchmarks: each script prints its figures; see benchmarks/RESULTS.md."""

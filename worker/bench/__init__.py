"""Benchmarks: commands that print JSON and run a peer beside us on the same workload."""

"""Benchmarks and the cost model: interconnect benchmark, tick replay, speed prediction."""

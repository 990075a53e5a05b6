"""Tools the tests, benchmarks and demos share (rank spawning, peak-memory measurement); not part of the package."""

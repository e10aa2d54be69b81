"""Support shared by the test suite and the benchmarks: real servers on loopback ports."""

"""The benchmarks' shared library: processes, load, statistics, result files and plots."""

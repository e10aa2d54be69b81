"""What the tests and the benchmarks share: real servers on loopback and experiment harnesses.

Nothing here runs in production. Modules: `ports` (a free loopback port), `kafka` (a Kafka test
broker), `standalone` (a Spark standalone cluster), `branches` (the two-branch backpressure
experiment), `faults` (store faults installed as writer wrappers), `arrow_source` (an in-memory
Arrow streaming source: the Spark plan without a log).
"""

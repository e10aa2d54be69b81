"""The file `spark-submit` runs (`spark_main.py`), kept in a directory of its own: Python puts a
script's directory first on its path, and in `sluice/` that would shadow `redis` with
`sluice.redis`."""

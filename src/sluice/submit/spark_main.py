"""Sluice's CLI for `spark-submit`, which wants a Python file, not a module:

    spark-submit --master spark://host:7077 "$(sluice submit-path)" run -c sluice.yaml

Under spark-submit, the master (and any --conf) spark-submit was given wins over `spark.master`.
"""

from sluice.cli import main

if __name__ == "__main__":
    main()

# The two commands of the README. Both create .venv and install what is missing first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: setup demo test lint bench jvm-archive
setup: $(STAMP)

# setup.py and the C source too: an edit to either builds the extension again.
$(STAMP): pyproject.toml setup.py src/sluice/slices/_sums.c src/sluice/redis/_dump.c
	@command -v java >/dev/null || { echo "Java 17+ is required by Spark (install openjdk-17-jre-headless)"; exit 1; }
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

# The driver JVM's class archive (sluice.pipeline.cds, docs/spark.md): built once per
# environment, it takes several seconds off every start of Spark.
jvm-archive: $(STAMP)
	$(PY) -m sluice.pipeline.cds_build

# Options for `sluice demo`, e.g. make demo DEMO_ARGS="--port 8080 --duration 120"
DEMO_ARGS ?=
demo: jvm-archive
	$(VENV)/bin/sluice demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/mypy

# Two lanes (tests/conftest.py): the end-to-end tests in order on one worker, the rest on the other.
test: lint jvm-archive
	$(VENV)/bin/pytest -q -p no:cacheprovider -n 2 --durations=40

bench: $(STAMP)
	$(PY) bench/throughput.py
	$(PY) bench/ingest.py
	$(PY) bench/store.py
	$(PY) bench/query.py
	$(PY) bench/burst.py
	$(PY) bench/audit.py
	$(PY) bench/durability.py
	$(PY) bench/cluster.py
	$(PY) bench/failover.py
	$(PY) bench/render.py

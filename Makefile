# The README's two commands: `make demo` and `make test`. Each does all set-up
# on a fresh machine (virtual environment, Kafka jars, Chromium) by itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= --durations=15

.PHONY: demo test lint venv kafka-up kafka-down live live-down browser bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[all,test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/rankscope demo

lint: $(STAMP)
	$(BIN)/ruff check .

browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

kafka-up:
	scripts/kafka up

kafka-down:
	scripts/kafka down

# A local live stack (broker, serve, dashboard, a simulated faulty job); see docs/kafka.md.
live: $(STAMP)
	scripts/live up

live-down:
	scripts/live down

test: $(STAMP) browser
	$(BIN)/ruff check .
	scripts/kafka up
	status=0; $(BIN)/python -m pytest -q -ra $(PYTEST_ARGS) || status=$$?; scripts/kafka down; exit $$status

bench: $(STAMP)
	for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .kafka .live .pytest_cache .ruff_cache *.egg-info

# The README's two commands: `make demo` and `make test`. Each does all set-up
# on a fresh machine (virtual environment, Kafka jars, Chromium) by itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= --durations=15

.PHONY: demo test lint venv titan kafka-up kafka-down live live-down browser bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[all,test]'
	touch $(STAMP)

venv: $(STAMP)

# torchtitan's real trainer for bench/bench_torchtitan.py and its test: pinned wheels
# in --target form beside the venv (their Hugging Face pins would break the venv's),
# put on PYTHONPATH for the torchtitan processes only.
TITAN := .titan
TITAN_PINS := torchtitan==0.3.0 spmd_types==0.2.3 torchdata==0.11.0 torch_checkpointing==0.1.1 \
	tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 shtab==1.13.0 einops==0.8.2 \
	tensorboard==2.21.0 tensorboard-data-server==0.7.2 absl-py==2.5.1 markdown==3.11.4 \
	werkzeug==3.1.9 grpcio==1.85.4 datasets==5.2.0 multiprocess==0.70.19 dill==0.4.1 \
	xxhash==4.1.0

$(TITAN)/.installed: Makefile $(STAMP)
	rm -rf $(TITAN)
	$(BIN)/pip install -q --no-deps --target $(TITAN) $(TITAN_PINS)
	touch $@

titan: $(TITAN)/.installed

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

test: $(STAMP) browser titan
	$(BIN)/ruff check .
	scripts/kafka up
	status=0; $(BIN)/python -m pytest -q -ra $(PYTEST_ARGS) || status=$$?; scripts/kafka down; exit $$status

bench: $(STAMP) titan
	for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(TITAN) .kafka .live .pytest_cache .ruff_cache *.egg-info

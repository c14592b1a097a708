# The README's two commands: `make demo` and `make test`; `make test-quick` for day-to-day work.
.PHONY: install install-dev demo test test-quick

# Three pytest workers on CI's 2 cores (much of the suite waits: on servers, jobs, Slurm), each
# group of tests on one worker (tests/conftest.py:
# the tests on the Slurm cluster together, each other file whole).
PYTEST = .venv/bin/python -m pytest -q -rs --timeout=900 -n $(WORKERS) --dist loadscope --no-loadscope-reorder
WORKERS ?= 3

install:
	./install.sh

install-dev:
	./install.sh dev

demo: install
	.venv/bin/align demo
	.venv/bin/align run pipeline=sft_dpo

# Wall time from the install to the last test, and the 60 slowest test phases.
test:
	@started=$$(date +%s); \
	./install.sh dev && .venv/bin/ruff check . && .venv/bin/ruff format --check . && $(PYTEST) -x --durations=60; \
	code=$$?; echo "make test: $$(( $$(date +%s) - started )) s wall, the install included (exit $$code)"; exit $$code

# The tests not marked slow (pytest.ini's `slow`: over ~20 s each), with their wall time.
test-quick:
	@started=$$(date +%s); \
	./install.sh dev && $(PYTEST) -m "not slow" --durations=20; \
	code=$$?; echo "make test-quick: $$(( $$(date +%s) - started )) s wall, the install included (exit $$code)"; exit $$code

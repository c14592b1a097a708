# The README's two commands: `make demo` and `make test`.
.PHONY: install install-dev demo test

install:
	./install.sh

install-dev:
	./install.sh dev

demo: install
	.venv/bin/align demo
	.venv/bin/align run pipeline=sft_dpo

test: install-dev
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest -x -q -rs --timeout=900 --durations=60

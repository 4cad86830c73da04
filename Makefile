# The commands of the README. Each sets up its venv first (once; see scripts/setup.sh).
CORES ?= all

PYTHON ?= .venv/bin/python

.PHONY: setup setup-cuda lock-cuda demo lint test test-gpu report
setup:
	@scripts/setup.sh

# A GPU machine: .venv-cuda with vLLM's CUDA build and the trainer's needs (README "Your own target").
setup-cuda:
	@scripts/setup.sh --cuda

# Re-pin constraints-cuda.txt after editing requirements-cuda.txt: PyPI metadata only, no wheels.
lock-cuda: setup
	{ sed -n '1,4p' constraints-cuda.txt; .venv/bin/uv pip compile --no-config --quiet \
	    --python-platform x86_64-manylinux_2_28 --python-version 3.11 --no-header --no-annotate \
	    requirements-cuda.txt; } > constraints-cuda.txt.new && mv constraints-cuda.txt.new constraints-cuda.txt

demo: setup
	.venv/bin/snakemake --cores $(CORES) --resources gpu=0
	.venv/bin/snakemake --cores $(CORES) --report results/demo/report.html

# The linters CI runs before the tests: ruff for the Python files (rules in pyproject.toml), snakefmt
# and Snakemake's own --lint for the Snakefile and rules/.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/snakefmt --check Snakefile rules/
	.venv/bin/snakemake --lint --cores 1

test: setup lint
	.venv/bin/python -m pytest -q tests

# The GPU lane (docs/gpu-tests.md): on a CUDA machine, in the environment that holds vLLM's CUDA build
# (after `make setup-cuda`: make test-gpu PYTHON=.venv-cuda/bin/python).
test-gpu:
	$(PYTHON) -m pytest -m gpu tests

# The two commands of the README. Each sets up .venv first (once; see scripts/setup.sh).
CORES ?= all

PYTHON ?= .venv/bin/python

.PHONY: setup demo test test-gpu report
setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/snakemake --cores $(CORES) --resources gpu=0
	.venv/bin/snakemake --cores $(CORES) --report results/demo/report.html

test: setup
	.venv/bin/python -m pytest -q tests

# The GPU lane (docs/gpu-tests.md): on a CUDA machine, in the environment that holds vLLM's CUDA build.
test-gpu:
	$(PYTHON) -m pytest -m gpu tests

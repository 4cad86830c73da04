# The two commands of the README. Each sets up .venv first (once; see scripts/setup.sh).
CORES ?= all

.PHONY: setup demo test report
setup:
	@scripts/setup.sh

demo: setup
	.venv/bin/snakemake --cores $(CORES) --resources gpu=0
	.venv/bin/snakemake --cores $(CORES) --report results/demo/report.html

test: setup
	.venv/bin/python -m pytest -q tests

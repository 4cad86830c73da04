# Draftsmith: train an EAGLE-3 draft model for a target LLM, one cached stage per rule.
# README.md has the stage map; every artifact's contract is in the README's "Artifacts" section.

import os

from snakemake.utils import min_version, validate
from draftsmith.config import check_config, check_semantics, normalize_paths

min_version("9.0")

# Torch's CPU threads wait for the next parallel region by spinning (GNU OpenMP's default): beside
# another busy process a CPU stage then takes several times as long. Sleeping waits cost little
# even on a quiet machine (docs/benchmarks.md, bench/cpu_contention.py). Every job inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The embedded demo's config, unless --configfile names another: a user's config then starts from
# the schema's defaults, not from the demo's settings.
if not workflow.overwrite_configfiles:

    configfile: f"{workflow.basedir}/config/config.yaml"


# Short messages naming each bad key first; then Snakemake fills in the schema's defaults.
check_config(config, f"{workflow.basedir}/config/schema.yaml", workflow.configfiles)
validate(config, "config/schema.yaml")
check_semantics(config, workflow.configfiles)
normalize_paths(config)


include: "rules/common.smk"
include: "rules/target.smk"
include: "rules/data.smk"
include: "rules/extraction.smk"
include: "rules/training.smk"
include: "rules/evaluation.smk"


rule all:
    default_target: True
    input:
        final_outputs(),


rule preflight:
    input:
        rules.inspect_target.output,
        rules.check_setup.output,


rule extract:
    input:
        rules.merge_hidden_states.output,

"""Every snakemake command the documentation shows parses as written: its configfile is a config
file, each target is a rule or a file (`--configfile` takes several values, so a target written
after it would be read as a second config file), and a command that runs jobs says how many cores
it may use (Snakemake 9 stops such a command at once without them)."""

from __future__ import annotations

import re
import shlex

import pytest
from snakemake.cli import get_argument_parser

from workflow_helpers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "config").rglob("*.yaml"))]


def documented_commands() -> list[tuple[str, str]]:
    """(where, command line) for each snakemake command in a code block, inline code or a comment."""
    found = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for match in re.finditer(r"(?:\.venv/bin/)?(?<![\w-])snakemake(?: [^`#\n]*)?", line):
                command = match.group(0).strip()
                if command != "snakemake" and not command.startswith("snakemake-"):
                    found.append((f"{doc.relative_to(ROOT)}:{number}", command))
    return found


def known_rules() -> set[str]:
    sources = [ROOT / "Snakefile", *sorted((ROOT / "rules").glob("*.smk"))]
    return {name for src in sources for name in re.findall(r"^rule (\w+):", src.read_text(), flags=re.M)}


def test_the_readme_shows_commands():
    assert any("preflight" in command for _, command in documented_commands())


@pytest.mark.parametrize("where, command", documented_commands())
def test_each_documented_command_parses_as_meant(where, command):
    args = get_argument_parser().parse_args(shlex.split(command)[1:])
    for configfile in args.configfile or []:
        assert str(configfile).endswith((".yaml", ".yml")), \
            f"{where}: {command!r} reads {configfile} as a config file (put targets before --configfile)"
    runs_no_job = (args.dryrun or args.unlock or args.report or args.lint is not None or args.dag is not None
                   or args.rulegraph is not None)
    assert runs_no_job or args.cores is not None or args.profile, \
        f"{where}: {command!r} needs --cores (or a --profile that sets it): Snakemake 9 refuses to run without"
    rules = known_rules()
    for target in args.targets or []:
        assert target in rules or "/" in target or "." in target, f"{where}: {command!r}: unknown target {target}"

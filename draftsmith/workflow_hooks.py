"""What the workflow's Snakemake hooks do beside the gate and the warm engines: check that Snakemake
plans with the workflow's own profile, ``profiles/default``, and end the scheduler's last timer.

That profile turns Snakemake's ``code`` rerun trigger off: the trigger reruns a rule whenever its
script file is newer than its outputs, after a comment edit or a git checkout that leaves the code
as it was (at scale, training from step 0); each rule's code fingerprint reruns it on a real change
instead (docs/design.md, "What a patch reruns"). Snakemake reads that profile only when no other
takes its place: ``./default`` in the folder Snakemake starts from is read first, and
``--workflow-profile none`` or another profile turns it off, all without a word. A module of its
own, called by the workflow's hooks alone, so that no rule's code fingerprint takes it in. Dry runs
call no hooks, so a dry run without the profile goes unchecked (its plan shows the reruns).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from draftsmith.errors import ConfigError


def cancel_scheduler_timers() -> None:
    """The scheduling is over: end the timer Snakemake's job-rate limiter set when it started the
    last job, which Python would otherwise wait for at exit (up to its 1-s timespan, a tenth of the
    preflight's budget). Snakemake 9's own; a release without it leaves nothing to cancel."""
    import threading

    for thread in threading.enumerate():
        name = getattr(getattr(thread, "function", None), "__qualname__", "")
        if isinstance(thread, threading.Timer) and "_schedule_reevalutation" in name:
            thread.cancel()


def check_workflow_profile(rerun_triggers: Collection[str], workdir: Path, workflow_dir: Path) -> None:
    """Refuse a plan whose rerun triggers include ``code`` (Snakemake's trigger names, lower case),
    naming what took the workflow profile's place."""
    if "code" not in rerun_triggers:
        return
    ours = (workflow_dir / "profiles" / "default").resolve()
    shadow = workdir / "default"
    if shadow.exists() and shadow.resolve() != ours:
        where = str(shadow.resolve())
        cause = ("Snakemake read ./default as the workflow profile, before profiles/default (it looks in "
                 "the folder it was started from first)")
        fix = f"rename {shadow.resolve()} (or start Snakemake from another folder), then run the same command"
    else:
        where = "the snakemake command line"
        cause = ("the workflow profile profiles/default is not in effect: --workflow-profile none or another "
                 "workflow profile, --rerun-triggers naming code, or a ./default in the folder Snakemake was "
                 "started from before --directory")
        fix = ("leave out --workflow-profile (profiles/local and profiles/slurm go with --profile, beside it) "
               "and --rerun-triggers, and start Snakemake from the workflow's folder")
    raise ConfigError(f"{cause}: Snakemake's rerun triggers include 'code', which reruns a stage after a comment "
                      "edit or a git checkout (training from step 0)", where=where, fix=fix)

"""Logging for workflow scripts: to the rule's log file and to the terminal."""

from __future__ import annotations

import logging
import os
import sys

from draftsmith.errors import DraftsmithError


def setup_logging(log_path: str | None) -> None:
    """Send INFO and above to ``log_path`` (the rule's log) and to stderr; an error that stops the
    script is written to the log too, so the log alone says why the rule failed."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        # Emptied here, then appended to: a library that reconfigures logging (logging.config's
        # dictConfig closes every existing handler, as happens while vLLM starts its engine under
        # Snakemake) leaves a closed handler, which reopens an "a" file on the next message but
        # drops every message of a "w" one.
        open(log_path, "w", encoding="utf-8").close()
        handlers.append(logging.FileHandler(log_path, mode="a", encoding="utf-8"))
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.excepthook = _log_uncaught
    logging.getLogger("draftsmith").info("CPU threads: OMP_NUM_THREADS=%s, OMP_WAIT_POLICY=%s",
                                         os.environ.get("OMP_NUM_THREADS", "unset"),
                                         os.environ.get("OMP_WAIT_POLICY", "unset"))


def _log_uncaught(kind, error, traceback) -> None:
    if not issubclass(kind, KeyboardInterrupt):
        # A DraftsmithError says what, where and how to fix; a traceback adds nothing for the user.
        details = None if isinstance(error, DraftsmithError) else (kind, error, traceback)
        logging.getLogger("draftsmith").error("%s: %s", kind.__name__, error, exc_info=details)
    sys.__excepthook__(kind, error, traceback)

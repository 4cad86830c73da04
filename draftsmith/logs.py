"""Logging for workflow scripts: to the rule's log file and to the terminal."""

from __future__ import annotations

import logging
import os
import sys

from draftsmith.errors import DraftsmithError

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(log_path: str | None) -> None:
    """Send INFO and above to ``log_path`` (the rule's log) and to stderr; an error that stops the
    script is written to both, its traceback to the log alone where the error is a DraftsmithError
    (its what, where and fix are what the console needs), so the log alone says why the rule failed."""
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(_ConsoleFormatter(FORMAT))
    handlers: list[logging.Handler] = [console]
    if log_path:
        # Emptied here, then appended to: a library that reconfigures logging (logging.config's
        # dictConfig closes every existing handler, as happens while vLLM starts its engine under
        # Snakemake) leaves a closed handler, which reopens an "a" file on the next message but
        # drops every message of a "w" one.
        open(log_path, "w", encoding="utf-8").close()
        handlers.append(logging.FileHandler(log_path, mode="a", encoding="utf-8"))
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True, format=FORMAT)
    sys.excepthook = _log_uncaught
    logging.getLogger("draftsmith").info("CPU threads: OMP_NUM_THREADS=%s, OMP_WAIT_POLICY=%s",
                                         os.environ.get("OMP_NUM_THREADS", "unset"),
                                         os.environ.get("OMP_WAIT_POLICY", "unset"))


def _log_uncaught(kind, error, traceback) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, error, traceback)
        return
    # Logged once, with its traceback (which the console leaves out of a DraftsmithError); Python's
    # own hook would print the traceback to the console a second time. The exit status stays 1.
    logging.getLogger("draftsmith").error("%s: %s", kind.__name__, error, exc_info=(kind, error, traceback))


class _ConsoleFormatter(logging.Formatter):
    """The console's format: a DraftsmithError's what, where and fix without its traceback, which
    says nothing a user can act on (the log file keeps it for whoever debugs)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info and isinstance(record.exc_info[1], DraftsmithError):
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        return super().format(record)

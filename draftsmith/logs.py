"""Logging for workflow scripts: to the rule's log file and to the terminal."""

from __future__ import annotations

import logging
import sys


def setup_logging(log_path: str | None) -> None:
    """Send INFO and above to ``log_path`` (the rule's log) and to stderr."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_path:
        handlers.append(logging.FileHandler(log_path, mode="w", encoding="utf-8"))
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

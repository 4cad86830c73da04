"""``python -m draftsmith.engines list|stop``: the warm target engines of this user on this machine."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from draftsmith.engines.registry import engine_alive, forget_engine, list_engines, registry, stop_engine, stop_if_idle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftsmith.engines", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every engine, live or not, with what it runs")
    stop = commands.add_parser("stop", help="stop idle engines (all, or those whose keys are given) and forget "
                                            "the folders of those that are gone")
    stop.add_argument("keys", nargs="*", help="engine keys, as `list` prints them")
    stop.add_argument("--force", action="store_true", help="also engines a job is attached to (that job fails)")
    args = parser.parse_args(argv)
    engines = list_engines()
    if args.command == "list":
        print(f"warm target engines in {registry()}:" if engines else f"no warm target engines in {registry()}")
        for e in engines:
            if not e["alive"]:
                status = f"exited ({e['reason']})" if e.get("status") == "exited" else "gone (its process died)"
            else:
                status = f"busy (job pid {e['attached']})" if e.get("attached") else e.get("status", "?")
            since = f", last job {time.time() - e['last_job']:.0f} s ago" if e.get("last_job") else ""
            print(f"  {e['key']}  pid {e.get('pid')}  {status}{since}\n    {e.get('what')}: {e.get('model')} "
                  f"on {e.get('gpus')}")
        return 0
    wanted = [e for e in engines if not args.keys or e["key"] in args.keys]
    for e in wanted:
        if not e["alive"]:
            forget_engine(Path(e["folder"]))
            continue
        if args.force:
            print(f"  {e['key']}: " + ("stopped" if stop_engine(Path(e["folder"])) else "had already exited"))
        elif stop_if_idle(Path(e["folder"])):
            print(f"  {e['key']}: stopped")
        elif not engine_alive(Path(e["folder"])):
            print(f"  {e['key']}: had already exited")
        else:  # checked again under its start lock: a job came since the list was read
            print(f"  {e['key']}: a job is loading it, attaching to it or attached to it; --force stops it anyway")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m draftsmith.online.worker launch.json``: one torchrun process of online training."""

from __future__ import annotations

from draftsmith.extract.settings import ExtractionSettings
from draftsmith.io import read_json
from draftsmith.online.plan import OnlinePlan, OnlineSettings
from draftsmith.online.window import WindowSource
from draftsmith.targets.inspect import read_target_json
from draftsmith.train.launch import worker_args
from draftsmith.train.loop import train_draft


def main(argv: list[str] | None = None) -> None:
    args, settings = worker_args(argv, prog="python -m draftsmith.online.worker")
    spec = read_json(args.pop("online_spec"))
    pid = args.pop("producer_pid")
    online = OnlineSettings(**spec["online"])
    plan = OnlinePlan.build(spec["train_jsonl"], read_target_json(spec["target_json"]), spec["window"],
                            ExtractionSettings(**spec["extraction"]), online)
    train_draft(settings=settings, source=WindowSource(plan, online, pid), **args)


if __name__ == "__main__":
    main()

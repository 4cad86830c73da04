"""``python -m draftsmith.train launch.json``: one torchrun worker process."""

from draftsmith.train.launch import main

main()

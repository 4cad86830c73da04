"""Online training: the engine makes hidden states while the draft trains on them, through a
bounded window of shards on disk (``train.mode: online``).

* ``plan``      the shards, the order the engine makes them in (training's order), the window needed
* ``window``    the trainer's side: wait for a shard, delete it once trained on, publish progress
* ``producer``  the engine's side (its own process): make the shards in order, waiting for room
* ``run``       ``run_online_training``: start the producer on its GPUs, train on the others
* ``worker``    a torchrun process of online training (``python -m draftsmith.online.worker``)

docs/design.md ("Online training") says why a window of the shard store and not a stream.
"""

from draftsmith.online.plan import OnlinePlan, OnlineSettings, Unit
from draftsmith.online.run import run_online_training, split_devices

__all__ = ["OnlinePlan", "OnlineSettings", "Unit", "run_online_training", "split_devices"]

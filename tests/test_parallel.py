"""The CPU stages' worker processes: results in the items' order, items read only as workers free
up, a worker's error raised in the caller as it was raised."""

from __future__ import annotations

import os
import time

import pytest

from draftsmith.errors import DataError, DraftsmithError
from draftsmith.parallel import IN_FLIGHT_PER_WORKER, ordered_map


def where_it_ran(item: int) -> tuple[int, int, str | None]:
    time.sleep(0.002 * (item % 4))  # finish out of order
    return item, os.getpid(), os.environ.get("TOKENIZERS_PARALLELISM")


def fails_at_five(item: int) -> int:
    if item == 5:
        raise DataError("item 5 is bad", where="item 5", fix="drop it")
    return item


def test_results_come_back_in_order_from_the_worker_processes():
    with ordered_map(where_it_ran, 3) as run:
        results = list(run(range(40)))
    assert [item for item, _, _ in results] == list(range(40))
    pids = {pid for _, pid, _ in results}
    assert len(pids) > 1 and os.getpid() not in pids
    assert {env for _, _, env in results} == {"false"}  # one core each: no tokenizer thread pool


def test_one_worker_is_this_process():
    with ordered_map(where_it_ran, 1) as run:
        assert {pid for _, pid, _ in run(range(5))} == {os.getpid()}


def test_items_are_read_only_as_results_are_taken():
    read = []

    def items():
        for i in range(60):
            read.append(i)
            yield i

    with ordered_map(where_it_ran, 2) as run:
        for taken, _ in enumerate(run(items()), start=1):
            assert len(read) <= taken + IN_FLIGHT_PER_WORKER * 2
    assert len(read) == 60


@pytest.mark.parametrize("workers", [1, 2])
def test_an_error_in_a_task_reaches_the_caller_with_where_and_fix(workers):
    with ordered_map(fails_at_five, workers) as run, pytest.raises(DataError) as info:
        list(run(range(20)))
    assert (info.value.what, info.value.where, info.value.fix) == ("item 5 is bad", "item 5", "drop it")


def _die(item):
    if item == 3:
        os._exit(9)  # as the out-of-memory killer leaves a worker: no exception, no message
    return item


def test_a_worker_killed_mid_stage_is_named_not_a_broken_pool():
    with pytest.raises(DraftsmithError, match="a worker process of this stage ended") as error:
        with ordered_map(_die, 2) as mapped:
            list(mapped(range(8)))
    assert "fewer workers" in error.value.fix

"""Threads the library starts take torch's intra-op thread count (swarmgrad.utils.torch_threads)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from swarmgrad.utils.loop_thread import run_coroutine, shutdown_loop
from swarmgrad.utils.torch_threads import follow_torch_threads
from tests.helpers.processes import last_line_of_python

TASKS = "/proc/self/task"


def os_threads_started_by_a_matrix_product() -> int:
    """How many OS threads one small matrix product starts in the calling thread (an
    OpenMP team that MKL runs it on): the thread ids that appear during it. Not the
    change in the count: a thread of an earlier test that ended meanwhile made that -1
    once in a full run."""
    before = set(os.listdir(TASKS))
    inputs = torch.randn(8, 300)
    _ = inputs @ inputs.T
    return len(set(os.listdir(TASKS)) - before)


def in_a_new_thread(prepare) -> int:
    started = []

    def run() -> None:
        prepare()
        started.append(os_threads_started_by_a_matrix_product())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return started[0]


@pytest.fixture
def one_intra_op_thread():
    if not os.path.isdir(TASKS):
        pytest.skip("counts OS threads through /proc")
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    shutdown_loop()  # the loop thread starts again under this setting
    try:
        yield
    finally:
        shutdown_loop()
        torch.set_num_threads(saved)


def test_a_thread_that_follows_torch_runs_a_matrix_product_on_itself_alone(one_intra_op_thread):
    if in_a_new_thread(lambda: None) == 0:
        pytest.skip("this torch build starts no OpenMP team for a product in a new thread")
    # without the call, the product above started a team despite set_num_threads(1)
    assert in_a_new_thread(follow_torch_threads) == 0


def test_the_event_loop_thread_follows_torchs_thread_count(one_intra_op_thread):
    if in_a_new_thread(lambda: None) == 0:
        pytest.skip("this torch build starts no OpenMP team for a product in a new thread")

    async def product() -> int:
        return os_threads_started_by_a_matrix_product()

    assert run_coroutine(product(), timeout=30) == 0


def test_a_dht_only_peer_never_imports_torch():
    """A DHT peer (bootstrap, benchmarks/dht.py's peers) stays ~30 MB: starting the loop
    thread must not pull torch in to follow its thread count."""
    script = (
        "import sys\n"
        "from swarmgrad.dht import DHT\n"
        "from swarmgrad.utils.timeutils import get_dht_time\n"
        "dht = DHT(start=True)\n"
        "dht.store('key', 'value', expiration_time=get_dht_time() + 60)\n"
        "dht.shutdown()\n"
        "print('torch' in sys.modules)\n"
    )
    assert last_line_of_python(script) == "False", "starting a DHT imported torch"

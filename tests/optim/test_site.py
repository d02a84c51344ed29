"""Sites under torch.distributed (swarmgrad.optim.site) with real processes: two sites of
two ranks each (one under torchrun, one under site_launch) train together and every rank
ends with the same parameters; ranks that disagree on the model are told which tensor on
which ranks; a speaker SIGKILLed mid-epoch is replaced by the surviving rank, which
keeps training with the swarm. The worker is tests/helpers/site_worker.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from swarmgrad.dht import DHT
from swarmgrad.optim.site import SiteMismatch, _describe_mismatch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "site_worker.py")
DEADLINE = 120  # per site; a healthy run takes 10-20 s


def _env() -> dict:
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{path}" if path else str(ROOT))


def torchrun_site(site: str, peers: str, out: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", WORKER, "--peers", peers, "--site", site]
    return subprocess.Popen(
        [*command, "--out", str(out), *args],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def launched_site(site: str, peers: str, out: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "swarmgrad.optim.site_launch", "--nproc-per-node", "2"]
    command += [WORKER, "--peers", peers, "--site", site, "--out", str(out), *args]
    return subprocess.Popen(
        command, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def finish(*processes: subprocess.Popen) -> list[int]:
    codes = []
    try:
        for process in processes:
            codes.append(process.wait(DEADLINE))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    return codes


def events(out: Path, site: str, rank: int) -> list[dict]:
    path = out / f"{site}-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def epochs(out: Path, site: str, rank: int) -> dict[int, list[float]]:
    return {e["epoch"]: e["params"] for e in events(out, site, rank) if e["event"] == "epoch"}


def done(out: Path, site: str, rank: int) -> dict:
    finished = [e for e in events(out, site, rank) if e["event"] == "done"]
    assert finished, f"rank {rank} of site {site} did not finish: {events(out, site, rank)}"
    return finished[-1]


def gap(a: list[float], b: list[float]) -> float:
    return float((torch.tensor(a) - torch.tensor(b)).abs().max())


@pytest.fixture
def bootstrap():
    dht = DHT(start=True)
    try:
        yield str(dht.get_visible_maddrs()[0])
    finally:
        dht.shutdown()


def test_two_sites_of_two_ranks_end_with_identical_parameters(bootstrap, tmp_path):
    codes = finish(
        torchrun_site("a", bootstrap, tmp_path, "--until", "4", "--start-with", "4"),
        launched_site("b", bootstrap, tmp_path, "--until", "4", "--start-with", "4"),
    )
    assert codes == [0, 0]
    for site in "ab":
        first, second = epochs(tmp_path, site, 0), epochs(tmp_path, site, 1)
        assert sorted(first) == sorted(second) == [0, 1, 2, 3]
        for epoch in first:  # the ranks of a site hold the same bits at every epoch
            assert first[epoch] == second[epoch], (site, epoch)
        assert first[1] != first[0], "the site trained"
    finals = [done(tmp_path, site, rank) for site in "ab" for rank in (0, 1)]
    assert all(f["epoch"] == 4 and f["failovers"] == 0 for f in finals)
    assert finals[0]["params"] == finals[1]["params"]
    assert finals[2]["params"] == finals[3]["params"]
    assert gap(finals[0]["params"], finals[2]["params"]) < 1e-6, "the sites agree"


def test_diloco_sites_mirror_inner_steps_and_receive_parameters_only_when_they_change(
    bootstrap, tmp_path
):
    codes = finish(
        torchrun_site("a", bootstrap, tmp_path, "--until", "3", "--diloco", "--start-with", "4"),
        torchrun_site("b", bootstrap, tmp_path, "--until", "3", "--diloco", "--start-with", "4"),
    )
    assert codes == [0, 0]
    for site in "ab":
        first, second = epochs(tmp_path, site, 0), epochs(tmp_path, site, 1)
        assert sorted(first) == sorted(second) == [0, 1, 2]
        for epoch in first:
            assert first[epoch] == second[epoch], (site, epoch)
        final = done(tmp_path, site, 1)
        assert final["params"] == done(tmp_path, site, 0)["params"]
        # the other rank ran the inner steps itself: parameters came from the speaker at
        # outer steps (and once more if the speaker loaded the swarm's state), not per step
        assert final["broadcasts"] <= 3 + 2 and final["steps"] >= 10, final
    assert gap(done(tmp_path, "a", 0)["params"], done(tmp_path, "b", 0)["params"]) < 1e-6


def test_ranks_that_disagree_on_the_model_are_told_which_tensor_and_ranks(tmp_path):
    codes = finish(torchrun_site("m", "/ip4/127.0.0.1/tcp/1", tmp_path, "--wide-rank", "1"))
    assert codes == [0]
    for rank in (0, 1):
        (event,) = events(tmp_path, "m", rank)
        assert event["event"] == "mismatch"
        message = event["message"]
        assert "0.weight" in message, message
        assert "[16, 8] torch.float32 on rank 0" in message, message
        assert "[16, 9] torch.float32 on rank 1" in message, message


def test_describe_mismatch_names_counts_and_dtypes():
    same = [("w", (2, 3), "torch.float32")]
    assert _describe_mismatch({0: same, 1: same, 2: same}) is None
    fewer = _describe_mismatch({0: same, 1: same + same, 2: same})
    assert fewer == "number of parameters: 1 on ranks 0, 2; 2 on rank 1"
    other = _describe_mismatch({0: same, 1: [("w", (2, 3), "torch.float16")]})
    assert other == "w (tensor 0) is [2, 3] torch.float32 on rank 0; [2, 3] torch.float16 on rank 1"
    assert issubclass(SiteMismatch, ValueError)


def test_a_site_whose_speaker_is_killed_elects_the_survivor_and_trains_on(bootstrap, tmp_path):
    codes = finish(
        launched_site(
            "a", bootstrap, tmp_path, "--until", "5", "--kill-speaker-at", "2", "--start-with", "4"
        ),
        torchrun_site("b", bootstrap, tmp_path, "--until", "5", "--start-with", "4"),
    )
    assert codes == [0, 0], "site_launch: a rank killed by a signal is lost, not an error"
    dying = events(tmp_path, "a", 0)[-1]
    assert dying["event"] == "dying"
    killed_in = dying["epoch"]  # 2, or later if the site lagged at start-up
    survivor = done(tmp_path, "a", 1)
    assert survivor["failovers"] == 1 and survivor["members"] == [1] and survivor["speaker"] == 1
    assert survivor["epoch"] == 5
    mine = epochs(tmp_path, "a", 1)
    assert mine[killed_in] == epochs(tmp_path, "a", 0)[killed_in], "in step until it died"
    after = sorted(e for e in mine if e > killed_in)
    assert after == list(range(killed_in + 1, 5)), "the survivor counts on with the swarm"
    # the new speaker is a peer of the swarm: it saw the other site in the run's progress
    seen = [e["peers"] for e in events(tmp_path, "a", 1) if e["event"] == "epoch"]
    assert max(seen[-len(after) :]) >= 2, seen
    assert done(tmp_path, "b", 0)["epoch"] == 5

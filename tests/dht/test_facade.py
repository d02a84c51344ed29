"""The DHT facade and the ``swarmgrad dht`` command across real processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from swarmgrad.dht import DHT, Ed25519SignatureValidator
from swarmgrad.net.identity import Identity
from swarmgrad.utils.errors import PeerUnreachable, ValidationError
from swarmgrad.utils.timeutils import get_dht_time
from tests.helpers.processes import stop_with_sigterm

pytestmark = pytest.mark.slow


def start_cli_peer(*extra: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swarmgrad.cli.main",
            "dht",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--refresh-period",
            "0.3",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        match = re.search(r"--initial-peers (\S+)", line)
        if match:
            return proc, match.group(1)
    proc.kill()
    raise AssertionError(f"the CLI peer did not print its address: {proc.stdout.read()}")


def test_cli_peers_find_each_other_and_serve_a_client_then_stop_cleanly():
    first, first_addr = start_cli_peer()
    second, _ = start_cli_peer("--initial-peers", first_addr)
    try:
        with DHT(initial_peers=[first_addr], start=True, client_mode=True) as client:
            assert client.store("greeting", "hello", get_dht_time() + 60)
        # another process reads it back
        reader = subprocess.run(
            [
                sys.executable,
                "-c",
                textwrap.dedent(f"""
                from swarmgrad.dht import DHT
                dht = DHT(initial_peers=["{first_addr}"], start=True, client_mode=True)
                print("GOT", dht.get("greeting", latest=True).value)
                dht.shutdown()
            """),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "GOT hello" in reader.stdout, reader.stderr
        time.sleep(1.0)  # two status lines
    finally:
        out_second = stop_with_sigterm(second, timeout=30)
        out_first = stop_with_sigterm(first, timeout=30)
    assert second.returncode == 0 and first.returncode == 0
    assert "Shutting down" in out_first and "Shutting down" in out_second
    assert re.search(r"routing table: [1-9]\d* peers", out_second), out_second


def test_bootstrap_from_unreachable_peers_names_them():
    bogus = f"/ip4/127.0.0.1/tcp/9/p2p/{Identity.generate().peer_id}"
    with pytest.raises(PeerUnreachable, match=r"could not reach any initial peer.*tcp/9"):
        DHT(initial_peers=[bogus], start=True, dial_timeout=2.0)


def test_store_get_and_signed_records_through_the_facade():
    with DHT(start=True) as first:
        addrs = [str(m) for m in first.get_visible_maddrs()]
        owner = Ed25519SignatureValidator(Identity.generate())
        with DHT(initial_peers=addrs, start=True, record_validators=[owner]) as second:
            now = get_dht_time()
            assert second.store("plain", [1, 2, 3], now + 30)
            future = first.get("plain", return_future=True)
            assert future.result(timeout=10).value == [1, 2, 3]
            protected = b"weights" + owner.local_public_key
            assert second.store(protected, "mine", now + 30)
            first.add_validators([Ed25519SignatureValidator(Identity.generate())])
            assert first.get(protected, latest=True).value == "mine"
            # another identity cannot overwrite the owner's record
            assert not first.store(protected, "forged", now + 60)
            assert second.get(protected, latest=True).value == "mine"
            with pytest.raises(ValidationError, match="msgpack"):
                second.store("bad", object(), now + 30)
            result = second.run_coroutine(_count_routing)
            assert result >= 1


async def _count_routing(dht, node):
    return len(node.routing)


def test_facade_refuses_use_before_start():
    dht = DHT()
    with pytest.raises(ValidationError, match="not running"):
        dht.get("x")
    assert os.environ is not None

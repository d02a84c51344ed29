"""The command line end to end: an authority, a ``swarmgrad dht`` process that admits only
its token holders, a Python ``DHT(authority=...)`` that joins it, an open peer that is
refused, and a revocation list published with ``swarmgrad authority revoke``."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from swarmgrad.cli.main import main as cli_main
from swarmgrad.dht import DHT
from swarmgrad.dht.revocation import REVOCATION_KEY
from swarmgrad.net.admission import AccessToken, RevocationList
from swarmgrad.net.identity import Identity
from swarmgrad.utils.errors import PeerUnreachable
from swarmgrad.utils.timeutils import get_dht_time
from tests.helpers.processes import stop_with_sigterm


def start_dht(*argv: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmgrad.cli.main", "dht", "--host-maddrs",
         "/ip4/127.0.0.1/tcp/0", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if match := re.match(r"Running a DHT peer\. To join, use --initial-peers (\S+)", line):
            return proc, match.group(1)
    proc.kill()
    raise AssertionError(f"no banner; stderr: {proc.stderr.read()}")


@pytest.mark.slow
def test_dht_command_admits_token_holders_only(tmp_path, capsys):
    key, pub = tmp_path / "authority.key", tmp_path / "authority.pub"
    assert cli_main(["authority", "init", "--key", str(key)]) == 0
    capsys.readouterr()
    tokens = {}
    for name in ("bootstrap", "volunteer"):
        identity = tmp_path / f"{name}.id"
        assert cli_main(["authority", "whoami", "--identity-path", str(identity)]) == 0
        peer_id = capsys.readouterr().out.strip()
        tokens[name] = tmp_path / f"{name}.token"
        assert cli_main(["authority", "issue", "--key", str(key), "--peer-id", peer_id,
                         "--output", str(tokens[name])]) == 0  # fmt: skip
        capsys.readouterr()
    proc, address = start_dht(
        "--identity-path", str(tmp_path / "bootstrap.id"),
        "--authority-key", str(pub),
        "--access-token", str(tokens["bootstrap"]),
    )  # fmt: skip
    try:
        volunteer = DHT(
            initial_peers=[address],
            identity_path=str(tmp_path / "volunteer.id"),
            authority=str(pub),
            access_token=str(tokens["volunteer"]),
            start=True,
        )
        try:
            assert volunteer.store("greeting", "hello", get_dht_time() + 60)
            assert volunteer.get("greeting", latest=True).value == "hello"

            with pytest.raises(PeerUnreachable, match=r"admission refused \(no token\)"):
                DHT(initial_peers=[address], start=True, startup_timeout=30)

            revoked = Identity.generate().peer_id
            argv = ["authority", "revoke", "--key", str(key), "--peer-id", str(revoked)]
            assert cli_main([*argv, "--initial-peers", address]) == 0
            assert "Published" in capsys.readouterr().out
            found = volunteer.get(REVOCATION_KEY, latest=True)
            assert found is not None
            revocations = RevocationList.decode(found.value)
            assert revocations.serial == 1 and revoked in revocations.peers
            token = AccessToken.load(tokens["volunteer"])
            assert not revocations.revokes(token)
        finally:
            volunteer.shutdown()
    finally:
        stop_with_sigterm(proc, timeout=30)

"""The network lab itself (``benchmarks/_star_lab.StarLab``): the byte counters that the
slow-links benchmark reads for its rates. Namespaces ``stlt*``, subnet 10.87.3.0/24, used
by no other test; skips with the reason where the lab cannot be built."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _star_lab


@pytest.mark.netlab
@pytest.mark.timeout(60)
def test_one_snapshot_of_every_hosts_sent_bytes_matches_each_hosts_own_counter():
    reason = _star_lab.lab_unavailable_reason()
    if reason is not None:
        pytest.skip(f"network lab unavailable: {reason}")
    with _star_lab.StarLab(2, "20mbit", prefix="stlt", subnet="10.87.3") as lab:
        before = lab.tx_bytes_all()
        # host 0 sends 40 datagrams of 1,000 bytes to host 1 (which sends back at most
        # a few small "port unreachable" errors)
        send = (
            "import socket, sys\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "for _ in range(40): s.sendto(b'x' * 1000, (sys.argv[1], 9))\n"
        )
        command = [*lab.exec_prefix(0), sys.executable, "-c", send, lab.addresses[1]]
        subprocess.run(command, capture_output=True, timeout=30, check=True)
        after = lab.tx_bytes_all()
        sent = [a - b for a, b in zip(after, before, strict=True)]
        assert sent[0] >= 40 * 1000 > 10 * sent[1]
        # each host's own counter, read after the snapshot and before another, lies
        # between them (the hub's ends receive what the hosts' ends send; IPv6's own
        # chatter may add a packet meanwhile)
        own = [lab.tx_bytes(0), lab.tx_bytes(1)]
        later = lab.tx_bytes_all()
        assert all(a <= o <= b for a, o, b in zip(after, own, later, strict=True))
        assert all(b - a < 1000 for a, b in zip(after, later, strict=True))

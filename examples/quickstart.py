"""The quickstart: call experts hosted by another process, train through them, then use
a mixture-of-experts layer over all of them.

First start an expert server (in another terminal)::

    swarmgrad server --expert-cls ffn --hidden-dim 512 --num-experts 5 \
                     --expert-pattern "expert.[0:5]"

It prints ``To join, use --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/12D3KooW...``; then::

    python examples/quickstart.py /ip4/127.0.0.1/tcp/PORT/p2p/12D3KooW...

``python examples/quickstart.py --start-server`` does both: it starts the server above
as a child process, runs the quickstart against it and stops it.

This is hivemind's quickstart with one import changed (``import swarmgrad as hivemind``
works too) and ``get_experts(dht, uids)`` in place of the older ``dht.get_experts(uids)``.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import time

import torch

import swarmgrad


def quickstart(initial_peers: list[str]) -> None:
    # client_mode=True: this peer calls experts but hosts nothing and stores no DHT data
    dht = swarmgrad.DHT(initial_peers=initial_peers, client_mode=True, start=True)

    expert1, expert4 = swarmgrad.get_experts(dht, ["expert.1", "expert.4"])
    assert expert1 is not None and expert4 is not None, "experts not found: check the address"

    dummy = torch.randn(3, 512)
    out = expert1(dummy)  # forward pass, computed by the server
    out.sum().backward()  # backward pass: the server also updates expert.1's weights

    # train a local projection on top of two remote experts
    x = torch.randn(3, 512)
    y = 0.01 * x.sum(dim=-1, keepdim=True)
    proj_out = torch.nn.Sequential(torch.nn.Linear(512, 3))
    opt = torch.optim.SGD(proj_out.parameters(), lr=0.01)
    for step in range(100):
        prediction = proj_out(expert1(expert4(x)))
        loss = torch.mean(abs(prediction - y))
        if step % 20 == 0 or step == 99:
            print(f"step {step}: loss {loss.item():.4f}")
        opt.zero_grad()
        loss.backward()
        opt.step()

    # a mixture-of-experts layer over the 5 experts of the grid, 2 per sample
    dmoe = swarmgrad.RemoteMixtureOfExperts(
        in_features=512, uid_prefix="expert", grid_size=(5,), dht=dht, k_best=2
    )
    out = dmoe(torch.randn(3, 512))
    out.sum().backward()
    print(f"mixture-of-experts output {tuple(out.shape)}, gate gradient computed")
    dht.shutdown()


@contextlib.contextmanager
def expert_server():
    """The quickstart's server, as a child process; yields its address."""
    server = subprocess.Popen(
        [
            sys.executable, "-m", "swarmgrad.cli.main", "server",
            "--expert-cls", "ffn", "--hidden-dim", "512", "--num-experts", "5",
            "--expert-pattern", "expert.[0:5]", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        for line in server.stdout:
            found = re.search(r"--initial-peers (/ip4/\S+)", line)
            if found:
                yield found.group(1)
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the expert server did not start within 120 s")
        else:
            raise RuntimeError(f"the expert server exited with code {server.wait()}")
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description="swarmgrad quickstart")
    parser.add_argument("initial_peers", nargs="*", help="the expert server's multiaddr")
    parser.add_argument("--start-server", action="store_true", help="start the server too")
    args = parser.parse_args()
    if args.start_server:
        with expert_server() as address:
            quickstart([address])
    elif args.initial_peers:
        quickstart(args.initial_peers)
    else:
        parser.error("give the server's multiaddr, or --start-server")


if __name__ == "__main__":
    main()

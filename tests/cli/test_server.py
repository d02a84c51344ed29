"""``swarmgrad server``: options and config files, and a real server process that serves
raw protocol calls and stops cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from swarmgrad.cli import server_command
from swarmgrad.compression.wire import tensors_from_message, tensors_to_message
from swarmgrad.moe import protocol
from swarmgrad.net.peer import Peer

TIMEOUT = 30.0


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    server_command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["server", *argv])


def test_both_flag_spellings_work_and_unset_options_take_defaults():
    argv = ["--expert_cls", "nop", "--hidden-dim", "8", "--num_experts", "2"]
    settings = server_command.resolve_settings(parse(*argv, "--compression", "FLOAT16"))
    assert settings["expert_cls"] == "nop" and settings["hidden_dim"] == 8
    assert settings["num_experts"] == 2 and settings["compression"] == "float16"
    assert settings["max_batch_size"] == 4096 and settings["update_period"] == 30.0


@pytest.mark.parametrize("suffix", [".json", ".toml", ".yaml"])
def test_a_config_file_fills_options_and_the_command_line_overrides_it(tmp_path, suffix):
    config = {
        "expert-cls": "nop",
        "hidden_dim": 16,
        "num_experts": 3,
        "initial_peers": ["/ip4/1.2.3.4/tcp/5"],
        "increase_file_limit": True,
    }
    path = tmp_path / f"server{suffix}"
    if suffix == ".toml":
        path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in config.items()))
    else:  # JSON is valid YAML
        path.write_text(json.dumps(config))
    settings = server_command.resolve_settings(parse("--config", str(path), "--hidden-dim", "32"))
    assert settings["expert_cls"] == "nop" and settings["num_experts"] == 3
    assert settings["hidden_dim"] == 32  # the command line wins
    assert settings["initial_peers"] == ["/ip4/1.2.3.4/tcp/5"] and settings["increase_file_limit"]


def test_a_false_flag_in_the_config_file_turns_the_option_off_unless_the_command_line_says(
    tmp_path,
):
    """``use_relay = false`` stands for ``--no-relay`` (it was once dropped silently)."""
    path = tmp_path / "server.toml"
    path.write_text('expert_cls = "nop"\nuse_relay = false\nuse_auto_relay = false\n')
    settings = server_command.resolve_settings(parse("--config", str(path)))
    assert settings["use_relay"] is False and settings["use_auto_relay"] is False
    path.write_text('expert_cls = "nop"\n')
    assert server_command.resolve_settings(parse("--config", str(path)))["use_relay"] is True
    path.write_text('expert_cls = "nop"\nuse_relay = true\n')  # on by default: accepted
    assert server_command.resolve_settings(parse("--config", str(path)))["use_relay"] is True
    path.write_text('expert_cls = "nop"\nuse_relay = false\n')
    assert (
        server_command.resolve_settings(parse("--config", str(path), "--no-relay"))["use_relay"]
        is False
    )


def test_a_bad_config_file_is_named_in_the_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"expert_cls": "nop", "hiden_dim": 8}')
    with pytest.raises(ValueError, match=r"bad\.json.*unknown options \['hiden_dim'\]"):
        server_command.resolve_settings(parse("--config", str(bad)))
    broken = tmp_path / "broken.toml"
    broken.write_text("hidden_dim = = 3")
    with pytest.raises(ValueError, match=r"broken\.toml"):
        server_command.resolve_settings(parse("--config", str(broken)))


def run_cli(*argv: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "swarmgrad.cli.main", "server", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def read_banner(proc: subprocess.Popen) -> tuple[list[str], list[str]]:
    """The served uids and multiaddrs, from the two documented stdout lines."""
    uids: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if match := re.match(r"Serving \d+ \S+ experts \(hidden_dim \d+\): (.+)$", line):
            uids = match.group(1).split()
        if match := re.match(
            r"Running an expert server\. To join, use --initial-peers (.+)$", line
        ):
            return uids, match.group(1).split()
    proc.kill()
    raise AssertionError(f"no banner; stderr: {proc.stderr.read()}")


@pytest.mark.slow
def test_a_server_process_serves_raw_calls_and_exits_cleanly_on_sigterm(arun):
    proc = run_cli(
        "--expert_cls",
        "ffn",
        "--hidden-dim",
        "8",
        "--num-experts",
        "2",
        "--expert-pattern",
        "ffn.[0:8]",
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
        "--stats-report-interval",
        "0.2",
        "--update_period",
        "0.5",
    )
    try:
        uids, maddrs = read_banner(proc)
        assert len(uids) == 2 and all(re.fullmatch(r"ffn\.[0-7]", uid) for uid in uids)
        assert re.fullmatch(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/12D3KooW\w+", maddrs[0])

        async def use_expert():
            client = await Peer.create()
            try:
                x = torch.randn(3, 8)
                request = {"uid": uids[0], "inputs": tensors_to_message([x])}
                reply = await client.call(maddrs[0], protocol.FORWARD, request, timeout=TIMEOUT)
                (out,) = tensors_from_message(reply["outputs"])
                assert out.shape == (3, 8) and torch.isfinite(out).all()
            finally:
                await client.shutdown()

        arun(use_expert)
        time.sleep(0.5)  # a status line or two
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Shutting down" in out
    assert re.search(r"2 experts: \d+ forward batches", err), err


@pytest.mark.slow
def test_a_malformed_pattern_makes_the_process_exit_with_code_2():
    proc = run_cli(
        "--num-experts",
        "2",
        "--expert-pattern",
        "ffn.[0:4",
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "swarmgrad server: error: expert pattern 'ffn.[0:4': dimension 0 is '[0:4'" in err


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--num-experts", "2", "--expert_pattern", "ffn..[0:4]"], "dimension 0 is ''"),
        (["--expert-uids", "e.0", "--expert-cls", "nonexistent"], "unknown expert class"),
        # --num-experts alone is valid, as in hivemind (expert.0, expert.1, ...)
        (["--expert-cls", "nop"], "give --expert-uids, or --num-experts"),
        (["--expert-uids", "e.0", "--custom-module-path", "/nonexistent.py"], "does not exist"),
    ],
)
def test_bad_options_return_code_2_before_starting_anything(capsys, argv, complaint):
    from swarmgrad.cli.main import main

    assert main(["server", *argv]) == 2
    assert re.search(r"swarmgrad server: error: .*" + complaint, capsys.readouterr().err)

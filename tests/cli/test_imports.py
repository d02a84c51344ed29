"""The command line imports torch only for the commands that need it."""

from __future__ import annotations

from tests.helpers.processes import last_line_of_python


def test_the_cli_and_its_bootstrap_peer_command_do_not_import_torch():
    """``swarmgrad dht`` (the bootstrap peer) and ``--help`` stay light: torch costs a
    process 1.7 s of CPU and 130 MB, and every command's parser is built at start."""
    script = (
        "import sys\n"
        "from swarmgrad.cli import main\n"
        "try:\n"
        "    main.main(['dht', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch' in sys.modules)\n"
    )
    assert last_line_of_python(script) == "False", "the CLI imported torch"

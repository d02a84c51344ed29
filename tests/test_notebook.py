"""swarmgrad from a real Jupyter notebook: nbclient runs a notebook in an ipykernel (whose
cells execute inside the kernel's own event loop) that starts two peers, trains them
together past global epoch 2, checks they agree and shuts them down, leaving no thread
behind; once the kernel is shut down, no process of it is left either."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

KERNEL = "swarmgrad-tests"
REPOSITORY = Path(__file__).resolve().parent.parent

SETUP = """\
import os, threading, time
import torch
import swarmgrad

threads_before = {t.ident for t in threading.enumerate()}

def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

first = swarmgrad.DHT(start=True)
second = swarmgrad.DHT(initial_peers=[str(a) for a in first.get_visible_maddrs()], start=True)
models = [make_model(), make_model()]
opts = [
    swarmgrad.Optimizer(
        dht=dht, run_id="notebook_run", target_batch_size=32, batch_size_per_step=4,
        params=model.parameters(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        matchmaking_time=1.0, averaging_timeout=15.0,
    )
    for dht, model in zip((first, second), models)
]
deadline = time.monotonic() + 30
while not all(opt.tracker.refresh(timeout=5).num_peers == 2 for opt in opts):
    assert time.monotonic() < deadline, "the peers did not see each other within 30 s"
    time.sleep(0.1)
print("kernel pid", os.getpid())
"""

TRAIN = """\
def train(opt, model, seed, errors):
    generator = torch.Generator().manual_seed(seed)
    deadline = time.monotonic() + 90
    try:
        while opt.local_epoch <= 2:  # until past global epoch 2
            assert time.monotonic() < deadline, f"still at epoch {opt.local_epoch} after 90 s"
            x = torch.randn(4, 4, generator=generator)
            torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.02)
    except BaseException as e:
        errors.append(e)

errors = []
trainers = [
    threading.Thread(target=train, args=(opt, model, seed, errors), daemon=True)
    for seed, (opt, model) in enumerate(zip(opts, models))
]
for trainer in trainers:
    trainer.start()
for trainer in trainers:
    trainer.join(120)
assert not any(t.is_alive() for t in trainers), "training did not finish"
assert not errors, errors
print("epochs", [opt.local_epoch for opt in opts])
"""

CHECK = """\
assert all(opt.local_epoch >= 3 for opt in opts)
assert opts[0].tracker.global_progress.num_peers == 2
for a, b in zip(models[0].parameters(), models[1].parameters()):
    assert float((a - b).detach().abs().max()) < 1e-6
initial = make_model().parameters()
assert any(float((a - b).detach().abs().max()) > 0 for a, b in zip(models[0].parameters(), initial))
"""

SHUTDOWN = """\
for opt in opts:
    opt.shutdown()
second.shutdown()
first.shutdown()

def leftover_threads():
    # what stays is swarmgrad's runtime, shared by the whole process and reused by the
    # next peers: its event loop thread and that loop's default executor (uvloop's or
    # asyncio's thread pool)
    return [
        t for t in threading.enumerate()
        if t.ident not in threads_before and t.is_alive() and t.name != "swarmgrad-loop"
        and not t.name.startswith(("uvloop_", "asyncio_"))
    ]

deadline = time.monotonic() + 10
while leftover_threads():
    assert time.monotonic() < deadline, f"threads left running: {leftover_threads()}"
    time.sleep(0.05)
print("shut down cleanly")
"""


@pytest.fixture
def kernel_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernel spec of this very interpreter, with this checkout on its path: a
    ``python3`` spec installed on the machine may run another Python. Jupyter's and
    IPython's files go to the test's directory, not the user's."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    python_path = os.pathsep.join(p for p in (str(REPOSITORY), os.environ.get("PYTHONPATH")) if p)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "swarmgrad tests",
                "language": "python",
                "env": {"PYTHONPATH": python_path},
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    return KERNEL


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_two_peers_train_together_from_a_notebook_and_leave_nothing_behind(kernel_name, tmp_path):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(s) for s in (SETUP, TRAIN, CHECK, SHUTDOWN)]
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    threads_before = {t.ident for t in threading.enumerate()}

    client = NotebookClient(
        notebook,
        timeout=150,  # per cell; training is bounded by 90 s inside the kernel
        startup_timeout=60,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()

    def text(cell) -> str:
        return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")

    outputs = [text(cell) for cell in notebook.cells]
    kernel_pid = int(outputs[0].split("kernel pid")[1].split()[0])
    assert kernel_pid != os.getpid()
    epochs = json.loads(outputs[1].split("epochs")[1].strip())
    assert len(epochs) == 2 and min(epochs) >= 3
    assert "shut down cleanly" in outputs[3]

    # the kernel process is gone, with nothing it started; nbclient left no thread here
    def kernel_gone() -> bool:
        try:
            return psutil.Process(kernel_pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(kernel_gone, 20, "the kernel process to exit")
    wait_until(
        lambda: {p.pid for p in me.children(recursive=True)} <= children_before,
        20,
        "the kernel's processes to exit",
    )
    wait_until(
        lambda: {t.ident for t in threading.enumerate() if t.is_alive()} <= threads_before,
        20,
        "nbclient's threads to stop",
    )

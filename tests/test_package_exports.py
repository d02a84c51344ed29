"""The top-level package: ``import swarmgrad`` stays cheap, and a star import brings in
every public name, the lazily imported ones included."""

from __future__ import annotations

import json

import swarmgrad
from tests.helpers.processes import last_line_of_python


def test_star_import_brings_in_the_lazily_imported_names_too():
    probe = (
        "import json, sys\n"
        "from swarmgrad import *\n"
        "names = ['Optimizer', 'GradScaler', 'ProgressTracker', 'GradientAverager',\n"
        "         'TrainingStateAverager', 'DHT', 'DecentralizedAverager', 'SwarmgradError']\n"
        "got = {n: getattr(globals().get(n), '__module__', None) for n in names}\n"
        "print(json.dumps(got))\n"
    )
    modules = json.loads(last_line_of_python(probe))
    assert modules == {
        "Optimizer": "swarmgrad.optim.optimizer",
        "GradScaler": "swarmgrad.optim.grad_scaler",
        "ProgressTracker": "swarmgrad.optim.progress_tracker",
        "GradientAverager": "swarmgrad.optim.grad_averager",
        "TrainingStateAverager": "swarmgrad.optim.state_averager",
        "DHT": "swarmgrad.dht.dht",
        "DecentralizedAverager": "swarmgrad.averaging.averager",
        "SwarmgradError": "swarmgrad.utils.errors",
    }


def test_every_name_in_all_resolves_and_is_listed_once():
    assert len(swarmgrad.__all__) == len(set(swarmgrad.__all__))
    assert set(swarmgrad._LAZY) <= set(swarmgrad.__all__)
    for name in swarmgrad.__all__:
        assert getattr(swarmgrad, name) is not None, name

"""The documentation site builds with ``mkdocs build --strict``: every page in the nav
exists, every link between pages resolves, every ``::: name`` in docs/api/ names a real
object, the API pages carry the docstrings and signatures of the key classes, and every
public name of ``swarmgrad`` has its entry there."""

import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import swarmgrad

pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e .[docs])")
pytest.importorskip(
    "mkdocstrings_handlers.python",
    reason="mkdocstrings[python] is not installed (pip install -e .[docs])",
)
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent

# the guides every user-facing component needs, and the API pages (docs/api/)
GUIDES = [
    "index.md",
    "network.md",
    "dht.md",
    "moe.md",
    "training.md",
    "slow-links.md",
    "averaging.md",
    "moshpit.md",
    "compression.md",
    "security.md",
    "integrations.md",
    "monitor.md",
    "benchmarks.md",
    "design-notes.md",
]
API_PAGES = [
    "net",
    "dht",
    "moe",
    "averaging",
    "optim",
    "compression",
    "monitor",
    "admission",
    "integrations",
    "errors",
]

# names that are another public class under hivemind's name (said in a line of the page)
HIVEMIND_ALIASES = {"RSASignatureValidator", "P2PContext"}


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,  # about 3 s on an idle 2-core machine, 12 s under a load of 11
    )


def _nav_files(nav) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*(_nav_files(value) for value in nav.values()))
    return set().union(set(), *(_nav_files(item) for item in nav))


def _config_over_copy(tmp_path: Path) -> tuple[Path, Path]:
    """mkdocs.yml pointed at a copy of docs/ (same plugins and hooks) that a test may break."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    text = (ROOT / "mkdocs.yml").read_text()
    config = yaml.safe_load(text)
    config["docs_dir"] = str(docs)
    config["hooks"] = [str(ROOT / hook) for hook in config.get("hooks", [])]
    plugin = next(p for p in config["plugins"] if isinstance(p, dict) and "mkdocstrings" in p)
    python = plugin["mkdocstrings"]["handlers"]["python"]
    python["paths"] = [str(ROOT)]
    options = python["options"]
    options["extensions"] = [str(ROOT / ext) for ext in options.get("extensions", [])]
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config))
    return path, docs


def _text(html_file: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", html_file.read_text()))


def test_nav_lists_every_guide_and_api_page():
    nav = _nav_files(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    expected = set(GUIDES) | {f"api/{page}.md" for page in API_PAGES} | {"api/index.md"}
    assert expected <= nav, f"missing from mkdocs.yml's nav: {sorted(expected - nav)}"


def test_site_builds_strict_with_docstrings_rendered(tmp_path):
    site = tmp_path / "site"
    result = _build(ROOT / "mkdocs.yml", site)
    assert result.returncode == 0, (
        f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    )
    for page in GUIDES:
        assert (site / page.removesuffix(".md").replace("index", "") / "index.html").exists(), page

    optim = _text(site / "api" / "optim" / "index.html")
    # Optimizer: its signature's parameters and its docstring
    for name in ("target_batch_size", "batch_size_per_step", "matchmaking_time", "run_id"):
        assert name in optim, f"Optimizer's parameter {name} missing from api/optim"
    assert "trains one model with the whole swarm" in optim
    assert "DiLoCoOptimizer" in optim and "GradScaler" in optim

    dht = _text(site / "api" / "dht" / "index.html")
    assert "initial_peers" in dht and "get_visible_maddrs" in dht
    moe = _text(site / "api" / "moe" / "index.html")
    assert "RemoteMixtureOfExperts" in moe and "k_best" in moe and "grid_size" in moe
    averaging = _text(site / "api" / "averaging" / "index.html")
    assert "DecentralizedAverager" in averaging and "target_group_size" in averaging

    # every public name of the package has its entry (or, for hivemind's aliases, a line)
    documented = set()
    for page in API_PAGES:
        html_text = (site / "api" / page / "index.html").read_text()
        documented |= {
            i.rsplit(".", 1)[-1] for i in re.findall(r'id="(swarmgrad\.[^"]+)"', html_text)
        }
    public = (set(swarmgrad._LAZY) | set(swarmgrad.__all__)) - {"__version__"}
    missing = public - documented - HIVEMIND_ALIASES
    assert not missing, f"public names without an entry in docs/api/: {sorted(missing)}"

    # the reST roles of the docstrings were turned into code spans, not shown verbatim
    for page in API_PAGES:
        text = _text(site / "api" / page / "index.html")
        assert ":class:`" not in text and ":meth:" not in text, page


def test_strict_build_fails_on_a_broken_reference_and_a_missing_page(tmp_path):
    config, docs = _config_over_copy(tmp_path)
    with open(docs / "api" / "dht.md", "a") as page:
        page.write("\n::: swarmgrad.dht.NoSuchThing\n")
    (docs / "moe.md").unlink()
    result = _build(config, tmp_path / "site")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "NoSuchThing" in output  # the API entry that does not resolve
    assert "'moe.md' is included in the 'nav'" in output  # the nav entry without its page

"""The documentation of the layout matches the tree, and the import contract covers it.

* docs/architecture.md's tables name every module of the packages (a row
  naming ``dir/`` and ```file.py``` counts for ``dir/file.py``), and every
  path README.md or a page of docs/ names exists (README points to that page
  for the modules rather than keeping a second table to drift);
* every top-level module of the daemon is in the layers contract of
  ``pyproject.toml`` and in the contract that keeps the SDK and the workers
  off the daemon (a new module there is unconstrained until it is).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("blockd", "client", "worker")
#: stdlib-only or protocol modules of the blockd package that are not the daemon
#: (blockd.logs, blockd.build_info: log set-up and the build's metrics, the workers' too)
NOT_DAEMON = {"blockd.config_env", "blockd.ha", "blockd.auth", "blockd.logs", "blockd.build_info", "blockd.threads"}
PATH = re.compile(r"`((?:blockd|client|worker|bench|tests|docs|deploy|scripts|proto)/[\w/.-]*)`")


def modules() -> list[str]:
    root = Path(ROOT)
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if path.name == "__init__.py" or rel.startswith("blockd/v1/"):
                continue
            found.append(rel)
    return found


def rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def named(module: str, table: list[str]) -> bool:
    directory, name = module.rsplit("/", 1)
    return any(f"`{module}`" in row or (f"`{directory}/`" in row and f"`{name}`" in row) for row in table)


def test_architecture_names_every_module() -> None:
    for doc in ("docs/architecture.md",):
        table = rows((Path(ROOT) / doc).read_text())
        missing = [m for m in modules() if not named(m, table)]
        assert not missing, f"{doc} does not describe {missing}"


def test_every_path_the_docs_name_exists() -> None:
    root = Path(ROOT)
    for doc in ("README.md", *(p.relative_to(root).as_posix() for p in (root / "docs").glob("*.md"))):
        gone = [p for p in PATH.findall((root / doc).read_text()) if not (root / p.rstrip("/")).exists()]
        assert not gone, f"{doc} names paths that do not exist: {gone}"


def test_the_import_contract_covers_every_daemon_module() -> None:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads TOML")
    config = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = {c["name"]: c for c in config["contracts"]}
    layered = {m.strip() for layer in next(c for c in contracts.values() if c["type"] == "layers")["layers"]
               for m in re.split(r"[|:]", layer)}
    forbidden = set(contracts["The SDK and the workers never import the daemon"]["forbidden_modules"])
    daemon = {f"blockd.{p.stem}" for p in (Path(ROOT) / "blockd").glob("*.py") if p.stem != "__init__"}
    daemon |= {f"blockd.{p.name}" for p in (Path(ROOT) / "blockd").iterdir()
               if p.is_dir() and (p / "__init__.py").exists() and p.name not in ("core", "rpc", "v1")}
    assert daemon - NOT_DAEMON - layered == set(), "daemon modules outside the layers contract"
    assert daemon - NOT_DAEMON - forbidden == set(), "daemon modules the SDK and workers could import"
    assert layered >= NOT_DAEMON


#: the rooms' sizes (issue 27): a module a reader takes in at once, a folder whose list fits a screen
MAX_MODULE_LINES = 450
MAX_MODULES_PER_FOLDER = 16


def shipped() -> list[Path]:
    root = Path(ROOT)
    return [p for package in PACKAGES for p in sorted((root / package).rglob("*.py")) if "_pb2" not in p.name]


def test_no_shipped_module_is_longer_than_450_lines() -> None:
    long = {p.relative_to(ROOT).as_posix(): n for p in shipped()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: split them by what they own: {long}"


def test_no_folder_of_shipped_code_holds_more_than_16_modules() -> None:
    folders: dict[str, int] = {}
    for p in shipped():
        if p.name != "__init__.py":
            folder = p.parent.relative_to(ROOT).as_posix()
            folders[folder] = folders.get(folder, 0) + 1
    crowded = {folder: n for folder, n in folders.items() if n > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"folders with more than {MAX_MODULES_PER_FOLDER} modules beside their sub-packages: {crowded}"

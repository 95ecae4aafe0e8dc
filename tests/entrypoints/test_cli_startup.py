"""What a user sees first: the command line starts without a line they cannot act on.

`scripts/setup.sh demo` installs everything but the test tools (pyproject.toml's `dev` extra), so the
command runs in a child process to which those are absent, as on that install: with torchao present
(`scripts/setup.sh test`), transformers imports it, and its failed CUDA libraries and torch's
deprecation warnings would open every command.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Run first in the child: the test tools' modules cannot be found or imported, as on a demo install
# (transformers asks importlib.util.find_spec whether an optional package is there).
ABSENT = """
import importlib.abc, importlib.util, sys
absent = set(sys.argv.pop(1).split(","))
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if name.partition(".")[0] in absent else find_spec(name, package)


class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in absent:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, Absent())
"""


def _test_tools() -> set[str]:
    """The modules of the distributions that only the `dev` extra installs."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def name(requirement: str) -> str:
        return re.match(r"[\w.-]+", requirement)[0].lower().replace("_", "-")

    others = {name(r) for extra, requirements in extras.items() if extra != "dev" for r in requirements}
    dev_only = {name(r) for r in extras["dev"]} - others
    return {
        module
        for module, distributions in importlib.metadata.packages_distributions().items()
        if module not in sys.stdlib_module_names and any(name(d) in dev_only for d in distributions)
    }


@pytest.mark.parametrize(
    "program",
    [
        "import rag_speculate.entrypoints.cli",
        "from rag_speculate.entrypoints.cli import main; main(['--help'])",
        "from rag_speculate.entrypoints.cli import main; main(['demo', '--help'])",
    ],
)
def test_the_command_line_starts_quietly(program):
    tools = _test_tools()
    assert {"pytest", "torchao"} <= tools, "the dev extra no longer holds the test tools this test hides"
    child = subprocess.run(
        [sys.executable, "-c", ABSENT + program, ",".join(sorted(tools))], capture_output=True, text=True, timeout=300
    )
    assert child.returncode == 0, child.stderr
    assert child.stderr == ""

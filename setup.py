"""Build step that pyproject.toml cannot say: the rules files (`rules/*.yaml`, their home at the
repository's root, next to the docs that explain them) go into the package as `codex_failover/rules/`,
copied at build time, so `pip install <clone>` and `pip install git+…` find them
(codex_failover/rules_file.py looks there first, then in the clone's rules/). Everything else is in
pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithRules(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install reads the clone's rules/ itself
            return
        target = Path(self.build_lib) / "codex_failover" / "rules"
        target.mkdir(parents=True, exist_ok=True)
        for source in sorted((ROOT / "rules").glob("*.yaml")):
            self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": BuildPyWithRules})

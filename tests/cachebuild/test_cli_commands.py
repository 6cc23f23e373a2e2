"""The command group: ``train`` comes from the ``cachebuild.commands`` entry point, so ``cachebuild`` never
imports ``loaders``; a registered command that cannot be imported says so instead of disappearing."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from click.testing import CliRunner

import cachebuild.cli as cli
from tests.reliability.helpers import cli_env

PACKAGE = Path(cli.__file__).resolve().parent


def test_cachebuild_never_imports_loaders() -> None:
    """Statically (every module of the package) and at run time (the CLI and the build path)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.split(".")[0] == "loaders"]
    assert offenders == []
    code = ("import sys, cachebuild.cli, cachebuild.builder.pipeline, cachebuild.format; "
            "from click.testing import CliRunner; CliRunner().invoke(cachebuild.cli.main, ['--help']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'loaders'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=True)
    # --help lists train (and show, report, once installed): their entry points are loaded (loaders.train.cli,
    # loaders.inspect_cli, and the train config the options come from; none imports torch), nothing more.
    modules = {ep.value.split(":")[0] for ep in cli._command_entry_points().values()}
    modules.add("loaders.train.config")
    expected = sorted({".".join(m.split(".")[:k]) for m in modules for k in range(1, m.count(".") + 2)})
    assert "loaders.train.cli" in expected
    assert out.stdout.strip() == str(expected), out.stdout


def test_train_is_a_registered_command() -> None:
    assert cli._command_entry_points()["train"].value == "loaders.train.cli:train"
    res = CliRunner().invoke(cli.main, ["--help"])
    assert res.exit_code == 0 and "  train " in res.output
    res = CliRunner().invoke(cli.main, ["train", "--help"])
    assert res.exit_code == 0 and "--accum" in res.output


def test_a_command_that_cannot_be_imported_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = EntryPoint(name="train", value="no_such_package.cli:train", group=cli.COMMAND_GROUP)
    monkeypatch.setattr(cli, "_command_entry_points", lambda: {"train": broken})
    res = CliRunner().invoke(cli.main, ["--help"])
    assert res.exit_code == 0 and "train" in res.output and "unavailable" in res.output, res.output
    res = CliRunner().invoke(cli.main, ["train", "/some/cache", "--epochs", "3"])
    assert res.exit_code == 1
    assert res.output.strip() == ("Error: `cachebuild train` is registered (no_such_package.cli:train) but cannot "
                                  "be loaded: ModuleNotFoundError: No module named 'no_such_package'; reinstall "
                                  "the package that provides it")


def test_build_commands_are_generated_from_the_sources_registry_on_demand() -> None:
    """Every registered kind is a command; one that is not asked for is never imported (`cachebuild info`)."""
    from cachebuild.sources.registry import source_names

    listed = CliRunner().invoke(cli.main, ["--help"]).output
    assert all(f"  {name} " in listed for name in source_names())
    code = ("import sys, cachebuild.cli; from click.testing import CliRunner; "
            "r = CliRunner().invoke(cachebuild.cli.main, ['info', '--help']); assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in sys.modules "
            "if m.startswith(('cachebuild.sources.', 'cachebuild.builder.pipeline'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), check=True)
    assert out.stdout.strip() == "['cachebuild.sources.kind', 'cachebuild.sources.plan', 'cachebuild.sources.registry']"


def test_the_sharing_commands_named_for_lazy_loading_are_the_ones_share_defines() -> None:
    """``cli.SHARE_COMMANDS`` lists the sharing commands without importing them (a build's start-up); it must
    name exactly what ``cachebuild.share.cli.commands()`` gives, or a command would vanish from ``--help``."""
    from cachebuild.share.cli import commands

    assert sorted(cli.SHARE_COMMANDS) == sorted(commands())
    runner = CliRunner()
    listed = runner.invoke(cli.main, ["--help"]).output
    for name in cli.SHARE_COMMANDS:
        assert f"\n  {name} " in listed, name
        assert runner.invoke(cli.main, [name, "--help"]).exit_code == 0, name

"""Commands made from options dataclasses (cachebuild.options: option, field_options, command): a field declared
with option is a flag, typed and checked as the dataclass checks itself; a bad value is a usage error naming the
flag, before anything runs. Every command is made so."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from cachebuild.errors import OptionError
from cachebuild.options import REQUIRED, OptionsCommand, check_fields, command, field_options, option, wait_option


def _even(value: int) -> None:
    if value % 2:
        raise ValueError(f"must be even; got {value}")


@dataclass(frozen=True)
class Run:
    cache: str = option(REQUIRED, None, argument=True, metavar="CACHE", path="dir")
    epochs: int = option(1, "Passes over the cache.", min=1)
    lr: float = option(0.1, "Peak learning rate.", min=0, min_open=True)
    amp: str = option("auto", "autocast dtype.", choices=("auto", "bf16", "off"))
    size: int = option(8, "An even size.", check=_even)
    compile: bool = option(False, "torch.compile the model.")
    progress: bool | None = option(None, "Progress bar.")
    log: Path | None = option(None, "Log file.", path="file")
    seen: int = 0  # not declared: no flag, not checked

    def __post_init__(self) -> None:
        check_fields(self)


def _command(options: type) -> tuple[click.Command, list[Any]]:
    got: list[Any] = []
    return click.Command("run", params=field_options(options), callback=lambda **kw: got.append(options(**kw))), got


def test_each_declared_field_is_a_flag_typed_as_declared(tmp_path: Path) -> None:
    cmd, got = _command(Run)
    assert [p.name for p in cmd.params] == ["cache", "epochs", "lr", "amp", "size", "compile", "progress", "log"]
    res = CliRunner().invoke(cmd, ["c", "--epochs", "3", "--lr", "0.5", "--amp", "bf16", "--size", "16", "--compile",
                                   "--no-progress", "--log", str(tmp_path / "l.txt")])
    assert res.exit_code == 0, res.output
    assert got == [Run(cache="c", epochs=3, lr=0.5, amp="bf16", size=16, compile=True, progress=False,
                       log=tmp_path / "l.txt")]
    assert isinstance(got[0].log, Path)
    res = CliRunner().invoke(cmd, ["c"])
    assert res.exit_code == 0 and got[-1] == Run(cache="c")  # the defaults are the fields'
    text = CliRunner().invoke(cmd, ["--help"]).output
    for line in ("--epochs INTEGER RANGE", "Passes over the cache.", "--amp [auto|bf16|off]",
                 "--progress / --no-progress", "--compile"):
        assert line in text, text


def test_a_field_added_to_the_dataclass_is_a_new_flag() -> None:
    @dataclass(frozen=True)
    class More(Run):
        warmup: float = option(0.0, "Warm-up epochs.", min=0)

    cmd, got = _command(More)
    assert [p.name for p in cmd.params][-1] == "warmup"
    assert "Warm-up epochs." in CliRunner().invoke(cmd, ["--help"]).output
    res = CliRunner().invoke(cmd, ["c", "--warmup", "2.5"])
    assert res.exit_code == 0 and got == [More(cache="c", warmup=2.5)]
    res = CliRunner().invoke(cmd, ["c", "--warmup", "-1"])
    assert res.exit_code == 2 and "Invalid value for '--warmup'" in res.output


@pytest.mark.parametrize(("args", "needle"), [
    (["--epochs", "0"], "Invalid value for '--epochs': 0 is not in the range x>=1"),
    (["--lr", "0"], "Invalid value for '--lr'"),
    (["--lr", "nan"], "Invalid value for '--lr': lr must be a finite number"),  # click's range lets NaN by
    (["--amp", "fp8"], "Invalid value for '--amp'"),
    (["--size", "7"], "Invalid value for '--size': must be even; got 7"),  # the field's own check
    (["--compile", "--no-compile"], "No such option '--no-compile'"),  # an off spelling only where not False
])
def test_a_bad_value_is_refused_naming_the_flag(args: list[str], needle: str) -> None:
    cmd, got = _command(Run)
    res = CliRunner().invoke(cmd, ["c", *args])
    assert res.exit_code == 2 and needle in res.output, res.output
    assert got == []  # refused before the command ran


def test_the_dataclass_checks_the_same_declarations() -> None:
    with pytest.raises(OptionError, match=r"^epochs must be >= 1; got 0"):
        Run(cache="c", epochs=0)
    with pytest.raises(OptionError, match=r"^size: must be even; got 7"):
        Run(cache="c", size=7)
    with pytest.raises(OptionError, match=r"^amp must be one of 'auto', 'bf16', 'off'"):
        Run(cache="c", amp="fp16")
    with pytest.raises(OptionError, match=r"^progress must be True or False"):
        Run(cache="c", progress="yes")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match=r"^cache must be a path"):
        Run(cache="")
    assert Run(cache="c", seen=-5).seen == -5  # undeclared: not checked


def test_train_is_made_from_train_config() -> None:
    """Every TrainConfig field is a train flag with the field's default; one added to it is one more."""
    from loaders.train.cli import train
    from loaders.train.config import TrainConfig

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert [p.name for p in train.params] == list(fields)
    assert all(p.default == fields[p.name].default for p in train.params if p.name != "train")

    @dataclass(frozen=True)
    class Extra(TrainConfig):
        ema_decay: float = option(0.0, "EMA of the weights (0: off).", min=0, max=1, max_open=True)

    assert [p.opts for p in field_options(Extra)][-1] == ["--ema-decay"]
    with pytest.raises(OptionError, match=r"^ema_decay must be >= 0 and < 1; got 1"):
        Extra(train="c", ema_decay=1)


@pytest.mark.parametrize(("args", "flag"), [
    (["--lr", "nan"], "--lr"),
    (["--device", "tpu"], "--device"),
    (["--model", "no_such_net"], "--model"),
    (["--progressive", "16-32"], "--progressive"),
    (["--momentum", "1.5"], "--momentum"),
    (["--in-memory", "maybe"], "--in-memory"),
])
def test_train_refuses_a_bad_value_naming_the_flag(tmp_path: Path, args: list[str], flag: str) -> None:
    from loaders.train.cli import train

    res = CliRunner().invoke(train, [str(tmp_path / "c"), "--out", str(tmp_path / "r"), *args])
    assert res.exit_code == 2 and f"Invalid value for '{flag}'" in res.output, res.output
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("command", "args", "flag"), [
    ("show", ["--out", "x.png", "--n", "0"], "--n"),
    ("show", ["--out", "x.png", "--augment", "autoaugment"], "--augment"),
    ("show", ["--out", "x.png", "--crop", "4"], "--crop"),
    ("report", ["--out", "r", "--per-class", "0"], "--per-class"),
    ("report", ["--out", "r", "--run", "no/such/run"], "--run"),
])
def test_show_and_report_refuse_a_bad_value_naming_the_flag(tmp_path: Path, command: str, args: list[str],
                                                            flag: str) -> None:
    from loaders import inspect_cli

    res = CliRunner().invoke(getattr(inspect_cli, command), [str(tmp_path / "cache"), *args])
    assert res.exit_code == 2 and f"Invalid value for '{flag}'" in res.output, res.output


def test_report_flags_are_report_options_fields() -> None:
    from cachebuild.inspect import ReportOptions
    from loaders.inspect_cli import ReportTarget, report

    declared = [f.name for f in dataclasses.fields(ReportTarget)] + \
        [f.name for f in dataclasses.fields(ReportOptions) if f.metadata]
    assert [p.name for p in report.params] == declared
    with pytest.raises(OptionError, match=r"^per_class must be >= 1"):
        ReportOptions(per_class=0)


@dataclass(frozen=True)
class Build:
    storage: str = option("npy", "Storage kind.", flag="--format", choices=("npy", "zarr", "jpeg"))
    jobs: int = option(1, "Workers.", short="-j", min=1)
    lock_wait: float | None = wait_option()
    codec: str | None = option(None, None, hidden=True, check=lambda v: _gone(f"--codec {v} is --format {v}"))

    def __post_init__(self) -> None:
        check_fields(self)


def _gone(why: str) -> None:
    raise ValueError(f"no longer a flag: {why}")


def test_a_flag_may_name_another_field_a_short_alias_and_a_bare_value() -> None:
    got: list[Build] = []
    cmd = command("build", Build, got.append)
    res = CliRunner().invoke(cmd, ["--format", "zarr", "-j", "2", "--wait"])
    assert res.exit_code == 0, res.output
    assert got == [Build(storage="zarr", jobs=2, lock_wait=float("inf"))]  # --wait alone: forever
    res = CliRunner().invoke(cmd, ["--wait", "2.5"])
    assert res.exit_code == 0 and got[-1] == Build(lock_wait=2.5)
    res = CliRunner().invoke(cmd, ["--wait", "soon"])
    assert res.exit_code == 2 and "Invalid value for '--wait'" in res.output
    text = CliRunner().invoke(cmd, ["--help"]).output
    assert "--format [npy|zarr|jpeg]" in text and "-j, --jobs" in text and "--wait [SECONDS]" in text
    assert "--codec" not in text  # an old spelling: hidden, and an error naming the new one
    res = CliRunner().invoke(cmd, ["--codec", "jpeg"])
    assert res.exit_code == 2 and "Invalid value for '--codec': no longer a flag: --codec jpeg is --format jpeg" \
        in res.output, res.output
    with pytest.raises(OptionError, match=r"^codec: no longer a flag"):
        Build(codec="jpeg")


def test_a_check_across_fields_is_a_usage_error() -> None:
    @dataclass(frozen=True)
    class Span:
        lo: int = option(0, None)
        hi: int = option(1, None)

        def __post_init__(self) -> None:
            check_fields(self)
            if self.hi <= self.lo:
                raise OptionError(f"--hi must be above --lo ({self.lo}); got {self.hi}")

    res = CliRunner().invoke(command("span", Span, lambda o: None), ["--lo", "3", "--hi", "2"])
    assert res.exit_code == 2 and "Error: --hi must be above --lo (3); got 2" in res.output


def _own_commands() -> dict[str, click.Command]:
    import cachebuild.cli as cli
    from cachebuild.share.cli import commands

    made = {name: cli.main.commands[name] for name in ("info", "verify", "sample")}
    made.update(commands())
    made.pop("resolve")  # made from the build commands' declarations (tests/cachebuild/share/test_store.py)
    group = made.pop("columns")
    assert isinstance(group, click.Group)
    made.update({f"columns {n}": c for n, c in group.commands.items()})
    return made


def test_every_command_is_made_from_its_options_dataclass() -> None:
    """Each command's parameters are exactly its options' declared fields, so each flag is declared once."""
    made = _own_commands()
    assert sorted(made) == ["columns add", "columns ls", "columns rm", "gc", "info", "ls", "pull", "push", "sample",
                            "serve", "status", "verify"]
    for name, cmd in made.items():
        assert isinstance(cmd, OptionsCommand) and dataclasses.is_dataclass(cmd.options), name
        options = cmd.options
        assert [p.name for p in cmd.params] == [f.name for f in dataclasses.fields(options) if f.metadata], name


@pytest.mark.parametrize(("args", "flag"), [
    (["ls", "x", "--depth", "17"], "--depth"),
    (["pull", "a", "b", "--jobs", "0"], "--jobs"),
    (["push", "a", "b", "--wait", "soon"], "--wait"),
    (["sample", "x", "--classes", "11"], "--classes"),
    (["columns", "add", "c", "n", "."], "FILE"),  # a folder
])
def test_the_sharing_and_sample_commands_refuse_a_bad_value_naming_the_flag(args: list[str], flag: str) -> None:
    from cachebuild.cli import main

    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and f"Invalid value for '{flag}'" in res.output, res.output

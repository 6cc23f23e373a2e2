"""``cachebuild train`` / ``python -m loaders.train`` / ``torchrun -m loaders.train``: parse, check, call ``fit``.

The command is made from ``TrainConfig``'s fields (:func:`cachebuild.options.field_options`): a flag's name,
help, default, choices and bounds are declared once, on the field, and a new field is a new flag.
"""

from __future__ import annotations

import os
from typing import Any

import click
from click.core import ParameterSource

from cachebuild.errors import CacheBuildError, OptionError
from cachebuild.options import field_options
from loaders.train.config import TrainConfig

__all__ = ["main", "train"]

def _train(**kw: Any) -> None:
    """Train a classifier on a cachebuild CACHE: cache -> loader -> device transforms -> model.

    Run under `torchrun --nproc_per_node N -m loaders.train ...` for DDP (one process per GPU; gloo on CPU).
    An OUT that already holds a run is refused unless --resume (continue it) or --overwrite (start over).
    `train --resume --out RUN` continues the run in RUN with its own cache and options.
    """
    from loaders.train.distributed import resolve_device
    from loaders.train.loop.amp import resolve_amp
    from loaders.train.run.fit import fit

    try:
        dev = resolve_device(kw["device"], int(os.environ.get("LOCAL_RANK", "0")))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--device") from None
    try:
        resolve_amp(kw["amp"], dev)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--amp") from None
    try:
        cfg = TrainConfig(**kw)  # each value was checked as its flag was read; this checks them together
    except OptionError as e:
        raise click.UsageError(str(e)) from None
    ctx = click.get_current_context()
    given = {name for name in kw if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE,
                                                                         ParameterSource.ENVIRONMENT)}
    try:
        fit(cfg, given=given)  # with --resume, what is not given is the run's
    except CacheBuildError as e:
        raise click.ClickException(str(e).splitlines()[0] if str(e) else type(e).__name__) from None


#: ``cachebuild train CACHE [options]``: one parameter per ``TrainConfig`` field, named as the field.
train = click.Command("train", params=field_options(TrainConfig), callback=_train, help=_train.__doc__,
                      context_settings={"show_default": True, "max_content_width": 110})


def main() -> None:
    """Entry point of ``python -m loaders.train`` (and ``torchrun -m loaders.train``)."""
    train(prog_name="python -m loaders.train")

"""Seeing a cache: contact sheets (``cachebuild show``), pixel statistics and a static HTML report
(``cachebuild report``). Reads through :mod:`cachebuild.format` only; what needs the loaders (the device
transforms of ``--augment``, a run's curves) is handed in by the commands in ``loaders.inspect_cli``."""

from cachebuild.inspect.report import ReportOptions, write_report
from cachebuild.inspect.select import parse_class_spec, parse_index_spec, pick_per_class, pick_random
from cachebuild.inspect.sheet import Sheet, Tile, compose_sheet
from cachebuild.inspect.show import Augment, Selection, select, show
from cachebuild.inspect.stats import PixelStats, pixel_stats

__all__ = [
    "Augment",
    "PixelStats",
    "ReportOptions",
    "Selection",
    "Sheet",
    "Tile",
    "compose_sheet",
    "parse_class_spec",
    "parse_index_spec",
    "pick_per_class",
    "pick_random",
    "pixel_stats",
    "select",
    "show",
    "write_report",
]

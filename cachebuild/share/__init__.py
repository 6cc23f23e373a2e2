"""Sharing caches across a team: pull and push with per-file checks (``pull``, ``push``, ``transfer``),
staleness against the source without decoding (``status``), listing (``listing``)."""

from cachebuild.share.listing import list_caches
from cachebuild.share.pull import PullResult, pull
from cachebuild.share.push import PushResult, push

__all__ = ["PullResult", "PushResult", "list_caches", "pull", "push"]

"""cachebuild against each peer, from one results dict: one row per (table, peer contender), with the ratio
cachebuild / peer measured in the same run (builds: within each round both ran, then the median).
results.md and the peers block of docs/performance.md are both written from these rows, so they say the same, and a
peer ahead of cachebuild is named with its margin."""

from __future__ import annotations

from typing import Any

__all__ = ["PEER_PREFIXES", "comparisons", "every_row_lines", "peer_lines"]

PEER_PREFIXES = ("ffcv_", "litdata_", "webdataset_", "dali_", "spdl_", "streaming_", "datago_")


def _is_peer(key: str) -> bool:
    return key.startswith(PEER_PREFIXES)


def _best_ours(rows: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """cachebuild's fastest contender of a load group (its loaders are alternatives a user picks from)."""
    ours = {k: r for k, r in rows.items() if k.startswith("cachebuild_") and "glibc_default" not in k}
    if not ours:
        return None
    key = max(ours, key=lambda k: ours[k]["img_s"]["median"])
    return key, ours[key]


def comparisons(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows: table, peer (label), peer_img_s, ours (label), ours_img_s, x (ours / peer, >1: cachebuild ahead)."""
    out: list[dict[str, Any]] = []

    def add(table: str, peer: dict[str, Any], peer_rate: float, ours: dict[str, Any], ours_rate: float,
            x: float | None = None) -> None:
        if x is None and peer_rate:
            x = ours_rate / peer_rate
        out.append({"table": table, "peer": peer["label"], "peer_img_s": peer_rate, "ours": ours["label"],
                    "ours_img_s": ours_rate, "x": None if x is None else round(x, 3)})

    build = res.get("build", {}).get("contenders", {})
    if "cachebuild_npy" in build:
        ours = build["cachebuild_npy"]
        for key, r in build.items():
            if _is_peer(key):
                # within each round both ran (a peer may run fewer rounds: the first ones), then the median
                pairs = sorted(a / b for a, b in zip(ours["img_s"]["runs"], r["img_s"]["runs"], strict=False) if b)
                x = (pairs[(len(pairs) - 1) // 2] + pairs[len(pairs) // 2]) / 2 if pairs else None
                add("build", r, r["img_s"]["median"], ours, ours["img_s"]["median"], x)
    for group, rows in res.get("load", {}).get("groups", {}).items():
        best = _best_ours(rows)
        if best is None:
            continue
        for key, r in rows.items():
            if _is_peer(key):
                add(f"load, {group}", r, r["img_s"]["median"], best[1], best[1]["img_s"]["median"])
    remote = res.get("load", {}).get("remote", {}).get("rows", {})
    for store, name in (("s3", "S3"), ("http", "HTTP")):
        ours = {k: r for k, r in remote.items() if k.startswith(f"cachebuild_npy_{store}")}
        if not ours:
            continue
        cold = max(ours.values(), key=lambda r: r["cold_img_s"])
        warm = max(ours.values(), key=lambda r: r["warm_img_s"]["median"])
        for key, b in remote.items():
            if _is_peer(key) and key.endswith(f"_{store}"):
                add(f"load from {name}, cold epoch", b, b["cold_img_s"], cold, cold["cold_img_s"])
                add(f"load from {name}, warm epochs", b, b["warm_img_s"]["median"], warm, warm["warm_img_s"]["median"])
    return out


def _tables(res: dict[str, Any]) -> list[tuple[str, dict[str, float], dict[str, float], dict[str, str]]]:
    """(table, our rows' rates, the peers' rates, labels) of every table with peers: each row's median."""
    out = []
    build = res.get("build", {}).get("contenders", {})
    if build:
        out.append(("build", {k: r["img_s"]["median"] for k, r in build.items() if k.startswith("cachebuild_")},
                    {k: r["img_s"]["median"] for k, r in build.items() if _is_peer(k)},
                    {k: r["label"] for k, r in build.items()}))
    for group, rows in res.get("load", {}).get("groups", {}).items():
        out.append((f"load, {group}", {k: r["img_s"]["median"] for k, r in rows.items()
                                       if k.startswith("cachebuild_") and "glibc_default" not in k},
                    {k: r["img_s"]["median"] for k, r in rows.items() if _is_peer(k)},
                    {k: r["label"] for k, r in rows.items()}))
    remote = res.get("load", {}).get("remote", {}).get("rows", {})
    for store, name in (("s3", "S3"), ("http", "HTTP")):
        for epoch, rate in (("cold epoch", lambda r: r["cold_img_s"]),
                            ("warm epochs", lambda r: r["warm_img_s"]["median"])):
            mine = {k: rate(r) for k, r in remote.items() if k.startswith(f"cachebuild_npy_{store}")}
            if mine:
                out.append((f"load from {name}, {epoch}", mine,
                            {k: rate(r) for k, r in remote.items() if _is_peer(k) and k.endswith(f"_{store}")},
                            {k: r["label"] for k, r in remote.items()}))
    return [t for t in out if t[1] and t[2]]


def every_row_lines(res: dict[str, Any]) -> list[str]:
    """Every cachebuild row of every table with peers, and each peer row ahead of it (with its margin): the
    list covers all our loaders and writers, not only the fastest of a table."""
    lines = ["Every cachebuild row against every peer row of its table (same files, batch, workers):", "",
             "| table | cachebuild row | img/s | peers ahead of it: img/s (cachebuild / peer) |", "|---|---|---:|---|"]
    for table, mine, theirs, labels in _tables(res):
        for key, rate in mine.items():
            ahead = sorted(((r, k) for k, r in theirs.items() if r > rate), reverse=True)
            cell = "; ".join(f"{labels[k]}: {r:,.0f} (**{rate / r:.2f}x**)" for r, k in ahead) or "none"
            lines.append(f"| {table} | {labels[key]} | {rate:,.0f} | {cell} |")
    return lines


def peer_lines(res: dict[str, Any]) -> list[str]:
    """The markdown table of every comparison, then one sentence per peer contender ahead of cachebuild."""
    rows = comparisons(res)
    if not rows:
        return ["No peer measured in this run: " + "; ".join(f"{k} {p['status']}" for k, p in
                                                            res.get("peers", {}).items()) + "."]
    lines = ["| table | peer contender | peer img/s | cachebuild (its fastest here) | cachebuild img/s "
             "| cachebuild / peer |", "|---|---|---:|---|---:|---:|"]
    for r in rows:
        x = "-" if r["x"] is None else f"{r['x']:.2f}x"
        lines.append(f"| {r['table']} | {r['peer']} | {r['peer_img_s']:,.0f} | {r['ours']} | {r['ours_img_s']:,.0f} "
                     f"| {'**' + x + '**' if r['x'] is not None and r['x'] < 1 else x} |")
    ahead = [r for r in rows if r["x"] is not None and r["x"] < 1]
    lines.append("")
    if ahead:
        lines.append("Where a peer is ahead of cachebuild in this run: " + "; ".join(
            f"{r['table']}: {r['peer']} by {1 / r['x']:.2f}x (medians {r['peer_img_s']:,.0f} against "
            f"{r['ours_img_s']:,.0f} img/s)" for r in ahead) + ".")
    else:
        lines.append("cachebuild is ahead of every peer contender measured in this run, in every table above.")
    lines += ["", *every_row_lines(res)]
    return lines

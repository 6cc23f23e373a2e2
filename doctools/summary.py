"""Generated blocks of the docs besides the benchmark's own (``doctools/performance.py``): the README's headline table,
its "what the two commands print" block, and the reliability table. Each takes the parsed results file and
the results folder as the page links it; nothing else goes in.
"""

from __future__ import annotations

from typing import Any

__all__ = ["commands_section", "headline_section", "machine_line", "reliability_rows", "reliability_section"]


def machine_line(m: dict[str, Any]) -> str:
    """The machine in one line: CPU and its vector flags, cores, memory, GPU, and the commit that ran."""
    flags = "/".join(f.upper().replace("_", "-") for f in m.get("cpu_flags", [])) or "flags not recorded"
    gpu = m["gpu"]["name"] if m.get("gpu") else "no GPU"
    git = m.get("git")
    commit = (f", commit `{git['commit'][:10]}`{' (uncommitted changes)' if git.get('dirty') else ''}" if git
              else ", commit not recorded")
    return (f"{m.get('cpu', '?')} ({flags}), {m.get('cores_usable', '?')} cores, {m.get('ram_gb', '?')} GiB, {gpu}, "
            f"Python {m.get('python', '?')}, torch {m.get('versions', {}).get('torch', '?')}{commit}")


STATED = ("make-demo", "make-test")  # the durations the README states


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def commands_section(data: dict[str, Any], where: str) -> str:
    """What ``make demo`` printed, and how long each measured command took, from ``commands.json``."""
    entries = data["entries"]
    lines: list[str] = []
    demo = entries.get("make-demo")
    if demo:
        m = demo["machine"]
        steps = ", ".join(f"{st['command'].split()[1]} {_secs(st['wall_s'])}" for st in demo.get("steps", []))
        lines += [f"On {machine_line(m)}, load average {m['load_average_at_start'][0]} at the start "
                  f"([`{where}/commands.json`]({where}/commands.json), {demo['date'][:10]}), `make demo` once "
                  f"installed took {_secs(demo['median_s'])}{f' ({steps})' if steps else ''} and ended with:", "",
                  "```", *[ln for ln in demo["output_tail"] if not ln.startswith("make[")][-5:], "```", ""]
    lines += ["| entry | command | wall time (median) | runs | machine | load average at the start |",
              "|---|---|---:|---|---|---:|"]
    for name, e in entries.items():
        m = e["machine"]
        cpu = f"{m.get('cpu', '?')}, {m.get('cores_usable', '?')} cores"
        runs = ", ".join(_secs(r) for r in e["runs_s"])
        lines.append(f"| `{name}` | `{e['command']}` | {_secs(e['median_s'])} | {runs} | {cpu} | "
                     f"{m['load_average_at_start'][0]} |")
    missing = [f"`{n.replace('-', ' ', 1)}`" for n in STATED if n not in entries]
    if missing:
        lines += ["", f"Not measured in this folder yet: {', '.join(missing)} (`make timings`, then "
                  "`python -m doctools.blocks`)."]
    return "\n".join(lines)


def reliability_rows(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rows of a ``make reliability`` table.json: a flat {row: {...}} or {"rows": {...}, "machine": ...}."""
    rows = data.get("rows", data)
    return {k: v for k, v in rows.items() if isinstance(v, dict) and "trials" in v}


def reliability_section(data: dict[str, Any], where: str) -> str:
    rows = reliability_rows(data)
    run = data.get("_run") or {}  # tests/reliability/conftest.py: the machine, commit, wall time and load
    m = data.get("machine") or run.get("machine")
    commit = data.get("commit") or (m or {}).get("git")
    if run.get("git_commit"):
        commit = {"commit": run["git_commit"], "dirty": bool(run.get("git_dirty"))}
    made = (f"on {machine_line({**m, 'git': commit if isinstance(commit, dict) else m.get('git')})}" if m
            else "on a machine the file does not record")
    if isinstance(commit, str):
        made += f", commit `{commit[:10]}`"
    if run.get("wall_s"):
        made += (f", in {run['wall_s'] / 60:.0f} min from {run['started'][:10]} (load average "
                 f"{run.get('loadavg_start', '?').split()[0]} at the start)")
    total = {k: sum(r[k] for r in rows.values()) for k in ("trials", "survived", "lost")}
    lines = [f"From [`{where}/table.json`]({where}/table.json), as `make reliability` wrote it, {made}: "
             f"{len(rows)} rows, {total['trials']:,} trials, {total['survived']:,} survived, {total['lost']:,} lost.",
             "", "| row | trials | survived | lost | detail |", "|---|---:|---:|---:|---|"]
    for name, r in rows.items():
        detail = "; ".join([r.get("detail", ""), *(f"lost: {n}" for n in r.get("notes", [])[:3])]).strip("; ")
        lines.append(f"| {name.replace('|', '/')} | {r['trials']:,} | {r['survived']:,} | {r['lost']:,} | "
                     f"{detail.replace('|', '/')} |")
    return "\n".join(lines)


# Short names for the README's headline table (the full labels are in docs/performance.md).
SHORT = {"bare_decode": "bare decode (the limit)", "ffcv_raw": "FFCV raw", "litdata_raw": "LitData",
         "webdataset_raw": "WebDataset", "imagefolder_pil": "ImageFolder + PIL",
         "limit_bare_gather": "bare memmap gather (the limit)"}


def _against(rows: dict[str, Any], keys: tuple[str, ...]) -> str:
    return ", ".join(f"{SHORT[k]} {rows[k]['img_s']['median']:,.0f}" for k in keys if k in rows)


def headline_section(res: dict[str, Any], where: str) -> str:
    """A handful of figures of one benchmark run for the README, each beside what it is measured against."""
    m, run = res["machine"], res["run"]
    lines = [f"From [`{where}/`]({where}/results.md) (`{run['command']}`, {run['started'][:10]}; "
             f"{machine_line(m)}; medians, img/s unless said). The full tables, the peers and how each figure "
             "was measured: [docs/performance.md](docs/performance.md).", "",
             "| what | cachebuild | against, in the same run |", "|---|---:|---|"]
    b = res.get("build", {})
    ours = b.get("contenders", {}).get("cachebuild_npy")
    if ours:
        lines.append(f"| build: {b['images']} photos -> {b['size']} px, {b['jobs']} processes | "
                     f"{ours['img_s']['median']:,.0f} | "
                     f"{_against(b['contenders'], ('bare_decode', 'ffcv_raw', 'litdata_raw', 'webdataset_raw'))} |")
    ld = res.get("load", {})
    raw = ld.get("groups", {}).get("raw", {})
    r = raw.get("cachebuild_npy_dataloader")
    if r:
        lines.append(f"| load: {r['label'].split(': ', 1)[-1]}, batch {ld['batch']}, uint8 | "
                     f"{r['img_s']['median']:,.0f} | "
                     f"{_against(raw, ('imagefolder_pil', 'ffcv_raw', 'limit_bare_gather'))} |")
    tr = res.get("train", {}).get("contenders", {})
    if "cachebuild_dataloader" in tr and "imagefolder_pil" in tr:
        lines.append(f"| share of a training step waiting for data ({res['train']['model']}, "
                     f"{res['train']['device']}) | {tr['cachebuild_dataloader']['data_wait_share']['median']:.1%} | "
                     f"ImageFolder + PIL {tr['imagefolder_pil']['data_wait_share']['median']:.1%} |")
    return "\n".join(lines)

"""The report (`bench.py report RESULTS.jsonl...`): markdown on stdout.

Ratios are taken per round (each side against the baseline measured in the same round), then the
median over rounds is compared with the goal. Per-round values are shown joined by " / ".
How each ratio is computed is printed under its table (README.md repeats it).
"""

import json
import statistics

GOAL_MET = {True: "yes", False: "**no**", None: "?"}


def med(xs: list):
    """The median of the numbers in xs (None and text left out); None if there are none."""
    xs = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return statistics.median(xs) if xs else None


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def per_round(vals: list, digits: int = 2) -> str:
    return " / ".join(fmt(v, digits) for v in vals) if vals else "n/a"


def load(paths: list) -> list:
    recs = []
    for i, path in enumerate(paths):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                r["file"] = i
                recs.append(r)
    return recs


def rounds_of(recs: list) -> list:
    return sorted({(r["file"], r["round"]) for r in recs if r.get("mode") != "note"})


def goal_row(what: str, vals: list, goal: str, test, digits: int = 2) -> str:
    m = med(vals)
    met = None if m is None else bool(test(m))
    return f"| {what} | {per_round(vals, digits)} | {fmt(m, digits)} | {goal} | {GOAL_MET[met]} |"


# --- part 1 ---------------------------------------------------------------------------------
def backend_report(recs: list) -> list:
    recs = [r for r in recs if r.get("part") == "backend"]
    if not recs:
        return []
    rounds = rounds_of(recs)
    out = ["## Part 1: slow backend", ""]
    probes = {(r["file"], r["round"]): r["mbps"] for r in recs if r["mode"] == "probe"}
    out.append(f"Backend bandwidth (raw slow device, 8 threads of O_DIRECT 4 MiB reads, 2 GB), "
               f"per round: {per_round([probes.get(k) for k in rounds], 0)} MB/s.")
    out.append("")
    out.append("| dataset | reader | side | pass | s | MB/s | files/s | hit ratio | metadata "
               "requests | stall s | passthrough MB | load start→end |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    order = {"rsync": 0, "local": 1, "local-nodrop": 2, "epoch1": 3, "later": 4, "nodrop": 5}
    side_order = {"seed": 0, "user": 1, "direct": 2, "root": 3}
    rows = {}
    for r in recs:
        if r["mode"] in order:
            key = (r["dataset"], r.get("reader", "-"), r["side"], r["mode"])
            rows.setdefault(key, []).append(r)
    datasets = list(dict.fromkeys(r["dataset"] for r in recs if "dataset" in r))
    readers = list(dict.fromkeys(r["reader"] for r in recs if r.get("reader")))
    rank = {x: i for i, x in enumerate(["-"] + readers)}
    for key in sorted(rows, key=lambda k: (datasets.index(k[0]), rank[k[1]], side_order[k[2]],
                                           order[k[3]])):
        rs = rows[key]
        st = [r.get("stats", {}) for r in rs]
        pt = [s.get("bytes_passthrough") for s in st]
        out.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} "
            f"| {per_round([r['secs'] for r in rs])} "
            f"| {per_round([r.get('mbps') for r in rs], 0)} "
            f"| {per_round([r.get('files_s') for r in rs], 0)} "
            f"| {per_round([s.get('hit_ratio') for s in st]) if st[0] else ''} "
            f"| {per_round([s.get('metadata_requests') for s in st]) if st[0] else ''} "
            f"| {per_round([s.get('stall_s') for s in st]) if st[0] else ''} "
            f"| {per_round([p / 1e6 if p is not None else None for p in pt], 0) if st[0] else ''}"
            f" | {' / '.join(r['load_start'] + '→' + r['load_end'] for r in rs)} |")
    out.append("")
    out.append("Goals (per round, then the median):")
    out.append("")
    out.append("| ratio | per round | median | goal | met |")
    out.append("|---|---|---|---|---|")

    def get(ds, reader, side, mode, k):
        return [r for r in recs if r["mode"] == mode and r["dataset"] == ds
                and r["side"] == side and (r["file"], r["round"]) == k
                and (reader is None or r.get("reader") == reader)]

    sides = [s for s in ("user", "direct", "root") if any(r.get("side") == s for r in recs)]
    names = {"user": "unprivileged mount", "direct": "unprivileged mount + direct reads",
             "root": "root mount"}
    totals = []
    for ds in datasets:
        for reader in readers:
            for side in sides:
                tag = f"{ds} {reader}, {names[side]}"
                e1, later, nodrop, job = [], [], [], []
                for k in rounds:
                    s_e1 = get(ds, reader, side, "epoch1", k)
                    s_later = get(ds, reader, side, "later", k)
                    s_nodrop = get(ds, reader, side, "nodrop", k)
                    l_local = get(ds, reader, "seed", "local", k)
                    l_nodrop = get(ds, reader, "seed", "local-nodrop", k)
                    rsync = get(ds, None, "seed", "rsync", k)
                    e1.append(s_e1[0]["mbps"] / probes[k] if s_e1 and k in probes else None)
                    ml, mloc = med([r["mbps"] for r in s_later]), med([r["mbps"] for r in l_local])
                    later.append(ml / mloc if ml and mloc else None)
                    nodrop.append(s_nodrop[0]["mbps"] / l_nodrop[0]["mbps"]
                                  if s_nodrop and l_nodrop else None)
                    if s_e1 and s_later and l_local and rsync:
                        st10 = s_e1[0]["secs"] + 9 * med([r["secs"] for r in s_later])
                        sd10 = rsync[0]["secs"] + 10 * med([r["secs"] for r in l_local])
                        job.append(st10 / sd10)
                        totals.append(f"{tag}, round {k[1]}: stagefs {st10:.1f} s "
                                      f"(mount + epoch 1 {s_e1[0]['secs']:.1f} s + 9 × "
                                      f"{med([r['secs'] for r in s_later]):.2f} s), seed "
                                      f"{sd10:.1f} s (rsync {rsync[0]['secs']:.1f} s + 10 × "
                                      f"{med([r['secs'] for r in l_local]):.2f} s)")
                    else:
                        job.append(None)
                out.append(goal_row(f"{tag}: epoch 1 / backend bandwidth", e1, "≥ 0.8",
                                    lambda m: m >= 0.8))
                out.append(goal_row(f"{tag}: later epoch / local copy", later, "≥ 0.9",
                                    lambda m: m >= 0.9))
                out.append(goal_row(f"{tag}: 10-epoch job / seed workflow", job, "≤ 0.6",
                                    lambda m: m <= 0.6))
                out.append(goal_row(f"{tag}: no-drop epoch / page-cached local copy", nodrop,
                                    "≥ 0.9", lambda m: m >= 0.9))
    out.append("")
    out.append("How: *epoch 1* MB/s = bytes / (mount command + listing + reads), against the "
               "probe of the same round. *Later epoch* = median MB/s of the stagefs epochs 2.. "
               "(caches dropped before each) / median MB/s of the local epochs over the rsync "
               "copy on the same scratch (caches dropped), same reader. *10-epoch job* = "
               "(mount + epoch 1 + 9 × median later-epoch seconds) / (rsync + 10 × median local "
               "epoch seconds), from the epochs measured in that round. *No-drop* = an epoch "
               "right after the last one without dropping caches, on both sides. Epoch seconds "
               "are the reader's listing + reads (no interpreter start-up).")
    out.append("")
    out.extend(f"- {t}" for t in totals)
    return out


# --- part 2 ---------------------------------------------------------------------------------
def scale_report(recs: list) -> list:
    recs = [r for r in recs if r.get("part") == "scale"]
    if not recs:
        return []
    rounds = rounds_of(recs)
    notes = [r for r in recs if r.get("mode") == "note"]
    n = next((r["n_files"] for r in notes if "n_files" in r), None)
    out = ["## Part 2: scale", ""]
    info = next((r for r in notes if "n_files" in r), {})
    out.append(f"N = {n} files (source {info.get('source')}; deep file {info.get('deep')}).")
    for missing in dict.fromkeys((r["missing"], r["detail"]) for r in notes if "missing" in r):
        out.append(f"**Missing in this build:** {missing[0]}: {missing[1]}.")
    out.append("")

    def one(mode, k):
        rs = [r for r in recs if r.get("mode") == mode and (r["file"], r["round"]) == k]
        return rs[0] if rs else None

    def col(mode, field, fn=lambda x: x):
        vals = []
        for k in rounds:
            r = one(mode, k)
            v = r.get(field) if r else None
            vals.append(fn(v) if v is not None else None)
        return vals

    def ratio(a, b):
        return [x / y if x is not None and y else None for x, y in zip(a, b)]

    src_cold, src_warm = col("find-source", "cold_s"), col("find-source", "warm_s")
    out.append("| measure | per round | median | goal | met |")
    out.append("|---|---|---|---|---|")
    for mode, what in (("fresh", "fresh mount (lists the source)"),
                       ("remount", "remount (snapshot from the cache)"),
                       ("index-mount", "mount --index")):
        out.append(goal_row(f"{what}: mount command + first stat of the deep file, s",
                            col(mode, "usable_s"), "< 1 s", lambda m: m < 1, 3))
    out.append(goal_row("find MNT / find SOURCE, fresh mount vs cold source",
                        ratio(col("fresh", "find_cold_s"), src_cold), "≤ 1.5",
                        lambda m: m <= 1.5))
    out.append(goal_row("find MNT / find SOURCE, warm (second find on both)",
                        ratio(col("fresh", "find_warm_s"), src_warm), "≤ 1.5",
                        lambda m: m <= 1.5))
    out.append(goal_row("find MNT / find SOURCE, remount (caches dropped) vs cold source",
                        ratio(col("remount", "find_cold_s"), src_cold), "≤ 1.5",
                        lambda m: m <= 1.5))
    out.append(goal_row("remount with a warm cache: mount command → first read done, s",
                        col("remount", "first_read_s"), "< 2 s", lambda m: m < 2, 3))
    for mode, what in (("fresh", "after mount + 2 finds"), ("read", "after the full read"),
                       ("remount", "after the remount"), ("warm", "after the warm epoch")):
        for key in ("VmRSS", "VmHWM"):
            vals = col(mode, key, lambda v: v / n if n else None)
            out.append(goal_row(f"daemon {key} per file, {what}, B", vals, "≤ 300",
                                lambda m: m <= 300, 0))
    out.append("")
    out.append("Memory per file is VmRSS or VmHWM ÷ N: it includes the daemon's fixed memory "
               "(threads, buffers: tens of MB), which dominates at small N; the goal is for "
               "N ≈ 1.28 M.")
    out.append("")
    out.append("| measure | per round | median | goal | met |")
    out.append("|---|---|---|---|---|")
    out.append(goal_row("files in the cache directory after the full read, × N/100",
                        col("read", "scratch_files", lambda v: v / (n / 100) if n else None),
                        "≤ 1", lambda m: m <= 1))
    out.append(goal_row("mount --index: metadata requests (mount, first read, find)",
                        col("index-mount", "stats", lambda s: s.get("metadata_requests")),
                        "0", lambda m: m == 0, 0))
    out.append("")
    out.append("| measure | per round | median |")
    out.append("|---|---|---|")

    def info_row(what, vals, digits=2):
        m = "—" if any(isinstance(v, str) for v in vals) else fmt(med(vals), digits)
        out.append(f"| {what} | {per_round(vals, digits)} | {m} |")

    info_row("find SOURCE cold, s", src_cold)
    info_row("find SOURCE warm, s", src_warm)
    info_row("find MNT fresh mount, s", col("fresh", "find_cold_s"))
    info_row("find MNT warm, s", col("fresh", "find_warm_s"))
    info_row("find MNT after remount, s", col("remount", "find_cold_s"))
    info_row("find MNT on the --index mount, s", col("index-mount", "find_cold_s"))
    info_row("`find | wc -l` lines: source / fresh mount / remount / --index mount", [
        "/".join(str(v) for v in vs) for vs in zip(
            col("find-source", "lines"), col("fresh", "lines"), col("remount", "lines"),
            col("index-mount", "lines"))], 0)
    info_row("mount command alone (fresh / remount / --index), s", [
        "/".join(fmt(v, 3) for v in vs) for vs in zip(
            col("fresh", "mount_s"), col("remount", "mount_s"), col("index-mount", "mount_s"))])
    info_row("`stagefs index SOURCE` s", col("index", "secs"))
    info_row("`stagefs index` / find SOURCE cold", ratio(col("index", "secs"), src_cold))
    info_row("metadata requests: fresh mount (listing), remount", [
        f"{a}/{b}" for a, b in zip(
            col("fresh", "stats", lambda s: s.get("metadata_requests")),
            col("remount", "stats", lambda s: s.get("metadata_requests")))], 0)
    info_row("snapshot origin: fresh / remount / --index mount", [
        "/".join(str(v) for v in vs) for vs in zip(
            col("fresh", "stats", lambda s: s.get("snapshot")),
            col("remount", "stats", lambda s: s.get("snapshot")),
            col("index-mount", "stats", lambda s: s.get("snapshot")))], 0)
    info_row("remount's first read: bytes from source (0 = served from the cache)",
             col("remount", "first_read_stats", lambda s: s.get("bytes_from_source")), 0)
    info_row("full read through the fresh mount (cold), files/s",
             ratio(col("read", "files"), col("read", "epoch_s")), 0)
    info_row("warm epoch after the remount, files/s",
             ratio(col("warm", "files"), col("warm", "epoch_s")), 0)
    info_row("source epoch (caches dropped), files/s",
             ratio(col("source-read", "files"), col("source-read", "epoch_s")), 0)
    info_row("warm epoch / source epoch (files/s)",
             ratio(col("source-read", "epoch_s"), col("warm", "epoch_s")))
    info_row("warm epoch hit ratio", col("warm", "stats", lambda s: s.get("hit_ratio")))
    info_row("`stagefs umount` after the full read (index flush), s", col("read", "umount_s"))
    info_row("cache used after the full read, MB",
             col("read", "cache_used", lambda v: v / 1e6), 0)
    info_row("scratch bytes allocated after the full read, MB",
             col("read", "scratch_bytes", lambda v: v / 1e6), 0)
    info_row("scratch files after the full read", col("read", "scratch_files"), 0)
    loads = []
    for k in rounds:
        rs = [r for r in recs if r.get("mode") not in ("note",) and (r["file"], r["round"]) == k]
        loads.append(" ".join(f"{r['mode']} {r['load_start']}→{r['load_end']}" for r in rs))
    out.append("")
    out.append("Load (1-min) at start→end of each pass, per round: " + "; ".join(loads) + ".")
    return out


# --- levers ---------------------------------------------------------------------------------
def levers_report(recs: list) -> list:
    recs = [r for r in recs if r.get("part") == "levers" and r.get("mode") in
            ("warm", "cold", "list")]
    if not recs:
        return []
    rounds = rounds_of(recs)
    out = ["## FUSE levers (unprivileged mount, small files)", "",
           "| part | configuration | reader | per round | median | × the default run just "
           "before it (per round) | median | load start→end |",
           "|---|---|---|---|---|---|---|---|"]

    def value(r):  # list: seconds (lower is better); warm and cold: MB/s (higher is better)
        return r["secs"] if r["mode"] == "list" else r["mbps"]

    keys = []
    for r in recs:
        key = (r["mode"], r["config"], r.get("reader", "-"))
        if key not in keys:
            keys.append(key)
    for mode, config, reader in keys:
        mine = [r for r in recs if (r["mode"], r["config"], r.get("reader", "-"))
                == (mode, config, reader)]
        is_default = config.startswith("default")
        vals, ratios, loads = [], [], []
        for k in rounds:
            rs = [r for r in mine if (r["file"], r["round"]) == k]
            vals.append(med([value(r) for r in rs]))
            loads += [f"{r['load_start']}→{r['load_end']}" for r in rs]
            if is_default:
                continue
            for r in rs:
                d = [x for x in recs if x["mode"] == mode and x.get("reader", "-") == reader
                     and x["config"].startswith("default") and x.get("pair") == config
                     and (x["file"], x["round"]) == k]
                ratios.append(value(r) / value(d[-1]) if d and value(d[-1]) else None)
        unit, digits = ("s", 3) if mode == "list" else ("MB/s", 1)
        out.append(f"| {mode} | {config} | {reader} | {per_round(vals, digits)} {unit} | "
                   f"{fmt(med(vals), digits)} | {'—' if is_default else per_round(ratios)} | "
                   f"{'1' if is_default else fmt(med(ratios))} | {' / '.join(loads)} |")
    out.append("")
    out.append("warm: remount on a full cache, caches dropped, one epoch; cold: empty cache, mount "
               "+ epoch 1; list: empty cache, --no-staging, mount + `find MNT | wc -l` (seconds, "
               "lower is better; the others MB/s, higher is better). The default runs once "
               "before every other configuration; its row gives the median of those runs.")
    return out


def header(recs: list) -> list:
    out = []
    for r in recs:
        if r.get("mode") == "note" and "uptime_start" in r:
            out.append(f"- part **{r['part']}**: commit {r.get('commit')}, {r.get('machine')}; "
                       f"load at start: `{r['uptime_start']}`")
        if r.get("mode") == "note" and "uptime_end" in r:
            out.append(f"- part **{r['part']}** ended: `{r['uptime_end']}`")
    return out + [""] if out else []


def report(paths: list) -> str:
    recs = load(paths)
    lines = ["# stagefs mount benchmark", ""]
    lines += header(recs)
    for part in (backend_report, scale_report, levers_report):
        body = part(recs)
        if body:
            lines += body + [""]
    failed = [r for r in recs if r.get("mode") == "FAILED"]
    if failed:
        lines.append("## Failed passes")
        lines += [f"- {r['part']} round {r['round']} {r['name']}: {r['error'][:500]}"
                  for r in failed]
    return "\n".join(lines) + "\n"

#!/usr/bin/env python3
"""The mount benchmark's passes and report; run.sh sets the machine up and calls this as root.

  bench.py backend --bigdata DIR --device FILE --scratch DIR --mnt DIR --stagefs BIN --out F
  bench.py scale   --source DIR --deep REL --n-files N --scratch DIR --mnt DIR --stagefs BIN --out F
  bench.py levers  --bigdata DIR --scratch DIR --mnt DIR --stagefs BIN --out F
  bench.py report  RESULTS.jsonl...          # markdown on stdout

Each part appends one JSON line per pass to --out (with the round, the 1-minute load average at
the start and end of the pass), plus notes with `uptime` at the start and end of the part and the
git commit. The parts are in backend.py, scale.py and levers.py; the readers, run as the
unprivileged user, in reader.py; the report in report.py.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from common import HERE, uptime


def commit() -> str:
    if os.environ.get("BENCH_COMMIT"):  # run.sh runs a copy of these scripts: it says which
        return os.environ["BENCH_COMMIT"]
    repo = os.path.dirname(os.path.dirname(HERE))
    r = subprocess.run(["git", "-C", repo, "describe", "--always", "--dirty", "--abbrev=12"],
                       capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    scratch = os.environ.get("BENCH_SCRATCH", "?")
    return (f"{os.cpu_count()} CPUs, {mem:.0f} GiB RAM, kernel {platform.release()}, "
            f"scratch {scratch}")


def note(path: str, part: str, **kw) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"part": part, "round": 0, "mode": "note",
                            "time": time.strftime("%F %T"), **kw}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        for opt in ("--scratch", "--mnt", "--stagefs", "--out"):
            sp.add_argument(opt, required=True)
        sp.add_argument("--user", default="stagefs-test", help="the unprivileged account")
        sp.add_argument("--rounds", type=int, default=2)
        sp.add_argument("--only", default="", help="run only the passes matching this regex")
        sp.add_argument("--cache-size", default="8G")
        sp.add_argument("--params", default="", help="dataset sizes, for the report")

    b = sub.add_parser("backend")
    common(b)
    b.add_argument("--bigdata", required=True)
    b.add_argument("--device", required=True, help="the slow block device file (probe)")
    b.add_argument("--datasets", default="small,large")
    b.add_argument("--readers", default="shuf8,seq")
    b.add_argument("--sides", default="seed,user,direct,root")
    b.add_argument("--later", type=int, default=3, help="epochs measured after epoch 1")
    b.add_argument("--compute", action="store_true",
                   help="every epoch feeds a training step as slow as a local read (backend.py)")

    s = sub.add_parser("scale")
    common(s)
    s.add_argument("--source", required=True)
    s.add_argument("--deep", required=True, help="a file deep in SOURCE (relative path)")
    s.add_argument("--n-files", type=int, required=True)

    lv = sub.add_parser("levers")
    common(lv)
    lv.add_argument("--bigdata", required=True)
    lv.add_argument("--levers", default="warm,cold,list")

    rep = sub.add_parser("report")
    rep.add_argument("results", nargs="+")
    a = p.parse_args()

    if a.cmd == "report":
        from report import report
        sys.stdout.write(report(a.results))
        return
    if a.cmd == "backend":
        from backend import Backend as Part
    elif a.cmd == "scale":
        from scale import Scale as Part
    else:
        from levers import Levers as Part
    note(a.out, a.cmd, commit=commit(), machine=machine(), uptime_start=uptime(),
         params=a.params, rounds=a.rounds)
    try:
        Part(a).run()
    finally:
        note(a.out, a.cmd, uptime_end=uptime())


if __name__ == "__main__":
    main()

"""A fuzz campaign: every `-m fuzz` test (tests/fuzz) in rounds with fresh random seeds until a
time budget is spent, then per kernel the examples that ran, the failures found and the slowest
cases, and the exact reproduction of every failure.

    python bench/fuzz_campaign.py --minutes 60 [--examples 100] [--tests tests/fuzz/...]

Each round runs pytest once over the tests with TORCH_STEEL_FUZZ_EXAMPLES=--examples, and
hypothesis seeds each test afresh (a fixed seed, `--hypothesis-seed` or `@seed`, would turn the
database off). Hypothesis' example database (--db, by default
.hypothesis/examples, what tests/fuzz/fuzz_helpers.fuzz() uses) is kept between rounds and
runs, so a failure found once is replayed first next time. The counts come from what ran:
fuzz_helpers.fuzz() appends one line per example the test body ran to TORCH_STEEL_FUZZ_LOG
(the test, the kernels it exercised, seconds, outcome, and the recipe of failures and of the
slowest cases), which this script sets per round and reads back. A failure's reproduction is
its test id and the `@reproduce_failure(...)` line hypothesis prints (pytest's junit report
holds it; it replays in the same hypothesis version), and the drawn call's repr, which is the
whole recipe (a fixed test can build it by hand in any version). A round still
running when the budget ends is stopped; its examples so far count.

The per-kernel totals are added to --record (bench/fuzz_record.json, committed), one entry per
campaign, which the README's reliability section quotes. `--record none` keeps no record. The
entry is rewritten after every round (under a file lock, so campaigns side by side can share a
record), so a campaign killed mid-way keeps every round it finished.
This is a benchmark-style tool, not a test: it asserts nothing, and exits 1 if a failure was
found.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import fcntl
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPRODUCE = re.compile(r"@reproduce_failure\([^)]*\)")
SLOWEST = 3  # slowest cases printed per kernel


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, required=True, help="time budget")
    ap.add_argument("--examples", type=int, default=100, help="examples per test and round")
    ap.add_argument("--tests", nargs="+", default=["tests/fuzz"], help="pytest paths or ids")
    ap.add_argument("--db", default=str(ROOT / ".hypothesis" / "examples"),
                    help="hypothesis example database, kept between runs")  # fmt: skip
    ap.add_argument("--workdir", default=str(ROOT / "build" / "fuzz_campaign"),
                    help="the rounds' logs, pytest output and junit reports")  # fmt: skip
    ap.add_argument("--record", default=str(ROOT / "bench" / "fuzz_record.json"),
                    help="cumulative per-kernel record to add to, or 'none'")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=0, help="stop after this many (0: the budget)")
    return ap.parse_args(argv)


def run_round(n, args, deadline, workdir):
    """One pytest run over the tests; returns (returncode or None if stopped, paths)."""
    log, out, xml = (workdir / f"round-{n}.{ext}" for ext in ("jsonl", "out", "xml"))
    env = dict(os.environ, TORCH_STEEL_FUZZ_EXAMPLES=str(args.examples),
               TORCH_STEEL_FUZZ_DB=args.db, TORCH_STEEL_FUZZ_LOG=str(log))  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "fuzz", f"--junitxml={xml}",
           "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT),
           *args.tests]  # fmt: skip
    if importlib.util.find_spec("xdist"):
        cmd[3:3] = ["-n", "0"]  # one worker: the examples run in order, the log is one stream
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = None
    return rc, (log, out, xml)


def read_log(path):
    if not path.exists():
        return []
    lines = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:  # the last line of a stopped round may be cut
            pass
    return lines


def pytest_failures(out, xml):
    """{test id: report text} of the failed or erroring tests: the ids from pytest's summary
    (FAILED / ERROR lines), the text (hypothesis' falsifying example and reproduce_failure
    line) from the junit report."""
    ids = []
    if out.exists():
        ids = re.findall(r"^(?:FAILED|ERROR) (\S+)", out.read_text(), re.M)
    found = {}
    if xml.exists():
        for case in ET.parse(xml).iter("testcase"):
            bad = [e for e in case if e.tag in ("failure", "error")]
            if not bad:
                continue
            # the junit case is (module as a dotted path, function[params]); match it to an id
            module, name = case.get("classname", "").rpartition(".")[2], case.get("name", "")
            same = [i for i in ids if i.endswith("::" + name)]
            same = [i for i in same if Path(i.split("::")[0]).stem == module] or same
            test = same[0] if same else f"{module}.py::{name}"
            if test in ids:
                ids.remove(test)
            found[test] = "\n".join((e.get("message") or "") + "\n" + (e.text or "")
                                    for e in bad)  # fmt: skip
    found.update((test, "") for test in ids)  # reported, but not in the junit report
    return found


def campaign(args):
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for old in workdir.glob("round-*"):
        old.unlink()
    start = time.monotonic()
    deadline = start + args.minutes * 60
    examples = collections.Counter()  # kernel -> examples run
    per_test = collections.defaultdict(collections.Counter)  # test -> outcome -> count
    slow = collections.defaultdict(list)  # kernel -> [(seconds, test, call)]
    failures = []
    rounds = 0
    # This campaign's entry in the record: its own id (a commit landing mid-campaign, or a
    # campaign started beside it in the same second, must not make a second entry), its commit
    # that of its start.
    entry = {
        "id": uuid.uuid4().hex,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
    }  # fmt: skip
    print(f"fuzz campaign: {args.minutes:g} min, {args.examples} examples per test and round, "
          f"database {args.db}", flush=True)  # fmt: skip
    while time.monotonic() < deadline and (not args.rounds or rounds < args.rounds):
        rounds += 1
        rc, (log, out, xml) = run_round(rounds, args, deadline, workdir)
        lines = read_log(log)
        last_fail = {}
        for line in lines:
            per_test[line["test"]][line["outcome"]] += 1
            if line["outcome"] == "rejected":
                continue
            for kernel in line["kernels"]:
                examples[kernel] += 1
                if "call" in line and line["outcome"] == "ok":
                    slow[kernel].append((line["seconds"], line["test"], line["call"]))
            if line["outcome"] == "fail":
                last_fail[line["test"]] = line
        reported = pytest_failures(out, xml)
        for test, text in reported.items():
            blob = REPRODUCE.findall(text)
            fail = last_fail.get(_log_name(test))
            failures.append({
                "test": test, "round": rounds,
                "reproduce": blob[-1] if blob else None,
                "kernels": fail["kernels"] if fail else [],
                "call": fail["call"] if fail else None,
                "message": text.strip().splitlines()[0][:300] if text.strip() else "",
            })  # fmt: skip
        # A failure whose round was stopped before pytest reported it: the log has its recipe.
        for name, fail in last_fail.items():
            if not any(_log_name(f["test"]) == name for f in failures if f["round"] == rounds):
                failures.append({"test": name, "round": rounds,
                                 "reproduce": None, "kernels": fail["kernels"],
                                 "call": fail.get("call"),
                                 "message": "stopped before pytest reported it"})  # fmt: skip
        state = "stopped at the budget" if rc is None else f"pytest exit {rc}"
        if rc not in (None, 0, 1):
            state += f" (see {out})"
        print(f"round {rounds}: {len(lines)} examples, {len(reported)} failed, "
              f"{state}", flush=True)  # fmt: skip
        if args.record != "none":
            minutes = (time.monotonic() - start) / 60
            record(Path(args.record), entry, rounds, examples, failures, minutes, args)
    minutes = (time.monotonic() - start) / 60
    report(examples, per_test, slow, failures, rounds, minutes)
    summary = {"rounds": rounds, "minutes": round(minutes, 2), "examples": dict(examples),
               "tests": {t: dict(c) for t, c in per_test.items()},
               "failures": failures}  # fmt: skip
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if args.record != "none":
        print(f"\nrecord: {args.record}")
    return 1 if failures else 0


def _log_name(test_id):
    """The log's name of a test (file name::function) from a pytest id."""
    path, _, name = test_id.partition("::")
    return f"{Path(path).name}::{name.split('[')[0]}"


def report(examples, per_test, slow, failures, rounds, minutes):
    failed = collections.Counter(k for f in failures for k in (f["kernels"] or ["?"]))
    print(f"\n{rounds} rounds in {minutes:.1f} min")
    print(f"{'kernel':<20} {'examples':>9} {'failures':>9}")
    for kernel in sorted(examples):
        print(f"{kernel:<20} {examples[kernel]:>9} {failed[kernel]:>9}")
    print(f"\n{'test':<66} {'ok':>7} {'fail':>5} {'rejected':>9}")
    for test in sorted(per_test):
        c = per_test[test]
        print(f"{test:<66} {c['ok']:>7} {c['fail']:>5} {c['rejected']:>9}")
    print("\nslowest cases per kernel:")
    for kernel in sorted(slow):
        for seconds, test, call in sorted(slow[kernel], reverse=True)[:SLOWEST]:
            print(f"  {kernel:<20} {seconds:7.2f} s  {test}  {' '.join(call.split())[:150]}")
    if failures:
        print("\nfailures (reproduce each):")
    for f in failures:
        print(f"  {f['test']} [{', '.join(f['kernels'])}]: {f['message']}")
        if f["reproduce"]:
            print(f"    decorate the test with {f['reproduce']}, then python -m pytest -m fuzz "
                  f"'{f['test']}'  (the database also replays it first)")  # fmt: skip
        if f["call"]:
            print(f"    drawn: {f['call']}")


def record(path, entry, rounds, examples, failures, minutes, args):
    """Writes this campaign's entry (so far) into the cumulative record, replacing the entry it
    wrote after the previous round (found by its id), and recomputes the per-kernel totals. The
    read-modify-write holds an exclusive lock on a file beside the record, since campaigns run
    side by side may share one record."""
    import hypothesis

    failed = collections.Counter(k for f in failures for k in (f["kernels"] or ["?"]))
    entry = {
        **entry, "hypothesis": hypothesis.__version__,
        "minutes": round(minutes, 1), "rounds": rounds, "examples_per_round": args.examples,
        "tests": args.tests,
        "kernels": {k: {"examples": examples[k], "failures": failed[k]} for k in sorted(examples)},
        "failures": [{k: f[k] for k in ("test", "reproduce", "call")}
                     for f in failures],
    }  # fmt: skip
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(path.read_text()) if path.exists() else {"campaigns": []}
        same = [i for i, c in enumerate(data["campaigns"]) if c.get("id") == entry["id"]]
        if same:
            data["campaigns"][same[-1]] = entry
        else:
            data["campaigns"].append(entry)
        totals = collections.defaultdict(lambda: {"examples": 0, "failures": 0})
        for c in data["campaigns"]:
            for k, v in c["kernels"].items():
                totals[k]["examples"] += v["examples"]
                totals[k]["failures"] += v["failures"]
        data["totals"] = dict(sorted(totals.items()))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)  # a campaign killed mid-write leaves the old record whole


if __name__ == "__main__":
    sys.exit(campaign(parse_args(sys.argv[1:])))

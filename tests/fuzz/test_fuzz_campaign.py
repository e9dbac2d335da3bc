"""The fuzz campaign runner (bench/fuzz_campaign.py) on a tiny budget: two toy fuzz tests (one
that passes, one that fails for x >= 3) and one real one, 5 examples each, run twice. The counts
are what ran (the passing tests' 5 examples each), the failure is named with its test id, its
`@reproduce_failure` line and the drawn arguments, the example database replays it first on the
second run, and the record adds the two campaigns up."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from fuzz_helpers import ROOT

TOY_PASS = f"""
import sys
sys.path[:0] = {[str(ROOT / "tests" / d) for d in ("fuzz", "gemm", "attn")]!r}
from fuzz_helpers import fuzz, fuzz_mark
from hypothesis import given, strategies as st


@fuzz_mark
@fuzz(lambda x: ["toy pass"])
@given(st.integers(0, 2**62))
def test_toy_pass(x):
    pass
"""
TOY = (
    TOY_PASS
    + """

@fuzz_mark
@fuzz(lambda x: ["toy fail"])
@given(st.integers(0, 10))
def test_toy_fail(x):
    assert x < 3
"""
)


def campaign(tmp_path, *tests):
    cmd = [sys.executable, str(ROOT / "bench" / "fuzz_campaign.py"), "--minutes", "5",
           "--rounds", "1", "--examples", "5", "--db", str(tmp_path / "db"),
           "--workdir", str(tmp_path / "work"), "--record", str(tmp_path / "record.json"),
           "--tests", str(tmp_path / "test_toy.py"), *tests]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    work = tmp_path / "work"
    log = [json.loads(x) for x in (work / "round-1.jsonl").read_text().splitlines()]
    return done, log, json.loads((work / "summary.json").read_text())


@pytest.fixture
def work_dir():
    """A scratch directory under build/ (inside the repository, so that pytest names the toy
    tests by a path, as it names tests/fuzz's)."""
    (ROOT / "build").mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="test_fuzz_campaign_", dir=ROOT / "build"))
    yield path
    shutil.rmtree(path)


def test_campaign_counts_names_failures_and_replays_them(work_dir):
    tmp_path = work_dir
    (tmp_path / "test_toy.py").write_text(TOY)
    done, log, summary = campaign(tmp_path, "tests/fuzz/test_fuzz_gemm.py::test_fuzz_gemm_refusals")
    assert done.returncode == 1, done.stdout + done.stderr  # a failure was found
    # the passing tests ran their 5 examples each, as the log's lines say
    assert summary["examples"]["toy pass"] == summary["examples"]["refusals"] == 5, summary
    assert sum(x["test"] == "test_toy.py::test_toy_pass" for x in log) == 5
    assert summary["tests"]["test_fuzz_gemm.py::test_fuzz_gemm_refusals"] == {"ok": 5}
    (fail,) = summary["failures"]
    assert fail["test"] == f"{tmp_path.relative_to(ROOT)}/test_toy.py::test_toy_fail"
    assert fail["kernels"] == ["toy fail"]
    assert fail["call"] == "x=3" and fail["reproduce"].startswith("@reproduce_failure(")
    assert fail["reproduce"] in done.stdout and "drawn: x=3" in done.stdout
    assert summary["examples"]["toy fail"] == sum(x["test"].endswith("toy_fail") for x in log)

    again, log, _ = campaign(tmp_path)
    assert again.returncode == 1
    first = next(x for x in log if x["test"] == "test_toy.py::test_toy_fail")
    assert first["outcome"] == "fail" and first["call"] == "x=3", "no replay from the database"
    record = json.loads((tmp_path / "record.json").read_text())
    assert len(record["campaigns"]) == 2
    assert record["totals"]["refusals"] == {"examples": 5, "failures": 0}
    assert record["totals"]["toy pass"]["examples"] == 10
    assert record["totals"]["toy fail"]["failures"] == 2


def test_a_killed_campaign_keeps_the_rounds_it_finished(work_dir):
    """The record is rewritten after every round: kill a campaign (SIGKILL, as a session that
    stops does) once two rounds are recorded, and the record holds one entry for it whose
    counts are its finished rounds'."""
    (work_dir / "test_toy.py").write_text(TOY_PASS)
    path = work_dir / "record.json"
    cmd = [sys.executable, str(ROOT / "bench" / "fuzz_campaign.py"), "--minutes", "5",
           "--examples", "5", "--db", str(work_dir / "db"), "--workdir", str(work_dir / "work"),
           "--record", str(path), "--tests", str(work_dir / "test_toy.py")]  # fmt: skip
    # its own process group, so that the kill takes its pytest round too (which would otherwise
    # go on writing into the directory the fixture removes)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if path.exists() and json.loads(path.read_text())["campaigns"][0]["rounds"] >= 2:
                break
            assert proc.poll() is None, "the campaign ended before it was killed"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    (entry,) = json.loads(path.read_text())["campaigns"]
    # found by its own id, so that a commit landing mid-campaign makes no second entry
    assert entry["rounds"] >= 2 and len(entry["id"]) == 32
    assert entry["kernels"] == {"toy pass": {"examples": 5 * entry["rounds"], "failures": 0}}

""".github/workflows/macos.yml is a transcription of docs/mac.md: every command in that page's
code blocks, and in the README's "Report a Mac problem", is run by the workflow (nothing there
can run here; this keeps them from drifting apart)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "macos.yml"


def _normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("\\\n", " "))


def _mac_section_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    report = readme[readme.index("## Report a Mac problem") :]
    report = report[: report.index("\n## ")]
    section = (ROOT / "docs" / "mac.md").read_text() + report
    commands = []
    for block in re.findall(r"^```\n(.*?)^```", section, re.M | re.S):
        for line in block.splitlines():
            command = line.split("  #", 1)[0].strip()
            if command:
                commands.append(command)
    return commands


def test_the_mac_section_has_commands():
    assert len(_mac_section_commands()) >= 8


@pytest.mark.parametrize("command", _mac_section_commands())
def test_the_workflow_runs_each_command_of_the_mac_section(command):
    assert _normalized(command) in _normalized(WORKFLOW.read_text())


def test_the_workflow_runs_the_readme_test_command_and_uploads_the_bench_tables():
    workflow = WORKFLOW.read_text()
    assert "run: python -m pytest -n 2" in workflow
    assert "actions/upload-artifact" in workflow and "bench-gemm-float16.txt" in workflow

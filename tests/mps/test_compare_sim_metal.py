"""bench/compare_sim_metal.py, the script Mac users run to report a misbehaving kernel."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "compare_sim_metal", ROOT / "bench" / "compare_sim_metal.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _no_strict_leak(monkeypatch):
    # main() turns strict mode on for its process; monkeypatch restores the variable after.
    monkeypatch.setenv("TORCH_STEEL_STRICT", "1")


def test_compare_points_at_the_worst_difference(script, capsys):
    reference = torch.zeros(3, 4)
    metal = reference.clone()
    metal[2, 1] = 0.5
    sim = reference.clone()
    sim[0, 0] = 0.01
    script.compare(
        {"reference": {"out": reference}, "sim": {"out": sim}, "metal": {"out": metal}}, show=False
    )
    out = capsys.readouterr().out
    assert "metal vs sim: max abs diff 5.000e-01 at (2, 1) (metal 0.5, sim 0)" in out
    assert "    sim vs reference: max abs err 1.000e-02" in out


def test_save_and_replay(script, tmp_path, capsys):
    case = tmp_path / "case.pt"
    assert (
        script.main(
            [
                "gemm",
                "--m",
                "3",
                "--n",
                "5",
                "--k",
                "4",
                "--bias",
                "--beta",
                "0.5",
                "--save",
                str(case),
            ]
        )
        == 0
    )
    saved = torch.load(case, weights_only=False)
    assert set(saved["inputs"]) == {"a", "b", "bias", "c"}
    # A replay elsewhere compares its paths with the saved ones (here: a fake Metal result).
    saved["results"]["metal"] = {"out": saved["results"]["reference"]["out"] + 0.25}
    torch.save(saved, case)
    capsys.readouterr()
    assert script.main(["--load", str(case)]) == 0
    out = capsys.readouterr().out
    assert "replaying" in out
    assert "  metal vs reference: max abs err 2.500e-01" in out


def test_simulator_path(script, capsys):
    from torch_steel import backends

    if not backends.sim_status()[0]:
        pytest.skip("the simulator is unavailable here: " + backends.sim_status()[1])
    assert script.main(["gemm", "--m", "9", "--n", "10", "--k", "11", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "sim vs reference" in out
    assert "FAILED" not in out

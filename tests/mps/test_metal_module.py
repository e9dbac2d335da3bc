"""torch_steel.metal: library loading, refusal translation, and behaviour without the extension.

The extension itself only builds on macOS; here a stand-in with the same functions checks what
the Python wrapper does with it.
"""

import json
import re
from pathlib import Path

import pytest
import torch

from torch_steel import metal
from torch_steel.errors import PlanRefused


class FakeExtension:
    """Records the calls torch_steel.metal makes to torch_steel._C_metal."""

    def __init__(self):
        self.calls = []
        self.error = None
        self.metallib_error = None
        self.compile_error = None
        self.tensor_ops_loads = True  # the device reports Metal 4

    def load_metallib(self, path):
        self.calls.append(("load_metallib", path))
        if self.metallib_error is not None:
            raise self.metallib_error

    def compile_sources(self, sources):
        self.calls.append(("compile_sources", sources))
        if self.compile_error is not None:
            raise self.compile_error

    def load_tensor_ops_metallib(self, path):
        self.calls.append(("load_tensor_ops_metallib", path))
        return self.tensor_ops_loads

    def compile_tensor_ops_sources(self, sources):
        self.calls.append(("compile_tensor_ops_sources", sources))
        return True

    def run_op(self, op, tensors, options):
        self.calls.append(("run_op", op, len(tensors), options))
        if self.error is not None:
            raise self.error
        return (torch.zeros(2),)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    ext = FakeExtension()
    monkeypatch.setattr(metal, "_extension", lambda: ext)
    monkeypatch.setattr(metal, "_loaded", False)
    monkeypatch.setattr(metal, "_load_failure", None)
    monkeypatch.setattr(metal, "PACKAGE_DIR", tmp_path)
    return ext


def _sources(tmp_path, names):
    (tmp_path / metal.SOURCE_DIR).mkdir()
    for name in names:
        (tmp_path / metal.SOURCE_DIR / name).write_text(f"// {name}\n")


def test_without_the_extension():
    if metal._extension() is not None:
        pytest.skip("the Metal extension is built here")
    assert metal.available() is False
    with pytest.raises(RuntimeError, match="Metal extension is not built"):
        metal.run_op("gemm", [torch.zeros(2, 2), torch.zeros(2, 2), None, None], {})


@pytest.mark.parametrize("macos_14", [True, False])
def test_available_needs_macos_14(fake, monkeypatch, macos_14):
    """On macOS 13 PyTorch's MPS works, but neither the metallib (built for macOS 14) nor the
    runtime compiler (Metal 3.1) can serve the kernels: the ops must keep to reference math
    instead of failing in run_op."""
    asked = []

    def is_macos_or_newer(major, minor):
        asked.append((major, minor))
        return macos_14

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", is_macos_or_newer)
    assert metal.available() is macos_14
    assert asked == [(14, 0)]


def test_loads_the_metallib_once(fake, tmp_path):
    (tmp_path / metal.METALLIB).write_bytes(b"MTLB")
    _sources(tmp_path, ["a.metal"])  # the metallib wins over the sources
    for _ in range(2):
        assert len(metal.run_op("gemm", [None], {"alpha": 1.0})) == 1
    assert fake.calls[0] == ("load_metallib", str(tmp_path / metal.METALLIB))
    assert [c[0] for c in fake.calls] == ["load_metallib", "run_op", "run_op"]


def test_the_tensor_op_library_loads_after_the_main_one(fake, tmp_path):
    (tmp_path / metal.METALLIB).write_bytes(b"MTLB")
    (tmp_path / metal.TENSOR_OPS_METALLIB).write_bytes(b"MTLB")
    _sources(tmp_path, ["a.metal", "t_msl4.metal"])
    metal.run_op("gemm", [None], {})
    assert fake.calls[:2] == [
        ("load_metallib", str(tmp_path / metal.METALLIB)),
        ("load_tensor_ops_metallib", str(tmp_path / metal.TENSOR_OPS_METALLIB)),
    ]


def test_tensor_op_sources_are_compiled_apart_where_their_metallib_does_not_load(fake, tmp_path):
    # An older OS or a GPU without Metal 4: the extension declines the metallib; the sources are
    # offered (it declines them too there); the MSL 3.1 compile never sees an MSL 4 source.
    (tmp_path / metal.TENSOR_OPS_METALLIB).write_bytes(b"MTLB")
    fake.tensor_ops_loads = False
    _sources(tmp_path, ["a.metal", "t_msl4.metal"])
    with pytest.warns(UserWarning, match="Metal runtime compiler"):
        metal.run_op("gemm", [None], {})
    assert [c[0] for c in fake.calls] == [
        "compile_sources",
        "load_tensor_ops_metallib",
        "compile_tensor_ops_sources",
        "run_op",
    ]
    assert fake.calls[0][1] == ["// a.metal\n"]
    assert fake.calls[2][1] == ["// t_msl4.metal\n"]


def test_compiles_the_sources_once_with_a_message(fake, tmp_path):
    _sources(tmp_path, ["b.metal", "a.metal"])
    with pytest.warns(UserWarning, match="Metal runtime compiler"):
        metal.run_op("gemm", [None], {})
    metal.run_op("gemm", [None], {})
    assert fake.calls[0] == ("compile_sources", ["// a.metal\n", "// b.metal\n"])
    assert [c[0] for c in fake.calls] == ["compile_sources", "run_op", "run_op"]


def test_a_metallib_that_does_not_load_falls_back_to_the_sources(fake, tmp_path):
    (tmp_path / metal.METALLIB).write_bytes(b"MTLB")
    _sources(tmp_path, ["a.metal"])
    fake.metallib_error = RuntimeError("torch-steel: cannot load the Metal library: version")
    with pytest.warns(UserWarning, match="metallib does not load .*runtime compiler"):
        metal.run_op("gemm", [None], {})
    assert [c[0] for c in fake.calls] == ["load_metallib", "compile_sources", "run_op"]


def test_a_metallib_that_does_not_load_without_sources_is_an_error(fake, tmp_path):
    (tmp_path / metal.METALLIB).write_bytes(b"MTLB")
    fake.metallib_error = RuntimeError("torch-steel: cannot load the Metal library: version")
    with pytest.raises(RuntimeError, match="cannot load the Metal library"):
        metal.run_op("gemm", [None], {})


def test_a_failed_load_is_not_retried_on_every_op(fake, tmp_path):
    """Compiling every shader takes seconds: a library that does not compile must not be
    compiled again by each later op call, which raise the same error at once."""
    _sources(tmp_path, ["a.metal"])
    fake.compile_error = RuntimeError("torch-steel: the Metal runtime compiler rejected x")
    with pytest.warns(UserWarning, match="runtime compiler"):
        with pytest.raises(RuntimeError, match="rejected x"):
            metal.run_op("gemm", [None], {})
    for _ in range(2):
        with pytest.raises(RuntimeError, match="Metal kernels are unavailable: .*rejected x"):
            metal.run_op("gemm", [None], {})
    assert [c[0] for c in fake.calls] == ["compile_sources"]


def test_the_compile_warning_points_at_the_caller(fake, tmp_path):
    _sources(tmp_path, ["a.metal"])
    with pytest.warns(UserWarning, match="runtime compiler") as record:
        metal.run_op("gemm", [None], {})
    assert record[0].filename == __file__


def test_no_library_installed(fake):
    with pytest.raises(RuntimeError, match="reinstall torch-steel"):
        metal.run_op("gemm", [None], {})
    assert fake.calls == []


def test_refusal_becomes_plan_refused(fake, tmp_path):
    (tmp_path / metal.METALLIB).write_bytes(b"MTLB")
    fake.error = RuntimeError(
        "steel plan refused: gemm: K = 3000000000 does not fit in 32 bits\n"
        "Exception raised from run_op at module.mm:123 (most recent call first):\n#0 ..."
    )
    with pytest.raises(PlanRefused) as refused:
        metal.run_op("gemm", [None], {})
    assert str(refused.value) == "gemm: K = 3000000000 does not fit in 32 bits"


def test_other_errors_propagate(fake, tmp_path):
    (tmp_path / metal.METALLIB).write_bytes(b"MTLB")
    fake.error = RuntimeError("torch-steel: gemm tensor 0 is on cpu; the Metal path takes MPS")
    with pytest.raises(RuntimeError, match="is on cpu") as error:
        metal.run_op("gemm", [None], {})
    assert not isinstance(error.value, PlanRefused)


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("steel plan refused: no Metal kernel for op 'x' yet", "no Metal kernel for op 'x' yet"),
        (
            "steel plan refused: kernel k runs at most 512 threads\nException raised from",
            "kernel k runs at most 512 threads",
        ),
        ("torch-steel: invalid launch plan for gemm: kernel k: buffer(3) is bound twice", None),
    ],
)
def test_refusal_reason(message, reason):
    assert metal.refusal_reason(message) == reason


def test_fake_matches_the_extension_source():
    """The stand-in above has exactly the functions module.mm exports, and the refusal prefix of
    the host code it runs (mps/host.h)."""
    mps = Path(__file__).resolve().parents[2] / "mps_src" / "mps"
    source = (mps / "module.mm").read_text()
    exported = set(re.findall(r'm\.def\("(\w+)"', source))
    faked = {name for name in vars(FakeExtension) if not name.startswith("_")}
    assert exported == faked
    assert f'kRefused = "{metal.REFUSED_PREFIX}"' in (mps / "host.h").read_text()


# ---- an extension that does not match the running torch -----------------------------------
#
# The extension is tied to the C++ ABI of the torch it was built against. After a torch upgrade
# it must not break every op: the ops fall back to reference math, warned once, and the load is
# neither retried nor re-raised on each call.

STUB_MODULE = """
import pathlib
count = pathlib.Path(__file__).with_name("imports")
count.write_text(str(int(count.read_text()) + 1 if count.exists() else 1))
# What CPython raises when the dynamic loader refuses an extension: named with the short name.
raise ImportError(
    "dlopen(_C_metal.cpython-311-darwin.so): symbol not found in flat namespace "
    "'__ZN3c1015SmallVectorBase'",
    name="_C_metal",
)
"""


@pytest.fixture
def stub_extension(monkeypatch, tmp_path):
    """torch_steel.metal pointed at a stub package `stubsteel` (its _C_metal and build info)."""
    import sys

    package = tmp_path / "stubsteel"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_C_metal.py").write_text(STUB_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(metal, "EXTENSION", "stubsteel._C_metal")
    metal._load_extension.cache_clear()
    # As on a Mac with MPS, where only the extension stands between the ops and the kernels.
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: True)
    from torch_steel import backends

    monkeypatch.setattr(backends, "_device_type", lambda tensors: "mps")
    monkeypatch.setattr(backends, "_warned", set())
    monkeypatch.delenv("TORCH_STEEL_STRICT", raising=False)
    yield package
    metal._load_extension.cache_clear()
    for name in [m for m in sys.modules if m == "stubsteel" or m.startswith("stubsteel.")]:
        del sys.modules[name]


def _record(package, version):
    (package / metal.BUILD_INFO).write_text(json.dumps({"torch": version}))


def _imports(package):
    count = package / "imports"
    return int(count.read_text()) if count.exists() else 0


def _ops_fall_back_once(match):
    """Two different ops, three calls each: reference results and a single warning."""
    import warnings

    import torch_steel

    a, b = torch.randn(3, 5), torch.randn(5, 2)
    q = torch.randn(1, 2, 4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.testing.assert_close(torch_steel.gemm(a, b), a @ b)
            torch_steel.sdpa(q, q, q)
    fallbacks = [w for w in caught if issubclass(w.category, torch_steel.FallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    assert re.search(match, str(fallbacks[0].message)), str(fallbacks[0].message)
    assert "--no-build-isolation" in str(fallbacks[0].message)


def test_an_extension_that_does_not_import_falls_back_once(stub_extension):
    _record(stub_extension, str(torch.__version__))
    _ops_fall_back_once(r"Metal extension does not load \(dlopen\(.*symbol not found")
    assert _imports(stub_extension) == 1  # not retried by later calls
    assert metal.available() is False


def test_an_extension_built_for_another_torch_is_not_imported(stub_extension):
    _record(stub_extension, "2.12.0")
    _ops_fall_back_once(
        rf"built against torch 2\.12\.0, but torch {re.escape(str(torch.__version__))} is running"
    )
    assert _imports(stub_extension) == 0  # a mismatched ABI is never loaded


def test_an_extension_without_a_recorded_torch_is_not_imported(stub_extension):
    _ops_fall_back_once(r"built against torch \(unknown\)")
    assert _imports(stub_extension) == 0


def test_metal_status_names_the_extension_problem(stub_extension):
    from torch_steel import backends

    _record(stub_extension, "2.12.0")
    ok, why = backends.metal_status()
    assert not ok and "built against torch 2.12.0" in why


def test_strict_mode_raises_the_problem(stub_extension, monkeypatch):
    import torch_steel

    _record(stub_extension, str(torch.__version__))
    monkeypatch.setenv("TORCH_STEEL_STRICT", "1")
    for _ in range(2):
        with pytest.raises(PlanRefused, match="does not load"):
            torch_steel.gemm(torch.randn(2, 2), torch.randn(2, 2))
    assert _imports(stub_extension) == 1


def test_the_build_records_what_metal_reads(tmp_path):
    """build_macos writes the build info that torch_steel.metal checks, in the same place."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "build_macos", root / "mps_src" / "mps" / "build_macos.py"
    )
    build_macos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_macos)
    assert build_macos.BUILD_INFO == metal.BUILD_INFO
    path = build_macos.write_build_info(tmp_path, "2.13.0")
    assert path == tmp_path / metal.BUILD_INFO
    assert metal._built_for(path) == "2.13.0"

"""Installing torch-steel: the build requirements, the sdist, and isolated builds.

pip builds a package in an isolated environment that holds only pyproject.toml's
`[build-system] requires` (and their dependencies). Linux builds nothing native, so CI never sees
what the Mac build needs; these tests check it here:

- the build requirements per platform (torch on macOS only);
- the darwin branch of setup.py run as pip's isolated build runs it: sys.platform forced to
  "darwin" and every import outside the standard library and the build requirements refused;
- `pip install .` from a fresh clone and from the sdist, each in a real isolated build (pip
  fetches setuptools from PyPI, or its cache; no torch on Linux), and what the sdist carries.
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What pip uses when pyproject.toml has no [build-system] table (pip 23: setuptools and wheel).
PIP_DEFAULT_REQUIRES = ["setuptools>=40.8.0", "wheel"]
DARWIN = {"sys_platform": "darwin", "platform_system": "Darwin", "os_name": "posix"}
LINUX = {"sys_platform": "linux", "platform_system": "Linux", "os_name": "posix"}

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
requirements = pytest.importorskip("packaging.requirements")


def _tracked_files() -> list[str]:
    """The files a fresh clone of this working tree would have (tracked or about to be)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an unpacked sdist, say): no clone to make")
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted(name for name in out.split("\0") if name and (ROOT / name).is_file())


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh clone of the working tree: its files, none of its build products."""
    target = tmp_path_factory.mktemp("clone") / "torch-steel"
    for name in _tracked_files():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target / name)
    return target


@pytest.fixture(scope="module")
def sdist(clone, tmp_path_factory) -> Path:
    """The sdist built from the clone (setuptools' PEP 517 hook, as `python -m build --sdist`
    runs it; building an sdist needs setuptools only)."""
    out = tmp_path_factory.mktemp("sdist")
    script = (
        "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    )
    result = _run([sys.executable, "-c", script, str(out)], cwd=clone)
    return out / result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def unpacked_sdist(sdist, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(sdist) as archive:
        archive.extractall(target, filter="data")
    (top,) = target.iterdir()
    return top


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def _run(command, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command, cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def _build_requires(tree: Path) -> list[str]:
    data = tomllib.loads((tree / "pyproject.toml").read_text())
    return data.get("build-system", {}).get("requires", PIP_DEFAULT_REQUIRES)


def _names(requires: list[str], environment: dict) -> set[str]:
    return {
        requirements.Requirement(r).name.lower()
        for r in requires
        if requirements.Requirement(r).marker is None
        or requirements.Requirement(r).marker.evaluate(environment)
    }


def test_pyproject_has_a_build_system_table():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["build-system"]["build-backend"] == "setuptools.build_meta"


def test_torch_is_a_build_requirement_on_macos_only():
    """The Mac build compiles against torch (torch.utils.cpp_extension); elsewhere nothing is
    compiled at install time, and an isolated build must not fetch torch for nothing."""
    requires = _build_requires(ROOT)
    assert "torch" in _names(requires, DARWIN)
    assert "torch" not in _names(requires, LINUX)
    assert "setuptools" in _names(requires, LINUX)


def test_the_mac_build_pins_the_torch_that_ci_and_the_readme_install():
    """The extension is tied to the torch it is compiled against: an isolated build must compile
    against the torch the README's install command puts beside it."""
    (torch_requirement,) = [
        r for r in _build_requires(ROOT) if requirements.Requirement(r).name == "torch"
    ]
    pinned = str(requirements.Requirement(torch_requirement).specifier)
    assert pinned.startswith("==")
    assert f"pip install torch{pinned} " in (ROOT / "README.md").read_text()
    assert f"pip install torch{pinned}\n" in (ROOT / ".ci" / "run").read_text()


# ---- the darwin branch, as pip's isolated build runs it --------------------------------------

ISOLATED_DARWIN_BUILD = r"""
import importlib.abc, importlib.machinery, json, os, sys

allowed, record = set(json.loads(sys.argv[1])), sys.argv[2]
sites = [p for p in sys.path if os.path.basename(p) == "site-packages"]


# Refuses what an isolated build environment would not have: a module from site-packages that
# no build requirement (or a dependency of one) provides. The standard library, the project's own
# files and packages vendored inside an allowed one pass.
class IsolatedBuildEnvironment(importlib.abc.MetaPathFinder):

    def find_spec(self, name, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        origin = spec.origin if spec is not None else None
        for site in sites if origin else ():
            if origin.startswith(site + os.sep):
                top = origin[len(site) + 1 :].split(os.sep)[0].split(".")[0]
                if top in allowed:
                    return None
                # Not installed there; a copy vendored by an allowed package (setuptools puts
                # its _vendor directory on sys.path) is what the build would import instead.
                elsewhere = [p for p in sys.path if p not in sites]
                vendored = importlib.machinery.PathFinder.find_spec(name, elsewhere)
                if path is None and vendored is not None:
                    return vendored
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


# Nor would it hold the other distributions' metadata: an entry point that one of them
# registers (kernels, a dependency of transformers, adds an egg_info writer) must not load.
import importlib.metadata

providers = importlib.metadata.packages_distributions()
allowed_dists = {d.lower().replace("_", "-") for m in allowed for d in providers.get(m, ())}
find_distributions = importlib.machinery.PathFinder.find_distributions


def isolated_distributions(context=importlib.metadata.DistributionFinder.Context()):
    for dist in find_distributions(context):
        where = str(getattr(dist, "_path", ""))
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in allowed_dists or not any(where.startswith(s + os.sep) for s in sites):
            yield dist


importlib.machinery.PathFinder.find_distributions = isolated_distributions
sys.meta_path.insert(0, IsolatedBuildEnvironment())
# setuptools (and the standard library modules it pulls in, some of which differ on macOS) load
# as on this machine; from here on setup.py, build_macos and torch see macOS.
import sysconfig

import setuptools
from setuptools import build_meta
from setuptools.command import build_ext  # reads the interpreter's build configuration

sysconfig.get_config_vars()  # this interpreter's, cached (there is no macOS one to read)
sys.platform = "darwin"
try:
    import torch
    # This Linux torch has no MPS; a Mac's has (STEEL_TEST_MPS_BUILT=0: a CPU-only Mac torch).
    built = sys.argv[3] == "1"
    torch.backends.mps.is_built = lambda: built
except ImportError:
    pass  # not a build requirement: setup.py will find out

original = setuptools.setup


def recording_setup(**kwargs):
    with open(record, "w") as f:
        json.dump([e.name for e in kwargs.get("ext_modules", [])], f)
    return original(**kwargs)


setuptools.setup = recording_setup

print(json.dumps(build_meta.get_requires_for_build_wheel()))
"""


def _import_names(requires: list[str], environment: dict) -> list[str]:
    """The top-level modules that an environment holding `requires` (and their dependencies,
    for `environment`) can import, as far as the installed distributions tell."""
    import importlib.metadata as metadata

    provides: dict[str, set[str]] = {}
    for module, dists in metadata.packages_distributions().items():
        for dist in dists:
            provides.setdefault(dist.lower().replace("_", "-"), set()).add(module)
    names, todo = set(), list(_names(requires, environment))
    while todo:
        name = todo.pop().replace("_", "-")
        if name in names:
            continue
        names.add(name)
        try:
            dependencies = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += _names(dependencies, {**environment, "extra": ""})
    return sorted({module for name in names for module in provides.get(name, ())})


def _darwin_build(tree: Path, tmp_path: Path, mps_built: bool) -> subprocess.CompletedProcess:
    """setup.py's darwin branch under the import restrictions of an isolated build of tree."""
    work = tmp_path / "tree"
    shutil.copytree(tree, work)  # egg_info writes into the tree
    allowed = _import_names(_build_requires(work), DARWIN)
    record = tmp_path / "ext_modules.json"
    command = [
        sys.executable,
        "-c",
        ISOLATED_DARWIN_BUILD,
        json.dumps(allowed),
        str(record),
        "1" if mps_built else "0",
    ]
    result = subprocess.run(
        command, cwd=work, env=_env(), capture_output=True, text=True, timeout=300
    )
    result.ext_modules = json.loads(record.read_text()) if record.exists() else None
    return result


@pytest.mark.parametrize("source", ["clone", "sdist"])
def test_the_darwin_build_finds_what_it_imports(source, request, tmp_path):
    """Before [build-system] listed torch for macOS, pip's isolated build failed on every Mac at
    "Getting requirements to build wheel": No module named 'torch'."""
    tree = request.getfixturevalue("clone" if source == "clone" else "unpacked_sdist")
    result = _darwin_build(tree, tmp_path, mps_built=True)
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.ext_modules == ["torch_steel._C_metal"]


def test_the_darwin_build_without_the_table_fails(clone, tmp_path):
    """The simulation has teeth: with pip's default build requirements (no [build-system]
    table, as before) the darwin branch fails as it did on a Mac."""
    tree = tmp_path / "old"
    shutil.copytree(clone, tree)
    text = (tree / "pyproject.toml").read_text()
    start = text.index("[build-system]")
    end = text.index("\n[", start + 1)
    (tree / "pyproject.toml").write_text(text[:start] + text[end + 1 :])
    result = _darwin_build(tree, tmp_path / "run", mps_built=True)
    assert result.returncode != 0
    assert "No module named 'torch'" in result.stderr


def test_the_darwin_build_with_a_torch_without_mps_installs_without_the_extension(clone, tmp_path):
    result = _darwin_build(clone, tmp_path, mps_built=False)
    assert result.returncode == 0, result.stderr[-5000:]
    assert result.ext_modules == []
    assert "built without MPS" in result.stderr


# ---- the sdist, and real isolated installs on this platform ------------------------------------


def test_the_sdist_carries_the_native_sources(clone, sdist):
    """Before MANIFEST.in, the sdist had no shaders/ or mps_src/, and a wheel built from it
    failed at the copy of shaders/ on every platform."""
    with tarfile.open(sdist) as archive:
        members = {m.name.split("/", 1)[1] for m in archive.getmembers() if "/" in m.name}
    wanted = [
        name
        for name in _tracked_files()
        if name.split("/")[0] in ("shaders", "mps_src", "torch_steel", "tests", "bench", "docs")
        or name in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in")
    ]
    missing = [name for name in wanted if name not in members]
    assert not missing
    assert "mps_src/mps/module.mm" in members and "mps_src/mps/check/apple_sdk_subset.h" in members
    assert not [m for m in members if "__pycache__" in m or m.endswith((".so", ".pyc"))]


def _pip_install_isolated(what: Path, target: Path) -> None:
    """`pip install .` in pip's build isolation, into a directory instead of the environment."""
    _run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(what)],
        cwd=target.parent,
    )


def _check_installed(target: Path) -> None:
    native = target / "torch_steel" / "_native_src"
    for rel in ("shaders/steel/gemm/gemm.metal", "mps_src/plan/plan.cpp", "mps_src/sim/sim.h"):
        assert (native / rel).is_file(), rel
    script = (
        "import torch_steel, torch_steel.sim.build as b; "
        "print(torch_steel.__file__); print(b.IN_CHECKOUT); print(b.ROOT)"
    )
    out = _run(
        [sys.executable, "-c", script], cwd=target.parent, env=_env(PYTHONPATH=str(target))
    ).stdout.splitlines()
    assert out[0] == str(target / "torch_steel" / "__init__.py")
    assert out[1:] == ["False", str(native)]


@pytest.mark.skipif(
    sys.platform == "darwin",
    reason="on macOS this compiles the extension (minutes); .github/workflows/macos.yml installs "
    "from the checkout and from the sdist itself",
)
@pytest.mark.parametrize("source", ["clone", "sdist"])
def test_pip_install_in_an_isolated_build(source, request, tmp_path):
    what = request.getfixturevalue(source)
    target = tmp_path / "site"
    target.mkdir()
    _pip_install_isolated(what, target)
    _check_installed(target)

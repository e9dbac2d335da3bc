"""Other projects' production Metal, fetched as published, for the simulator's corpus tests.

Each corpus is a pinned release (version and the archive's sha256) of a package whose
distribution ships Metal source: MLX's kernel headers in the mlx-metal wheel for macOS, and
llama.cpp's Metal kernels in the llama-cpp-python source distribution. `include_dir(corpus)`
downloads the archive with pip (`pip download --no-deps`, the platform and format pinned),
checks its hash, unpacks the Metal sources only under the simulator's cache
(<cache>/corpora/<name>/<version>/), and returns that directory; later calls find it there.
Nothing of theirs is in this repository: the tests include the files from the cache.

Offline, or when pip or the hash fails, it raises CorpusUnavailable with the reason, which the
tests turn into a skip.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from torch_steel.sim import build


class CorpusUnavailable(RuntimeError):
    """The corpus could not be fetched (offline, pip failed, or the archive's hash differs)."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    name: str
    requirement: str  # pip's form, version pinned
    archive: str  # the file pip downloads
    sha256: str  # of that file
    pip_args: tuple[str, ...]  # the platform / format that archive is
    prefix: str  # the archive's directory whose Metal sources are kept
    suffixes: tuple[str, ...] = (".h", ".metal")

    @property
    def version(self) -> str:
        return self.requirement.split("==", 1)[1]


MLX = Corpus(
    name="mlx",
    requirement="mlx-metal==0.32.4",
    archive="mlx_metal-0.32.4-py3-none-macosx_14_0_arm64.whl",
    sha256="8019b2db622599267d66cc168b2f0dbf5af929790a6c3b3913e00eabc42a7947",
    pip_args=("--only-binary=:all:", "--platform", "macosx_14_0_arm64"),
    prefix="mlx/include/",
)

LLAMA = Corpus(
    name="llama",
    requirement="llama-cpp-python==0.3.36",
    archive="llama_cpp_python-0.3.36.tar.gz",
    sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    pip_args=("--no-binary=:all:",),
    prefix="llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/",
)

_PIP_TIMEOUT_S = 600


def include_dir(corpus: Corpus) -> Path:
    """The directory holding the corpus's Metal sources, under the archive's own paths less
    `corpus.prefix` (fetched on first use; see the module docstring)."""
    root = build.cache_root() / "corpora" / corpus.name / corpus.version
    stamp = root / ".sha256"
    if stamp.is_file() and stamp.read_text().strip() == corpus.sha256:
        return root / "src"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest -n 2: one worker fetches, the other waits
        if stamp.is_file() and stamp.read_text().strip() == corpus.sha256:
            return root / "src"
        data = _download(corpus)
        src = root / "src"
        shutil.rmtree(src, ignore_errors=True)
        _unpack(corpus, data, src)
        stamp.write_text(corpus.sha256 + "\n")
    return src


def _download(corpus: Corpus) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        cmd += [*corpus.pip_args, "-d", tmp, corpus.requirement]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CorpusUnavailable(f"{corpus.requirement}: pip download failed: {e}") from e
        path = Path(tmp) / corpus.archive
        if done.returncode != 0 or not path.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise CorpusUnavailable(
                f"{corpus.requirement}: pip download failed (offline?): {' / '.join(tail)}"
            )
        data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != corpus.sha256:
        raise CorpusUnavailable(
            f"{corpus.archive}: sha256 {digest}, expected {corpus.sha256} (not the pinned release)"
        )
    return data


def _unpack(corpus: Corpus, data: bytes, dest: Path) -> None:
    """The archive's Metal sources under corpus.prefix, written below dest (paths checked to
    stay inside it)."""
    members: list[tuple[str, bytes]] = []
    if corpus.archive.endswith(".whl"):
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for name in z.namelist():
                if name.startswith(corpus.prefix) and name.endswith(corpus.suffixes):
                    members.append((name[len(corpus.prefix) :], z.read(name)))
    else:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as t:
            for m in t.getmembers():
                if (
                    m.isfile()
                    and m.name.startswith(corpus.prefix)
                    and m.name.endswith(corpus.suffixes)
                ):
                    members.append((m.name[len(corpus.prefix) :], t.extractfile(m).read()))
    if not members:
        raise CorpusUnavailable(f"{corpus.archive}: no Metal sources under {corpus.prefix}")
    base = dest.resolve()
    for rel, content in members:
        target = (dest / rel).resolve()
        if base not in target.parents:
            raise CorpusUnavailable(f"{corpus.archive}: member {rel!r} leaves the cache")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)

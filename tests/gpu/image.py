"""The GPU machine's python, emulated here: a pytest plugin (`-p tests.gpu.image`, which
`scripts/gpu_check.sh --quick --dry-run` loads) after which this process sees no installed
distribution but the image's and the wheels --quick carries, so that an import the GPU machine
cannot satisfy fails on this machine, at collection, and not in a short GPU window.

The image: IMAGE and every distribution they require (as this environment's metadata says). The
carried wheels: tests/gpu/quick_wheels.txt. Each site-packages folder on sys.path is replaced by a
folder of links to its entries, less those that only other distributions own: a hidden module is
absent as on the GPU machine (find_spec finds nothing; importlib.metadata knows no version), so
optional imports (transformers probing for accelerate) take the branch they take there. Only this
process is covered, not the processes a test starts; on CPU the dry run starts none (every case it
selects is skipped for want of CUDA). An editable install of kvbridge is hidden too: there, the
package is the tree linked by scripts/gpu_check.sh --quick."""

from __future__ import annotations

import atexit
import importlib
import importlib.metadata
import os
import re
import shutil
import site
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from packaging.requirements import Requirement

IMAGE = ("torch", "grpcio", "protobuf", "pytest", "transformers")  # what the GPU machine's python holds
WHEELS = Path(__file__).with_name("quick_wheels.txt")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(names) -> set[str]:
    """The installed distributions `names` and what they require, recursively (no extras), by
    canonical name; a requirement not installed here is left out."""
    seen, todo = set(), list(names)
    while todo:
        name = canonical(todo.pop())
        if name in seen:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def carried() -> set[str]:
    """The distributions tests/gpu/quick_wheels.txt names, by canonical name."""
    lines = (line.split("#")[0].strip() for line in WHEELS.read_text().splitlines())
    return {canonical(Requirement(line).name) for line in lines if line}


def link_what_is_kept(folder: Path, keep: set[str], into: Path) -> list[str]:
    """Links into `into` every entry of the site-packages `folder` but those owned by distributions
    outside `keep` alone (an entry no distribution owns, such as a .pth file, is linked); returns the
    entries left out."""
    owners = defaultdict(set)  # top-level entry -> the distributions with files under it
    for dist in importlib.metadata.distributions(path=[str(folder)]):
        name = canonical(dist.metadata["Name"])
        for line in (dist.read_text("RECORD") or "").splitlines():  # (dist.files: 100x slower)
            owners[line.split("/", 1)[0].split(",", 1)[0]].add(name)
    left_out = []
    for entry in sorted(folder.iterdir()):
        if entry.name in owners and not owners[entry.name] & keep:
            left_out.append(entry.name)
        else:
            (into / entry.name).symlink_to(entry)
    return left_out


def emulate_the_image() -> None:
    keep = requirement_closure(IMAGE) | carried()
    shadows = {}
    for folder in map(os.path.realpath, site.getsitepackages()):
        if folder in map(os.path.realpath, sys.path):
            shadows[folder] = Path(tempfile.mkdtemp(prefix="gpu_image_"))
            atexit.register(shutil.rmtree, shadows[folder], True)
            link_what_is_kept(Path(folder), keep, shadows[folder])
    sys.path[:] = [str(shadows.get(os.path.realpath(p), p)) for p in sys.path]
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
    sys.path[:] = [p for p in sys.path if not p.startswith("__editable__")]  # (its path hook's entry)
    importlib.invalidate_caches()


def pytest_load_initial_conftests(early_config, parser, args):
    """Before any conftest (tests/conftest.py imports the engine) or test module is imported."""
    emulate_the_image()

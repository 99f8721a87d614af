"""A clean virtualenv seeded with exactly a project's runtime dependencies, linked from this environment.

``link_dependencies(site_packages, "tollgate")`` walks the project's ``Requires-Dist`` (extras of each
requirement followed, the project's own extras not) and hard-links every file of those distributions,
dist-info included, into ``site_packages``. pip then sees them installed: ``pip install .`` there resolves
the project's requirements against them without reading a package index, and a runtime dependency the
project forgot to declare is missing there as it would be in the image. (Resolving the same ~100
distributions from an index again took ~65 s of pip's CPU here, most of it reading index pages.)
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import shutil
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def dependency_closure(project: str) -> list[metadata.Distribution]:
    """The installed distributions ``project`` needs at run time (markers evaluated here)."""
    found: dict[str, metadata.Distribution] = {}
    pending: list[tuple[str, frozenset[str]]] = [(project, frozenset())]
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        name, extras = pending.pop()
        key = (canonicalize_name(name), extras)
        if key in seen:
            continue
        seen.add(key)
        dist = metadata.distribution(name)
        if key[0] != canonicalize_name(project):
            found[key[0]] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = req.marker is None or any(req.marker.evaluate({"extra": extra})
                                               for extra in extras | {""})  # fmt: skip
            if wanted:
                pending.append((req.name, frozenset(req.extras)))
    return sorted(found.values(), key=lambda d: canonicalize_name(d.metadata["Name"]))


def link_dependencies(site_packages: Path, project: str) -> list[str]:
    """Hard-link (copy across file systems) ``project``'s runtime dependencies into ``site_packages``;
    returns their names. Files a distribution installs outside site-packages (scripts) are left out."""
    names = []
    for dist in dependency_closure(project):
        names.append(dist.metadata["Name"])
        for file in dist.files or []:
            if file.parts and file.parts[0] == "..":
                continue
            source, target = Path(dist.locate_file(file)), site_packages / file
            if not source.is_file():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)
            except FileExistsError:
                pass
            except OSError:
                shutil.copy2(source, target)
    return names

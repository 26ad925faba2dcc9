"""Where the package finds its manifest and kernel sources.

A source checkout or editable install reads kernels.yaml from the project root (one directory
above this package). A wheel carries a copy under registry/_manifest/ (setup.py puts it there)."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROJECT_ROOT = PACKAGE_DIR.parent
PACKAGED_MANIFEST_DIR = PACKAGE_DIR / "_manifest"


def default_manifest_path() -> Path:
    checkout = PROJECT_ROOT / "kernels.yaml"
    if checkout.is_file():
        return checkout
    return PACKAGED_MANIFEST_DIR / "kernels.yaml"

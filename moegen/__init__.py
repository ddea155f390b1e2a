"""moegen: an ahead-of-time compiler for Mixture-of-Experts inference."""
from __future__ import annotations

__version__ = "0.1.0"


def load(path):
    """Import a generated package from its directory (e.g. generated/mixtral_8x7b) and return it."""
    from moegen.package.loader import load_package

    return load_package(path)

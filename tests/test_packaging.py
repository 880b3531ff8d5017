"""The package's metadata: an MIT LICENSE file beside pyproject.toml, declared as an SPDX
expression (the TOML-table form is deprecated by setuptools and warns on every build)."""

from __future__ import annotations

import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_license_is_mit_declared_without_deprecation_warnings(monkeypatch):
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), "pyproject.toml")
    assert not [w for w in caught if "license" in str(w.message).lower()], [str(w.message)[:200] for w in caught]
    assert dist.metadata.license_expression == "MIT" and "LICENSE" in dist.metadata.license_files
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")

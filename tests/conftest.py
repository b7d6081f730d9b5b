"""Test tiers by folder: each test is marked with the execution contract of its folder.

``pytest -m "not kafka and not browser"`` runs what needs no broker or browser;
tests/README.md lists the tiers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_TIERS = ("unit", "multiproc", "kafka", "browser", "gpu")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in _TIERS and tier != "unit":
            item.add_marker(getattr(pytest.mark, tier))

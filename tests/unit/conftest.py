"""Fixtures the dashboard tests share: the replayed demo store, and a private copy of it
that the app reads (``RANKSCOPE_DB``), its snapshot copies kept inside the test."""

from __future__ import annotations

import shutil

import pytest
from support.dashboard_store import shared_demo_store


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return shared_demo_store(tmp_path_factory)


@pytest.fixture
def app_db(built, tmp_path, monkeypatch):
    """A private copy of the replayed store (tests may write triage into it), set as the app's."""
    path = tmp_path / "store.duckdb"
    shutil.copy(built[0], path)
    monkeypatch.setenv("RANKSCOPE_DB", str(path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return path

"""rankscope's triage dashboard: a Streamlit app over the DuckDB findings store.

``dashboard.queries`` holds every query (plain parameterized SQL, callable
without Streamlit), ``dashboard.headline`` the first screen's sentences,
``dashboard.trace_data`` a rank's raw readings from its trace, ``dashboard.db``
how the app shares the file with a running ``serve``, ``dashboard.charts`` the
pictures, and ``dashboard/app.py`` the thin Streamlit layer started by
``rankscope dashboard``. Nothing else in rankscope imports this package.
"""

__all__ = ["charts", "charts_timeline", "config", "db", "evidence_tables", "headline", "links",
           "plain", "queries", "trace_data"]  # fmt: skip

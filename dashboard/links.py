"""Every page and selection in the URL, both ways.

A new session (a pasted link, a reload) takes its page and selections from
the query string once; after that each render writes the current ones back,
so the address bar follows navigation and a copied link opens what is on the
screen. ``?view=Finding&job=J&finding=ID`` is the link an alert carries.
"""

from __future__ import annotations

import streamlit as st

__all__ = ["URL_KEYS", "VIEW_KEYS", "seed_from_url", "write_url", "current_params"]

# query parameter -> session-state key
URL_KEYS = {
    "view": "view", "job": "job", "finding": "finding", "host": "host", "rank": "rank",
    "metric": "hm_metric", "steps": "hm_steps", "kind": "f_kind",
}  # fmt: skip
# the parameters each page keeps (besides view and job)
VIEW_KEYS = {
    "Jobs": (), "Findings": ("kind",), "Heatmap": ("metric", "steps"),
    "Finding": ("finding",), "Rank": ("rank",), "Host": ("host",), "Triage": ("finding",),
}  # fmt: skip


def _parse(param: str, raw: str):
    if param == "rank":
        return int(raw) if raw.lstrip("-").isdigit() else None
    if param == "steps":
        lo, _, hi = raw.partition("-")
        return (int(lo), int(hi)) if lo.isdigit() and hi.isdigit() else None
    if param == "kind":
        return [k for k in raw.split(",") if k]
    return raw


def _format(param: str, value) -> str | None:
    if value is None or value == [] or value == "":
        return None
    if param == "steps":
        return f"{int(value[0])}-{int(value[1])}"
    if param == "kind":
        return ",".join(map(str, value))
    return str(value)


def seed_from_url(views) -> None:
    """Once per session: the page and selections a link names (unknown values are dropped)."""
    if st.session_state.get("_seeded"):
        return
    st.session_state["_seeded"] = True
    qp = st.query_params
    for param, key in URL_KEYS.items():
        raw = qp.get(param)
        if not raw or key in st.session_state:
            continue
        if param == "view" and raw not in views:
            continue
        value = _parse(param, raw)
        if value is not None:
            st.session_state[key] = value


def current_params() -> dict[str, str]:
    """The query string the current page and selections make."""
    view = st.session_state.get("view") or "Jobs"
    out = {"view": view}
    for param in ("job", *VIEW_KEYS.get(view, ())):
        text = _format(param, st.session_state.get(URL_KEYS[param]))
        if text is not None:
            out[param] = text
    return out


def write_url(views) -> None:
    """Put the current page and selections in the address bar (only when they changed)."""
    want = current_params()
    if want.get("view") not in views:
        return
    if {k: st.query_params.get(k) for k in st.query_params} != want:
        st.query_params.from_dict(want)

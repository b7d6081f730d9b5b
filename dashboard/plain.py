"""Telemetry names on the page as plain text, never as Markdown or HTML.

Job, host and detector names and evidence text come from the training job,
not from a person: a host named ``![x](http://evil/)`` must not make the
browser fetch a URL, and ``**`` or ``:red[...]`` must not restyle the page.
Streamlit's titles, captions and alerts all read Markdown, so anything
holding such a name goes through here: ``html.escape`` turns every character
HTML could act on into an entity and ``st.html`` (which never reads
Markdown) draws it. Widgets' labels stay constant text; names go in their
options (drawn as plain text) and in dataframes.
"""

from __future__ import annotations

import html
from urllib.parse import urlencode

import streamlit as st

__all__ = ["COLORS", "esc", "link", "title", "text", "banner", "page_url"]

# background, left border: red for evict, amber for recover, blue for observe, green for healthy
COLORS = {
    "error": ("#fde8e8", "#d62728"),
    "warning": ("#fff4e0", "#ff9900"),
    "info": ("#e8f1fd", "#1f77b4"),
    "ok": ("#e9f7ec", "#2ca02c"),
}


def esc(s) -> str:
    """Any value as HTML text: markup characters become entities."""
    return html.escape(str(s), quote=True)


def page_url(**params) -> str:
    """A relative link to a dashboard page and selection (``?view=Finding&job=...``)."""
    return "?" + urlencode({k: str(v) for k, v in params.items() if v is not None})


def link(label: str, **params) -> str:
    """An HTML link to a page of this dashboard, opened in the same tab."""
    return f'<a href="{esc(page_url(**params))}" target="_self">{esc(label)}</a>'


def title(s: str, level: int = 1) -> None:
    """A page title or header holding telemetry names."""
    level = min(max(level, 1), 3)
    st.html(f'<h{level} class="rs-title">{esc(s)}</h{level}>')


def text(s: str, *, muted: bool = False) -> None:
    """One line of plain text (muted: the look of a caption)."""
    style = ' style="color:#666;font-size:0.9em"' if muted else ""
    st.html(f'<p class="rs-text"{style}>{esc(s)}</p>')


def banner(level: str, lines: list[str], link_html: str = "") -> None:
    """A colored block: the first line bold, the others below it; ``link_html`` is trusted."""
    bg, edge = COLORS.get(level, COLORS["info"])
    body = "".join(
        f'<div style="{"font-weight:600;font-size:1.05em" if i == 0 else "margin-top:2px"}">'
        f"{esc(line)}</div>"
        for i, line in enumerate(lines) if line
    )  # fmt: skip
    more = f'<div style="margin-top:4px">{link_html}</div>' if link_html else ""
    st.html(
        f'<div class="rs-banner rs-{esc(level)}" style="background:{bg};border-left:6px solid '
        f'{edge};padding:8px 12px;border-radius:4px;margin:4px 0">{body}{more}</div>'
    )

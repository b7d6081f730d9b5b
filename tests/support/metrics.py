"""Scrape a real Prometheus endpoint over HTTP and index its samples."""

from __future__ import annotations

import urllib.request


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted label pairs): value}`` of one GET of ``url``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def by_label(samples: dict, name: str, label: str) -> dict[str, float]:
    """The samples of ``name`` keyed by one label's value."""
    return {dict(lab)[label]: v for (n, lab), v in samples.items() if n == name}

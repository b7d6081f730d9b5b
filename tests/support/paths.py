"""Where the tests find the repository and what it ships."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_TRACES = ROOT / "sample_traces"
DASHBOARD_APP = ROOT / "dashboard" / "app.py"

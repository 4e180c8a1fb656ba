"""Metric names in PromQL expressions, and the expressions of the deploy/observability
files (the Grafana dashboard, the alerting rules)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

OBSERVABILITY = Path(__file__).resolve().parents[2] / "deploy" / "observability"
DASHBOARD = OBSERVABILITY / "grafana" / "meshserve.json"
ALERTS = OBSERVABILITY / "alerts.yml"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless",
             "inf", "nan"}
_IDENT = re.compile(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are not functions or
    aggregations (followed by ``(``), keywords, label names (inside ``{}`` or a
    ``by (...)`` clause), strings, ranges or Grafana variables."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in _IDENT.finditer(e):
        word = m.group()
        if word.lower() in _KEYWORDS or e[m.end():].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def dashboard_exprs(path: Path = DASHBOARD) -> list[str]:
    """Every target expression of every panel of a Grafana dashboard JSON."""
    dashboard = json.loads(path.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def alert_exprs(path: Path = ALERTS) -> list[str]:
    """Every rule expression of a Prometheus rules file."""
    groups = yaml.safe_load(path.read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]

"""The dashboard's pure helpers: the levels drawn over an incident's evidence, charts in UTC, the API call."""

from __future__ import annotations

import pytest

from dashboard import common as c
from dashboard.pages import POOL_NOW, POOL_SERIES


@pytest.mark.parametrize(("kind", "evidence", "lines"), [
    # SLO burn's baseline and threshold are the error budget (0.01) and a burn rate (14.4): drawn as they were, a
    # 14.4 s line stretched a TTFT chart until a 0.9 s breach looked flat. Its objective is the level that counts.
    ("slo_burn", {"signal": "ttft_p95", "slo": 0.5, "baseline": 0.01, "threshold": 14.4}, [(0.5, "SLO")]),
    # A CUSUM height in sigmas is no yield: the allowed drop below the baseline is.
    ("spec_decode_collapse", {"baseline": 0.6, "threshold": 5.0, "min_drop": 0.18},
     [(0.6, "baseline"), (pytest.approx(0.42), "threshold (baseline − allowed drop)")]),
    ("ep_imbalance", {"baseline": 0.02, "threshold": 1.5},
     [(0.02, "baseline"), (pytest.approx(0.03), "threshold (baseline × allowed ratio)")]),
    ("prefix_cache_hit_drop", {"baseline": 0.8, "threshold": 0.2},
     [(0.8, "baseline"), (pytest.approx(0.6), "threshold (baseline − allowed drop)")]),
    ("kv_transfer_lag", {"baseline_p99": 0.01, "threshold_s": 0.03, "peers_median_p99": 0.012},
     [(0.01, "baseline"), (0.03, "threshold"), (0.012, "peers' median")]),
    ("saturation", {"baseline": 2.0, "threshold": 2.0}, [(2.0, "baseline")]),  # a growth rate on a queue's chart
])
def test_evidence_lines_are_drawn_in_the_signals_own_unit(kind: str, evidence: dict, lines: list) -> None:
    assert c.evidence_lines(kind, evidence) == lines


def test_every_time_axis_and_tooltip_is_in_utc_as_the_captions_are() -> None:
    import pandas as pd

    df = pd.DataFrame({"time": pd.to_datetime([0, 60], unit="s", utc=True), "mean": [1.0, 2.0], "min": [1.0, 2.0],
                       "max": [1.0, 2.0], "pool": ["a", "a"], "v": [1.0, 2.0]})
    band = c.band_chart(df, y_title="x", marks=pd.DataFrame({"time": df["time"], "label": ["m", "m"]})).to_dict()
    heat = c.heatmap(df, y="pool", value="v", title="v").to_dict()
    layers = [layer["encoding"] for layer in band["layer"] if "x" in layer.get("encoding", {})] + [heat["encoding"]]
    assert layers and all(e["x"]["scale"]["type"] == "utc" for e in layers)
    tips = [t for e in layers for t in e.get("tooltip", []) if t.get("type") == "temporal"]
    assert tips and all(t["timeUnit"].startswith("utc") for t in tips)


def test_the_cards_signals_are_read_with_the_series() -> None:
    assert set(POOL_NOW) <= set(POOL_SERIES)


def test_approving_with_a_token_from_a_file_never_shows_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # With its newline the request failed in the HTTP client, whose message quoted the header: the page showed it.
    monkeypatch.setenv("FLEETCTL_API_TOKEN", "s3cret-approval-token\n")
    monkeypatch.setenv("FLEETCTL_API_URL", "http://127.0.0.1:9")
    assert c.api_token() == "s3cret-approval-token"
    ok, message = c.api_decide(1, True, "alice")
    assert not ok and "did not answer" in message and "s3cret" not in message


@pytest.mark.parametrize(("headers", "expected"), [
    ({"X-Forwarded-Email": "alice@example.com"}, "alice@example.com"),
    ({"x-forwarded-email": " bob@example.com "}, "bob@example.com"),  # header names have no case
    ({"X-Forwarded-User": "alice"}, None),  # another header: not the proxy's
    ({"X-Forwarded-Email": "  "}, None),
    ({"X-Forwarded-Email": "eve\r\nX-Admin: 1"}, None),
    ({}, None),
])
def test_the_signed_in_user_is_the_proxys_header(headers: dict[str, str], expected: str | None) -> None:
    assert c.signed_in_user(headers, "X-Forwarded-Email") == expected

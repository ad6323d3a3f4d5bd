"""Operations dashboard entry: page navigation, the time range, auto-refresh and the store check.

Run with `fleetctl dashboard --db URL`. Reads the store only, through `controlplane.store.queries`;
approvals go to the control plane's HTTP API. Each page lives in `dashboard/views/`.
"""

from __future__ import annotations

import time

import streamlit as st

from controlplane.store.db import redact
from dashboard import common as c

st.set_page_config(page_title="fleet-controlplane", page_icon=":material/monitoring:", layout="wide")

PAGES = [
    st.Page(c.PAGE_FILES["fleet"], title="Fleet", icon=":material/dashboard:", url_path="fleet", default=True),
    st.Page(c.PAGE_FILES["pool"], title="Pool", icon=":material/stacks:", url_path="pool"),
    st.Page(c.PAGE_FILES["ep"], title="Expert parallelism", icon=":material/grid_view:", url_path="ep"),
    st.Page(c.PAGE_FILES["kv"], title="KV transfer", icon=":material/swap_horiz:", url_path="kv"),
    st.Page(c.PAGE_FILES["gpus"], title="GPUs", icon=":material/memory:", url_path="gpus"),
    st.Page(c.PAGE_FILES["incidents"], title="Incidents", icon=":material/warning:", url_path="incidents"),
    st.Page(c.PAGE_FILES["actions"], title="Actions", icon=":material/fact_check:", url_path="actions"),
    st.Page(c.PAGE_FILES["canary"], title="Canary gates", icon=":material/rule:", url_path="canary"),
]
page = st.navigation(PAGES)

latest = c.latest_ts()
url = c.store_url()

with st.sidebar:
    # A link may carry ?range= and ?end= (an incident's time); apply a new one once, then let the widget rule.
    wanted = st.query_params.get("range")
    if wanted in c.RANGES and st.session_state.get("_range_from_link") != wanted:
        st.session_state["range"] = wanted
        st.session_state["_range_from_link"] = wanted
    label = st.selectbox("Time range", list(c.RANGES), index=list(c.RANGES).index(c.DEFAULT_RANGE), key="range")
    pinned = st.query_params.get("end")
    try:
        pinned_at = float(pinned) if pinned else None
    except ValueError:
        pinned_at = None
    if pinned_at is not None and not 0 < pinned_at < time.time() + 86400 * 365:
        pinned_at = None  # a link's `end` that is no time this store could hold (inf, nan, 1e20): live
    live = pinned_at is None
    end = pinned_at if pinned_at is not None else latest if latest is not None else time.time()
    if live:
        st.caption(f"Live, up to the newest signal: {c.when(latest)} UTC" if latest else "Live")
    else:
        st.caption(f"Pinned to {c.when(end)} UTC")
        if st.button("Back to live", icon=":material/replay:"):
            del st.query_params["end"]
            st.rerun()
    refresh = st.toggle("Auto-refresh", value=True, key="auto_refresh", disabled=not live,
                        help="Reload the page when new signals arrive (checked every 15 s).")
    st.caption(f"Store: `{redact(url)}`")

st.session_state["window"] = c.Window(end - c.RANGES[label], end, label, live, latest)

if latest is None:
    st.info(f"The store {redact(url)} holds no signals yet: start the control plane (`fleetctl run --config FLEET.yaml`) "
            "or fill it with `fleetctl demo --db URL`. Pages show what the store has.")


@st.fragment(run_every=15)
def _watch(seen: float | None) -> None:
    """Rerun the whole app when the store has a newer signal than the one shown."""
    if c.latest_ts() != seen:
        st.rerun()


if live and refresh:
    with st.sidebar:
        _watch(latest)

page.run()

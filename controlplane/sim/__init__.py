"""The trace-driven fleet simulator: vLLM engines in prefill, decode or unified pools, replaying
real traces with vLLM V1's scheduling, prefix caches, KV handoffs over a modelled link, MoE with
EPLB and speculative decoding, on step times calibrated from measured profiles (`perf.py`).

Each engine serves vLLM's, dcgm-exporter's and (decode) NIXL's `/metrics` on loopback ports of
its own (`server.py`), so the control loop scrapes it as it would a real fleet; `scenario.py`
describes a run (trace, fleet, faults with ground truth), `run.py` replays one through the loop.
"""

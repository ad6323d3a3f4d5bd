"""A simulated disaggregated vLLM fleet that serves real vLLM `/metrics` on loopback ports.

This first cut models prefix caching, queueing and KV usage well enough for the loop to see a
routing fault and the effect of scaling; the calibrated, trace-driven simulator replaces it.
"""

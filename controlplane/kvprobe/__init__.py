"""Synthetic KV-data-path probe: a prefill-side NIXL agent WRITEs KV-block-sized buffers into a decode-side
agent's registered memory on a schedule, like a blackbox prober, and exports `fleet_kvprobe_*` metrics.

`agent` runs either side as a process, `probe` is the initiator, `metadata` the metadata exchange, `stats`
the pure arithmetic, `cli` the `fleetctl probe kv` entry.
"""

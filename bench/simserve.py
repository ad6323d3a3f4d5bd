"""A lightweight server of many simulated single-engine pods, for the scrape benchmark.

Runs in its own process so its CPU time is not charged to the control plane. Pods share a
few loopback ports (`/pods/<i>/metrics`); bodies come from a small set of simulated engines
that advance 15 s of fleet time on each `POST /advance`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from itertools import count

from catalog.fleet import Role
from controlplane.sim.exporters import render_vllm
from controlplane.sim.fleet import FleetSpec, PoolSpec, SimFleet, SystemPrompts
from controlplane.sim.traces import Request

__all__ = ["main"]


class Bodies:
    """Expositions of `distinct` engines, refreshed as fleet time advances."""

    def __init__(self, distinct: int) -> None:
        spec = FleetSpec(pools=(PoolSpec("bench", Role.UNIFIED, distinct),), system_prompts=SystemPrompts())
        # Steady traffic, 8 requests per second per engine, without end.
        traffic = (Request(i / (8.0 * distinct), 1500, 200) for i in count())
        self.fleet = SimFleet(spec, traffic, now=0.0)
        self.now = 0.0
        self.bodies: list[bytes] = []
        self.advance()

    def advance(self) -> None:
        self.now += 15.0
        self.fleet.advance_to(self.now)
        self.bodies = [render_vllm(m, self.fleet.spec.model) for m in self.fleet.members["bench"]]


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bodies: Bodies) -> None:
    try:
        while True:
            request = await reader.readuntil(b"\r\n\r\n")
            line = request.split(b"\r\n", 1)[0].decode()
            method, path, _ = line.split(" ", 2)
            if method == "POST" and path == "/advance":
                bodies.advance()
                body, status = b"ok", b"200 OK"
            elif path.startswith("/pods/"):
                pod = int(path.split("/")[2])
                body, status = bodies.bodies[pod % len(bodies.bodies)], b"200 OK"
            else:
                body, status = b"not found", b"404 Not Found"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _main(ports: int, distinct: int) -> None:
    bodies = Bodies(distinct)
    servers = [await asyncio.start_server(lambda r, w: _serve(r, w, bodies), "127.0.0.1", 0, backlog=4096)
               for _ in range(ports)]
    print(" ".join(str(s.sockets[0].getsockname()[1]) for s in servers), flush=True)
    await asyncio.Event().wait()


def main() -> None:
    """Serve until killed; prints the listening ports on one line."""
    args = argparse.ArgumentParser()
    args.add_argument("--ports", type=int, default=16)
    args.add_argument("--distinct", type=int, default=32)
    ns = args.parse_args()
    try:
        asyncio.run(_main(ns.ports, ns.distinct))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()

"""Fixtures the control-plane tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from controlplane.clock import VirtualClock
from controlplane.demo import demo_fleet
from controlplane.sim.fleet import SimFleet
from controlplane.sim.server import SimServer


@pytest.fixture
def sim() -> Iterator[tuple[SimFleet, SimServer, VirtualClock]]:
    """The demo's fleet served over loopback, on a virtual clock."""
    clock = VirtualClock()
    fleet = demo_fleet(now=clock.now())
    server = SimServer(fleet)
    server.sync()
    yield fleet, server, clock
    server.close()

"""Fixtures the control-plane tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import kmock
import pytest
from kubernetes import client

from controlplane.actuators.kubernetes import VERBS
from controlplane.clock import VirtualClock
from controlplane.demo import demo_fleet
from controlplane.lease import LEASE_VERBS
from controlplane.sim.fleet import SimFleet
from controlplane.sim.server import SimServer
from tests.controlplane.apiserver import ApiServer, rbac_of


@pytest.fixture
def sim() -> Iterator[tuple[SimFleet, SimServer, VirtualClock]]:
    """The demo's fleet served over loopback, on a virtual clock."""
    clock = VirtualClock()
    fleet = demo_fleet(now=clock.now())
    server = SimServer(fleet)
    server.sync()
    yield fleet, server, clock
    server.close()


@pytest.fixture
async def server() -> AsyncIterator[ApiServer]:
    """The Kubernetes API emulator over HTTP; a test fails if any body it got was invalid, or if the
    control plane made a call that its RBAC (the actuator's VERBS and the Lease's) does not grant."""
    async with ApiServer() as emulator, kmock.Server(emulator):
        yield emulator
        assert emulator.invalid == [], "bodies that the official schemas reject"
        calls = {rbac for request in emulator if (rbac := rbac_of(request)) is not None}
        assert calls - (VERBS | LEASE_VERBS) == set(), "calls the deploy base's RBAC does not grant"


@pytest.fixture
def api(server: ApiServer) -> Iterator[client.ApiClient]:
    """The official client, unchanged, pointed at the emulator."""
    cfg = client.Configuration(host=str(server.url).rstrip("/"))
    cfg.retries = 0
    with client.ApiClient(cfg) as api_client:
        yield api_client

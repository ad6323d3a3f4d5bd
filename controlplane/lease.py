"""Leadership through a `coordination.k8s.io` Lease: of several control-plane replicas only the leader
runs the loop, and a follower takes over when the leader stops renewing (see `leadership`).

Owns the one Lease named in `kubernetes.leader_election`: reading it, taking it, renewing it and
releasing it on a clean stop. It must not act on the fleet or decide anything; the loop asks
`leading()` before every change it makes.

The rules are client-go's: a candidate takes the Lease when it has no holder, or when the holder's
record has not changed for `lease_duration` as this replica observed it (its own clock: the
holder's timestamps are never compared with ours, so clock skew cannot hand the Lease over early).
The leader renews every `retry_period` and counts itself leader only while its last renewal is
younger than `renew_deadline` (shorter than the lease duration), so it stops acting before anyone
else may start. Every write carries the resourceVersion it read (a release, the one its last
renewal left): of two candidates one wins and the other gets a 409, and a release held up in flight
cannot free the Lease of the replica that took it meanwhile. Each time this replica comes to lead
is a new `term`; the loop takes over again in a new one, since another replica may have led and
acted in between.

Least privilege: `get`, `create` and `patch` on `leases` in its own namespace.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import math
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import urllib3.exceptions
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from controlplane.config import LeaderElection
from controlplane.kube import api_message

__all__ = ["LEASE_VERBS", "LeaseLeadership", "identity"]

log = logging.getLogger(__name__)

LEASE_VERBS = frozenset({("coordination.k8s.io", "leases", verb) for verb in ("get", "create", "patch")})


def identity() -> str:
    """This replica's name in the Lease: its pod's host name and a per-process suffix."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _micro_time(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _whole(seconds: float) -> int:
    """A Lease holds whole seconds: rounded up, so a follower never waits less than the leader counts on."""
    return math.ceil(seconds)


class LeaseLeadership:
    """Leadership held through a Lease in the cluster."""

    def __init__(self, api: k8s.ApiClient, settings: LeaderElection, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, name: str | None = None, timeout: float = 5.0) -> None:
        self.settings = settings
        self.identity = name or identity()
        self.retry_period = settings.retry_period
        self.clock = clock  # measures the holder's silence and our renewals: monotonic, never compared across replicas
        self.wall = wall  # the timestamps written for people and kubectl
        self._api = k8s.CoordinationV1Api(api)
        self._timeout = (timeout, timeout)
        self._renewed: float | None = None  # our last successful write of the Lease, on our clock
        self._observed: tuple[Any, ...] | None = None  # the holder's record as we last read it
        self._observed_at = 0.0  # when that record last changed, on our clock
        self._observed_for = settings.lease_duration  # the lease duration that record gave its holder
        self._version: str | None = None  # the Lease's resourceVersion as our last write left it
        self.term = 0  # raised each time this replica comes to lead (not leading the moment before)

    def leading(self) -> bool:
        return self._renewed is not None and self.clock() - self._renewed < self.settings.renew_deadline

    async def contend(self) -> bool:
        s = self.settings
        now = self.clock()
        was = self.leading()
        try:
            lease = await self._call(self._api.read_namespaced_lease, s.name, s.namespace)
        except ApiException as exc:
            if exc.status != 404:
                return self._failed("reading", exc)
            return await self._gone(now, was)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            return self._failed("reading", exc)
        # A change is dated when its read returned, not when it was sent: a renewal that landed during a slow read
        # would otherwise look older than it is, and the holder's lease expire early in our eyes.
        seen = self.clock()
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, lease["metadata"].get("resourceVersion"))  # every renewal writes a new version
        duration = float(spec.get("leaseDurationSeconds") or s.lease_duration)
        if record != self._observed:
            self._observed, self._observed_at = record, seen
        self._observed_for = duration
        if holder and holder != self.identity and seen < self._observed_at + duration:
            if self._renewed is not None:
                log.warning("lost leadership to %s", holder)
            self._renewed = None
            return False
        body: dict[str, Any] = {
            "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
            "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": _whole(s.lease_duration),
                     "renewTime": _micro_time(self.wall())},
        }
        if holder != self.identity:
            body["spec"] |= {"acquireTime": _micro_time(self.wall()),
                             "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (1 if holder else 0)}
        try:
            written = await self._call(self._api.patch_namespaced_lease, s.name, s.namespace, body)
        except ApiException as exc:
            if exc.status == 409:  # another candidate wrote first; it leads
                self._renewed = None
                return False
            return self._failed("renewing" if holder == self.identity else "taking", exc)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            return self._failed("renewing" if holder == self.identity else "taking", exc)
        if holder != self.identity:
            log.info("leading as %s (took the lease from %s)", self.identity, holder or "nobody")
        return self._lead(now, written, was)

    def _lead(self, now: float, written: dict[str, Any], was: bool) -> bool:
        """Count a write of the Lease as ours: a new term unless this replica led the moment before it (a lapse in
        between may have let another lead and act meanwhile, as a take-over from nobody may follow one)."""
        self._version = (written.get("metadata") or {}).get("resourceVersion")
        self._renewed = now
        if not was:
            self.term += 1
        return True

    async def _gone(self, now: float, was: bool) -> bool:
        """The Lease is not there (never created, or deleted: by hand, a prune). Its leader steps down before it
        creates one again, and a candidate that saw another holder waits out that holder's lease first: that one
        may still act until it reads the Lease gone, or its renew deadline passes."""
        if self._renewed is not None:
            log.warning("the lease %s/%s is gone: leading only if it can be created again", self.settings.namespace,
                        self.settings.name)
            self._renewed = None
        holder = self._observed[0] if self._observed is not None else ""
        if holder and holder != self.identity and self.clock() < self._observed_at + self._observed_for:
            return False
        return await self._create(now, was)

    async def _create(self, now: float, was: bool) -> bool:
        s = self.settings
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": s.name, "namespace": s.namespace},
                "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": _whole(s.lease_duration),
                         "acquireTime": _micro_time(self.wall()), "renewTime": _micro_time(self.wall()), "leaseTransitions": 0}}
        try:
            written = await self._call(self._api.create_namespaced_lease, s.namespace, body)
        except ApiException as exc:
            if exc.status == 409:  # created by another candidate just now: it leads
                self._renewed = None
                return False
            return self._failed("creating", exc)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            return self._failed("creating", exc)
        log.info("leading as %s (created the lease)", self.identity)
        return self._lead(now, written, False)  # the Lease was gone: whoever led before may have acted since

    async def release(self) -> None:
        if not self.leading():
            return
        s = self.settings
        # On the version our last write left: a release held up in flight past our lease must not clear the holder
        # that took the Lease meanwhile.
        body = {"metadata": {"resourceVersion": self._version},
                "spec": {"holderIdentity": None, "renewTime": _micro_time(self.wall())}}
        self._renewed = None
        for attempt in (1, 2):
            try:
                await self._call(self._api.patch_namespaced_lease, s.name, s.namespace, body)
                return
            except ApiException as exc:
                if exc.status != 409:
                    log.warning("could not release the lease %s/%s: %s", s.namespace, s.name, api_message(exc))
                    return
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                log.warning("could not release the lease %s/%s: %s", s.namespace, s.name, exc)
                return
            # Changed since our last write: by a renewal of ours whose answer was lost (a timeout), the Lease still
            # ours, or by another replica. Read again: still ours, it is released on the version read (which the
            # write is conditional on); another's, it is left alone.
            try:
                current = await self._call(self._api.read_namespaced_lease, s.name, s.namespace)
            except (ApiException, urllib3.exceptions.HTTPError, OSError) as exc:
                log.warning("could not read the lease %s/%s again to release it: %s", s.namespace, s.name, exc)
                return
            if attempt == 2 or (current.get("spec") or {}).get("holderIdentity") != self.identity:
                log.info("the lease %s/%s changed since our last renewal: not released", s.namespace, s.name)
                return
            body["metadata"]["resourceVersion"] = (current.get("metadata") or {}).get("resourceVersion")

    async def _call(self, fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
        raw = await asyncio.to_thread(fn, *args, _request_timeout=self._timeout, _preload_content=False)
        return dict(json.loads(raw.data))

    def _failed(self, doing: str, exc: BaseException) -> bool:
        s = self.settings
        what = api_message(exc) if isinstance(exc, ApiException) else f"{type(exc).__name__}: {exc}"
        log.warning("%s the lease %s/%s failed: %s", doing, s.namespace, s.name, what)
        if self._renewed is not None and not self.leading():
            log.warning("could not renew within %gs: stepping down", s.renew_deadline)
            self._renewed = None
        return self.leading()

"""The synthetic mesh's workers: who can take work, how loaded they are, role changes."""

from __future__ import annotations

from services.contract.events import RoleChanged, WorkerStatus
from services.contract.types import WorkerRole as Role
from ui.demo_model import SyntheticConfig, Worker


class WorkerPool:
    """Every worker of both clusters, by name; role changes drain first (paper 3.4.3)."""

    def __init__(self, config: SyntheticConfig) -> None:
        specs: list[tuple[str, Role, int]] = [
            ("prfaas", "prefill", config.prfaas_prefill),
            ("pd", "prefill", config.pd_prefill),
            ("pd", "decode", config.pd_decode),
        ]
        self.workers = {
            f"{cluster}-{role}-{i}": Worker(f"{cluster}-{role}-{i}", cluster, role)
            for cluster, role, n in specs
            for i in range(n)
        }

    def pick(self, cluster: str | None, role: Role, prefer: Worker | None = None) -> Worker | None:
        """Least-loaded worker of `role` (in `cluster` if given); `prefer` when it qualifies."""
        if prefer is not None and prefer.role == role:
            return prefer
        choices = [
            w
            for w in self.workers.values()
            if w.role == role and (cluster is None or w.cluster == cluster)
        ]
        return min(choices, key=lambda w: (w.load, w.name), default=None)

    def queue_depth(self, cluster: str) -> int:
        """Prefill jobs queued or running in `cluster`."""
        return sum(
            w.load for w in self.workers.values() if w.cluster == cluster and w.role != "decode"
        )

    def set_role(
        self, worker: Worker, role: Role | None, reason: str, now: float
    ) -> list[RoleChanged]:
        """Drains `worker`; once idle it takes `role` (None: it stays drained)."""
        events = []
        worker.converting_to = role
        if worker.role != "draining":
            old, worker.role = worker.role, "draining"
            events.append(_changed(now, worker, old, reason))
        return events + self.finish_conversion(worker, now)

    def finish_conversion(self, worker: Worker, now: float) -> list[RoleChanged]:
        """Switches a drained, idle worker to its new role."""
        new = worker.converting_to
        if worker.role != "draining" or new is None or worker.load:
            return []
        worker.role, worker.converting_to = new, None
        return [_changed(now, worker, "draining", f"drained, now {new}")]

    def statuses(self, now: float) -> list[WorkerStatus]:
        return [
            WorkerStatus(
                ts=now,
                source=w.name,
                worker=w.name,
                cluster=w.cluster,
                role=w.role,
                queue_depth=len(w.queue),
                running=w.running,
                busy=w.running > 0,
                cached_blocks=w.cached_blocks,
            )
            for w in self.workers.values()
        ]

    def check_integrity(self) -> None:
        for w in self.workers.values():
            assert w.running >= 0 and (w.role == "decode" or w.running <= 1), w
            assert w.converting_to is None or w.role == "draining", w


def _changed(now: float, worker: Worker, old: Role, reason: str) -> RoleChanged:
    return RoleChanged(
        ts=now, source="router", worker=worker.name, old=old, new=worker.role, reason=reason
    )

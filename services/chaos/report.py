"""docs/reliability.md: one table per scenario and the acceptance verdict of each.

Acceptance (the reliability issues): 0 hung and 0 lost; in the fault scenarios (a worker
killed or frozen, the cache directory restarted, the link down, trickling or partitioned) 0
explicit errors too: a request whose worker or KV stream breaks, or whose worker hangs, is
migrated (services/router/runner.py); no service deaths beyond the ones the scenario
causes; every killed service back and serving within 10 s, every frozen one within 10 s of
its waking; every service's RSS after the scenario within 20% of its RSS at the scenario's start
(after a warm-up load); at 10x the admission limit every request answered (200 or 429)
within 5 s of its admission decision.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from services.chaos.scenarios import ScenarioResult

RECOVER_GOAL_S = 10.0
RSS_TOLERANCE = 0.20
ADMISSION_GOAL_S = 5.0
MIB = 1024 * 1024


def is_fault(name: str) -> bool:
    """A scenario that breaks a part of the mesh, which clients must not see (no errors)."""
    return name.startswith(("kill-", "freeze-")) or name in (
        "cachedir-restart", "link-down", "link-trickle", "partition")


class Verdict(msgspec.Struct, frozen=True):
    passed: bool
    failures: tuple[str, ...]


def verdict(result: ScenarioResult) -> Verdict:
    failures: list[str] = []
    for outcome in ("hung", "lost", *(("error",) if is_fault(result.name) else ())):
        if result.outcomes.get(outcome, 0):
            failures.append(f"{result.outcomes[outcome]} {outcome}")
    unexpected = {n: d for n, d in result.deaths.items() if n not in result.killed}
    expected_extra = {n: d - 1 for n, d in result.deaths.items() if n in result.killed and d > 1}
    if unexpected or expected_extra:
        failures.append(f"unexpected deaths {unexpected or expected_extra}")
    held = result.killed or result.frozen
    if result.recover_s is None or (held and result.recover_s > RECOVER_GOAL_S):
        failures.append(f"not back and serving within {RECOVER_GOAL_S:.0f} s "
                        f"({_seconds(result.recover_s)})")
    grown = rss_outside(result)
    if grown:
        failures.append(f"RSS grew more than 20% over its start: {', '.join(grown)}")
    if result.name == "overload-10x":
        bad = {s: c for s, c in result.statuses.items() if s not in ("200", "429")}
        if bad:
            failures.append(f"answers other than 200/429: {bad}")
        slow = result.max_after_admission_s
        if slow is None or slow > ADMISSION_GOAL_S:
            failures.append(f"slowest answer {_seconds(slow)} after its admission decision")
    return Verdict(not failures, tuple(failures))


def rss_outside(result: ScenarioResult) -> list[str]:
    out = []
    for name, start in result.rss_start.items():
        after = result.rss_after.get(name, 0)
        # Growth is what leaks look like; a killed service comes back smaller (cold).
        if start and after - start > RSS_TOLERANCE * start:
            out.append(f"{name} {start / MIB:.0f}->{after / MIB:.0f} MiB")
    return out


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def scenario_section(result: ScenarioResult) -> str:
    v = verdict(result)
    o = result.outcomes
    lines = [
        f"### {result.name}: {'PASS' if v.passed else 'FAIL'}", "",
        f"{result.description}. {' '.join(result.notes)}", "",
        "| requests sent | completed | explicit errors | hung | lost | service deaths "
        "(caused / other) | time to recover |",
        "|---|---|---|---|---|---|---|",
        f"| {result.sent} | {o.get('completed', 0)} | {o.get('error', 0)} | "
        f"{o.get('hung', 0)} | {o.get('lost', 0)} | {_deaths(result)} | "
        f"{_seconds(result.recover_s)} |", "",
        "| service | RSS at start (MiB) | peak RSS (MiB) | RSS after (MiB) |",
        "|---|---|---|---|",
    ]
    for name in result.rss_start:
        lines.append(f"| {name} | {result.rss_start[name] / MIB:.0f} | "
                     f"{result.rss_peak.get(name, 0) / MIB:.0f} | "
                     f"{result.rss_after.get(name, 0) / MIB:.0f} |")
    statuses = ", ".join(f"{s}: {c}" for s, c in sorted(result.statuses.items()))
    lines += ["", f"HTTP statuses: {statuses or 'none'}."]
    if result.migrations:
        lines.append(f"Migrated: {_migrations(result)}.")
    refused = result.statuses.get("429", 0)
    if is_fault(result.name) and refused and refused == result.outcomes.get("error", 0):
        lines.append(f"Every explicit error here is an admission refusal (429: the "
                     f"{'requests' if refused > 1 else 'request'} found the router's limit "
                     "full, the mesh answering slower than the load arrived), none a "
                     "request that broke.")
    if result.error_samples and is_fault(result.name):
        lines.append("Errors (first distinct): " + " | ".join(
            f"`{sample[:160]}`" for sample in result.error_samples) + ".")
    if result.max_after_admission_s is not None:
        lines.append(f"Slowest answer after its admission decision: "
                     f"{result.max_after_admission_s:.2f} s.")
    if v.failures:
        lines.append(f"Fails: {'; '.join(v.failures)}.")
    return "\n".join(lines) + "\n"


def migration_cost(results: Sequence[ScenarioResult]) -> list[str]:
    """What migration cost over the run: the requests moved and the mean time from a break
    (as the router saw it) to the continued request's next token."""
    moved = {r.name: sum(r.migrations.values()) for r in results if r.migrations}
    if not moved:
        return []
    timed = [(moved[r.name], r.resume_s) for r in results
             if r.name in moved and r.resume_s is not None]
    total = sum(n for n, _ in timed)
    mean = sum(n * s for n, s in timed) / total if total else None
    return ["## What migration costs", "",
            f"The router migrated {sum(moved.values())} requests over the run "
            f"({', '.join(f'{name} {n}' for name, n in moved.items())}). A migrated request "
            "waits from the moment the router sees its break until the continued attempt "
            "streams its next token: the re-placement, a queue, and the prefill of its prompt "
            "plus the tokens it had streamed (from any cache still holding them). That wait "
            f"averaged {_seconds(mean)} here (weighted by requests), which is what migration "
            "adds to a request's latency, on top of noticing the break: at once for a killed "
            "worker (its connection resets), up to the stall bound (kv_stall_s) for KV stuck "
            "on a link, or one link sample when the link's backlog already exceeds the bound; "
            "for a frozen worker, a missed status poll and then the silence bound (silence_s) "
            "without progress on it.",
            ""]


def _migrations(result: ScenarioResult) -> str:
    moved = ", ".join(f"{n} {reason}" for reason, n in sorted(result.migrations.items()))
    if result.resume_s is None:
        return moved
    return f"{moved}; {result.resume_s:.2f} s on average from a break to the next token"


def _deaths(result: ScenarioResult) -> str:
    caused = sum(d for n, d in result.deaths.items() if n in result.killed)
    other = {n: d for n, d in result.deaths.items() if n not in result.killed}
    return f"{caused} / {sum(other.values())}" + (f" {other}" if other else "")


def render(results: Sequence[ScenarioResult], header: str) -> str:
    passed = sum(verdict(r).passed for r in results)
    summary = ["| scenario | verdict | sent | completed | errors | hung | lost | migrated | "
               "recover |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        o = r.outcomes
        summary.append(f"| {r.name} | {'PASS' if verdict(r).passed else 'FAIL'} | {r.sent} | "
                       f"{o.get('completed', 0)} | {o.get('error', 0)} | {o.get('hung', 0)} | "
                       f"{o.get('lost', 0)} | {sum(r.migrations.values())} | "
                       f"{_seconds(r.recover_s)} |")
    parts = [header, f"{passed} of {len(results)} scenarios pass.", "",
             "\n".join(summary), "", *migration_cost(results), "## Scenarios", ""]
    parts += [scenario_section(r) for r in results]
    return "\n".join(parts)

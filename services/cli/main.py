"""The `prfaas` command: one entry point, one subcommand per job.

Each subcommand lives in the module that owns the work and exposes `<name>_main(argv)`;
this file only dispatches, importing lazily so `prfaas --help` stays instant.
"""

from __future__ import annotations

import importlib
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple


class Command(NamedTuple):
    module: str
    function: str
    summary: str
    # A Ctrl-C or SIGTERM is this command's normal end (`prfaas up`): exit 0 quietly, also
    # when it comes before the command handles signals itself (while it imports).
    stops_on_signal: bool = False


COMMANDS: dict[str, Command] = {
    "serve": Command("services.cli.serve", "serve_main", "run one service of the mesh by name"),
    "up": Command("services.cli.up", "up_main",
                  "run the Procfile's processes under a supervisor that restarts them",
                  stops_on_signal=True),
    "multihost": Command("services.cli.multihost", "multihost_main",
                         "the mesh across network namespaces: a rehearsal of two machines",
                         stops_on_signal=True),
    "chaos": Command("services.chaos.cli", "chaos_main",
                     "fault scenarios against the real mesh; writes docs/reliability.md"),
    "send": Command(
        "services.cli.send", "send_main", "drive one prompt through a prefill and a decode worker"
    ),
    "train": Command("services.model.train", "train_main", "train the default model on the corpus"),
    "train-tokenizer": Command(
        "services.model.tokenizer", "train_tokenizer_main", "train the BPE tokenizer"
    ),
    "bench": Command("services.bench.cli", "bench_main", "an OpenAI streaming load client"),
    "plan": Command(
        "services.cli.plan", "plan_main", "the paper's throughput model, grid search"
    ),
    "sim": Command(
        "services.cli.sim", "sim_main", "the live services at paper scale on virtual time"
    ),
    "sim-scheduler": Command(
        "services.cli.sim_scheduler", "main",
        "the schedulers' scenario matrix against the best static t in hindsight",
    ),
    "search": Command(
        "services.cli.search", "search_main",
        "the best PrfaaS deployment per dollar: a search of capacity searches on Ray",
    ),
    "profile": Command(
        "services.cli.profile", "profile_main",
        "time the real model on this machine; writes a measured hardware profile",
    ),
    "validate-sim": Command(
        "services.cli.validation", "validate_main",
        "the simulation against the live mesh under load (make validate-sim)",
    ),
    "prometheus-config": Command(
        "services.cli.prometheus_config", "prometheus_config_main",
        "a Prometheus scrape configuration for every service of a topology",
    ),
    "sim-dashboard": Command(
        "services.cli.sim_dashboard", "sim_dashboard_main",
        "the dashboard on the simulation (virtual time at a chosen speed), or --record a log",
    ),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: prfaas COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {cmd.summary}" for name, cmd in COMMANDS.items()]
    lines += ["", "`prfaas COMMAND --help` describes each command."]
    return "\n".join(lines)


def resolve(name: str) -> Callable[[list[str]], int]:
    command = COMMANDS[name]
    module = importlib.import_module(command.module)
    entry: Callable[[list[str]], int] = getattr(module, command.function)
    return entry


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help", "help"}:
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"prfaas: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    command = COMMANDS[name]
    if command.stops_on_signal:
        # Until the command installs its own handlers, SIGTERM stops it as Ctrl-C does.
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        return resolve(name)(rest)
    except KeyboardInterrupt:
        # No traceback from the middle of an import: the user asked for the stop.
        print(f"prfaas {name}: interrupted", file=sys.stderr)
        if not command.stops_on_signal:
            return 130
        # Already stopping: `make` forwards its own SIGTERM, which must not end us by signal.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())

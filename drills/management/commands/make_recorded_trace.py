"""``manage.py make_recorded_trace``: write a recorded-shaped trace, generated.

The shipped one is ``platform/traces/recorded-generated-chat.jsonl``, written by

    manage.py make_recorded_trace --seed 0 --out platform/traces/recorded-generated-chat.jsonl

(the defaults). It is **generated**, not recorded: the fleet drill's conversation
workload (``drills.domain.recorded_trace.RECORDED_WORKLOAD``: chats that grow
turn after turn behind eight Zipf-popular shared prefixes) turned into the
traffic twin's records (``records_of``: stand-in token ids hashed into salted
block chains) and exported as ``manage.py export_traffic`` exports real ones
(``routing.domain.traffic.trace_lines``: ``prefix_blocks``, stand-in
``prompt``...), each line marked ``"origin": "generated"``. The load-test gate
and the fleet simulator replay it as they replay an export.

``--day-hours H`` shapes the arrivals as the autoscaling drill's day (night at
``--night-factor`` of the peak ``--rate``, a morning ramp, a plateau, an evening
fall), compressed into H simulated hours, by thinning the peak's arrivals; without
it the rate is flat for ``--duration-s``. ``--teams NAME:TIER:WEIGHT,...``
splits the conversations between teams (each its share of the rate, every turn
of a conversation from its team), so a replay measures more than one tier; the
default is one standard team. The salt is drawn from ``--seed`` (a generated
trace has no secret to protect). Deterministic for its flags.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from drills.domain.autoscaling_drill import DrillScenario, load_factor
from drills.domain.recorded_trace import RECORDED_WORKLOAD, records_of, trace_hit_rate
from drills.domain.routing_ab import generate_arrivals
from drills.domain.workload import TeamSpec, read_trace
from routing.domain.traffic import derive_salt, trace_lines

DEFAULT_OUT = Path("platform/traces/recorded-generated-chat.jsonl")


class Command(BaseCommand):
    help = (
        "Write a recorded-shaped trace (prefix_blocks, stand-in prompts) generated "
        "from the fleet drill's conversation workload: not live traffic."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--rate", type=float, default=RECORDED_WORKLOAD.arrival_rate
        )
        parser.add_argument("--duration-s", type=float, default=120.0)
        parser.add_argument(
            "--day-hours",
            type=float,
            default=None,
            help="shape the rate as the autoscaling drill's day over this many "
            "simulated hours (replaces --duration-s)",
        )
        parser.add_argument("--night-factor", type=float, default=0.2)
        parser.add_argument(
            "--teams",
            help="NAME:TIER:WEIGHT,... e.g. chat:interactive:3,tools:standard:1 "
            "(default: one standard team)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        rate, seed = options["rate"], options["seed"]
        if not rate > 0 or not options["duration_s"] > 0:
            raise CommandError("--rate and --duration-s must be positive")
        workload = replace(RECORDED_WORKLOAD, arrival_rate=rate)
        if options["teams"] is not None:
            workload = replace(workload, teams=_teams(options["teams"]))
        duration = options["duration_s"]
        keep = None
        if options["day_hours"] is not None:
            try:
                day = DrillScenario(
                    day_hours=options["day_hours"],
                    night_factor=options["night_factor"],
                    warmup_s=0.0,
                )
            except ValueError as exc:
                raise CommandError(str(exc)) from None
            duration = day.duration_s("day")
            keep = day
        arrivals = generate_arrivals(workload, duration, seed=seed)
        if keep is not None:
            thin = random.Random(f"day:{seed}")
            arrivals = [
                a for a in arrivals if thin.random() < load_factor(keep, "day", a.at)
            ]
        salt = derive_salt(f"generated trace {seed}")
        lines, _ = trace_lines(records_of(arrivals, salt=salt), salt=salt)
        out: Path = options["out"]
        with out.open("w", encoding="utf-8") as handle:
            for line in lines:
                line["origin"] = "generated"
                handle.write(json.dumps(line, separators=(",", ":")) + "\n")
        trace = read_trace(out)
        hit = trace_hit_rate(trace) or 0.0
        prompts = sum(r.prompt_tokens for r in trace) / max(1, len(trace))
        conversations = len({r.conversation for r in trace})
        tiers: dict[str, int] = {}
        for request in trace:
            tiers[request.tier] = tiers.get(request.tier, 0) + 1
        mix = ", ".join(f"{tier} {count}" for tier, count in sorted(tiers.items()))
        self.stdout.write(
            f"wrote {out}: {len(trace)} requests ({mix}) in {conversations} "
            f"conversations over {trace[-1].t if trace else 0:.0f} s, mean prompt "
            f"{prompts:.0f} tokens, prefix hit rate of an unbounded cache {hit:.1%} "
            "(generated from the drill's workload, not live traffic)"
        )


def _teams(value: str) -> tuple[TeamSpec, ...]:
    """Parse ``NAME:TIER:WEIGHT,...`` into the workload's teams."""
    teams = []
    for part in value.split(","):
        fields = part.strip().split(":")
        if len(fields) != 3:
            raise CommandError(f"--teams: NAME:TIER:WEIGHT each; got {part!r}")
        name, tier, weight = (field.strip() for field in fields)
        if not name:
            raise CommandError(f"--teams: a team needs a name; got {part!r}")
        try:
            teams.append(TeamSpec(name, weight=float(weight), tier=tier))
        except ValueError as exc:
            raise CommandError(f"--teams: {part!r}: {exc}") from None
    names = [team.name for team in teams]
    if len(set(names)) != len(names):
        raise CommandError("--teams: each team once")
    return tuple(teams)

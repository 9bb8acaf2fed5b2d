"""Whether a result was measured on a quiet machine, judged from its record.

A record (`expframe.reproduce.running`) holds, for each sitting, the 1-minute load
average at its start and the cores the machine let the run use (its CPU affinity),
and for the whole result the load at the end and `other_cores`: the CPU that
processes other than the runs used on average, from /proc/stat. Nothing here reads
the machine: the judgement is the record's, so a page rewritten later says the same.
"""

from __future__ import annotations

from typing import Optional

# A result is quiet when nothing else competed for the machine while it ran: at the start
# of every sitting and at the end the 1-minute load average was under the cores the run
# could use (recorded with the machine: its CPU affinity), and other processes used
# under this share of those cores on average (`other_cores`, measured from /proc/stat).
QUIET_LOAD_PER_CORE = 1.0
QUIET_OTHER_SHARE = 0.125  # 0.25 of 2 cores


def quiet_rule() -> str:
    """The rule `quiet` applies, in words."""
    load = "the core count" if QUIET_LOAD_PER_CORE == 1 else f"{QUIET_LOAD_PER_CORE:g} x the core count"
    return (f"the 1-minute load average under {load} at the start of each sitting and at the end, and other "
            f"processes using under {QUIET_OTHER_SHARE:.1%} of the cores on average while it ran "
            f"({2 * QUIET_OTHER_SHARE:g} of 2)")


def quiet(rec: dict) -> tuple[Optional[bool], list[str]]:
    """Whether the machine was quiet while `rec` ran (None: unknown), and what made it busy.

    Judged at the start of every sitting (a stopped sitting's end is not: it is read as
    its own runs stop, unsettled), at the end, and by the other processes' average cores,
    each against the cores the sitting or the record was made with."""
    busy, unknown = [], False

    def cores(where: dict) -> Optional[int]:
        value = (where.get("machine") or {}).get("cores")
        return value if isinstance(value, int) and value > 0 else None

    checks = [(s.get("load_average_start"), cores(s), "at the start") for s in rec.get("sittings", [rec])]
    checks.append((rec.get("load_average_end"), cores(rec), "at the end"))
    for load, n, when in checks:
        if not load or n is None:
            unknown = True
        elif load[0] >= QUIET_LOAD_PER_CORE * n:
            busy.append(f"load {load[0]:.2f} {when} on {n} cores")
    other, n = rec.get("other_cores"), cores(rec)
    if other is None or n is None:
        unknown = True
    elif other >= QUIET_OTHER_SHARE * n:
        busy.append(f"other processes used {other:.2f} of {n} cores")
    return (False if busy else None if unknown else True), busy


def verdict(rec: dict) -> str:
    """`yes`, `unknown`, or `**no**: <what made the machine busy>`."""
    ok, busy = quiet(rec)
    return "yes" if ok else "unknown" if ok is None else "**no**: " + "; ".join(busy)

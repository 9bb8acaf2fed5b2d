"""Where one profiled host call's time goes, per runner, read from the TensorFlow
profiler's own files (no TensorBoard needed).

    python benchmarks/profile_breakdown.py runs/profile_224
    python benchmarks/profile_breakdown.py runs/profile_128 --calls 5 --top 25 --out runs/profile_128/breakdown.json

DIR holds one folder per profiled runner, as `resnet50_throughput.py --profile_dir DIR`
writes them (`<size>px_<n>rep_<precision>_<runner>/plugins/profile/<time>/*.xplane.pb`).
For each runner it reads the host plane's threads and reports:

  wall       first event to last, the profiled call as the profiler saw it;
  busy       summed over threads, the time inside any traced event (two cores
             busy for one second count two seconds);
  by kind    exclusive time (an event's time less that of the events nested in it on
             its thread) summed by kind: a TensorFlow op's kernel type (the part after ':'
             of `scope/name:Type`, e.g. `_MklMatMul` where oneDNN runs it), else the
             event's own name with ids and numbers removed.

Kinds are listed by their largest time over the runners, with each runner's ms per
call (`--calls N`: the profile holds N calls, as `resnet50_throughput.py
--profile_calls N` writes it), so a gap between runners shows as the rows whose times
differ. A profile is a few samples: a kind that differs by less than a call's spread
(about +-5 % here) is noise.
"""

import argparse
import collections
import glob
import json
import os
import re
import sys
from typing import Dict, List, Tuple

from tensorflow.tsl.profiler.protobuf import xplane_pb2

_OP = re.compile(r"^[^\s:]+:(_?[A-Za-z][A-Za-z0-9_]*)$")   # scope/name:Type, an op's TraceMe
_NUMBERS = re.compile(r"[#@]?\d+|0x[0-9a-f]+")


def kind(name: str) -> str:
    """`resnet/conv1/Conv2D:Conv2D` -> `Conv2D`; other events keep their name with its
    ids and numbers removed (`ExecutorState::Process#id=42#` -> `ExecutorState::Process#id=#`)."""
    match = _OP.match(name)
    return match.group(1) if match else _NUMBERS.sub("", name)


def exclusive(events: List[Tuple[int, int, str]]) -> Dict[str, int]:
    """{kind: picoseconds} of one thread's events (offset_ps, duration_ps, name), each
    event's own time: its duration less the durations of the events directly inside it."""
    out = collections.Counter()
    stack: List[List] = []          # [end_ps, kind, own_ps]
    for start, duration, name in sorted(events, key=lambda e: (e[0], -e[1])):
        while stack and stack[-1][0] <= start:
            end, k, own = stack.pop()
            out[k] += own
        if stack:
            stack[-1][2] -= min(duration, stack[-1][0] - start)
        stack.append([start + duration, kind(name), duration])
    for _, k, own in stack:
        out[k] += own
    return out


def read_runner(folder: str) -> Dict:
    """The breakdown of the newest .xplane.pb under `folder`."""
    files = sorted(glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.xplane.pb")))
    if not files:
        raise FileNotFoundError(f"{folder}: no plugins/profile/*/*.xplane.pb (run resnet50_throughput.py "
                                "--profile_dir first)")
    space = xplane_pb2.XSpace()
    with open(files[-1], "rb") as f:
        space.ParseFromString(f.read())
    by_kind, busy, first, last, threads = collections.Counter(), 0, None, None, 0
    for plane in space.planes:
        if not plane.name.startswith("/host:"):
            continue
        names = {i: m.name for i, m in plane.event_metadata.items()}
        for line in plane.lines:
            events = [(line.timestamp_ns * 1000 + e.offset_ps, e.duration_ps, names.get(e.metadata_id, "?"))
                      for e in line.events if e.duration_ps > 0]
            if not events:
                continue
            threads += 1
            own = exclusive(events)
            by_kind.update(own)
            busy += sum(own.values())
            start = min(e[0] for e in events)
            end = max(e[0] + e[1] for e in events)
            first = start if first is None else min(first, start)
            last = end if last is None else max(last, end)
    return {"file": files[-1], "threads": threads, "wall_ms": ((last or 0) - (first or 0)) / 1e9,
            "busy_ms": busy / 1e9, "by_kind_ms": {k: v / 1e9 for k, v in by_kind.items()}}


def runners(profile_dir: str) -> Dict[str, Dict]:
    """{folder name: breakdown} of every profiled runner under `profile_dir`."""
    found = {}
    for folder in sorted(glob.glob(os.path.join(profile_dir, "*"))):
        if os.path.isdir(os.path.join(folder, "plugins", "profile")):
            found[os.path.basename(folder)] = read_runner(folder)
    if not found:
        raise FileNotFoundError(f"{profile_dir}: no profiled runners (folders with plugins/profile/)")
    return found


def per_call(found: Dict[str, Dict], calls: int) -> Dict[str, Dict]:
    """The breakdowns with every time divided by `calls`."""
    return {name: dict(r, wall_ms=r["wall_ms"] / calls, busy_ms=r["busy_ms"] / calls,
                       by_kind_ms={k: v / calls for k, v in r["by_kind_ms"].items()}) for name, r in found.items()}


def table(found: Dict[str, Dict], top: int) -> str:
    names = list(found)
    totals = collections.Counter()
    for r in found.values():
        for k, ms in r["by_kind_ms"].items():
            totals[k] = max(totals[k], ms)
    header = "| kind | " + " | ".join(names) + " |"
    lines = [header, "|---|" + "---:|" * len(names)]
    lines.append("| wall, ms | " + " | ".join(f"{found[n]['wall_ms']:,.1f}" for n in names) + " |")
    lines.append("| busy, summed over threads, ms | " + " | ".join(f"{found[n]['busy_ms']:,.1f}" for n in names)
                 + " |")
    for k, _ in totals.most_common(top):
        lines.append(f"| {k} | " + " | ".join(f"{found[n]['by_kind_ms'].get(k, 0.0):,.1f}" for n in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile_dir")
    parser.add_argument("--top", type=int, default=20, help="kinds to list (default 20)")
    parser.add_argument("--calls", type=int, default=1, help="host calls in each profile: times are per call")
    parser.add_argument("--out", help="also write the breakdowns (per call) as JSON here")
    args = parser.parse_args(argv)
    try:
        found = per_call(runners(args.profile_dir), max(1, args.calls))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(found, args.top))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(found, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Equivalence hashes of the scheduler-side hierarchy: a refactor's check
that every scheduler decision stayed the same.

    PYTHONHASHSEED=0 .venv/bin/python benchmarks/replay_hash.py [--trace FILE]
        [--limit N] [--out FILE]

Replays the trace (``kvtier.tools.sizing.TraceReplayer``, the replay behind
``kvtier size``) through ``TierHierarchy`` in seven configurations (CPU only;
CPU+disk at three disk sizes; ARC, 2Q and ARC with a doorkeeper) and folds
every public hierarchy call (its name, arguments and result) and the stats
after each request into one sha256 per configuration. Run it in two trees
(before and after) and compare the JSON: equal hashes mean equal lookups,
plans, orders, events and counters. Writes
benchmarks/results/replay_hash.json.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import sys
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, not ROOT
    sys.path.insert(0, str(ROOT))

from benchmarks._common import DEFAULT_TRACE, write_json  # noqa: E402
from kvtier.tiers.hierarchy import TierHierarchy  # noqa: E402
from kvtier.tools.sizing import TraceReplayer  # noqa: E402
from kvtier.tools.trace import load_trace, request_keys  # noqa: E402

CONFIGS = [
    {"cpu": 2000, "disk": 0, "cp": "lru", "dp": "lru"},
    {"cpu": 2000, "disk": 10000, "cp": "lru", "dp": "lru"},
    {"cpu": 2000, "disk": 40000, "cp": "lru", "dp": "lru"},
    {"cpu": 500, "disk": 2500, "cp": "arc", "dp": "lru"},
    {"cpu": 500, "disk": 2500, "cp": "2q", "dp": "arcdk"},
    {"cpu": 500, "disk": 2500, "cp": "lru", "dp": "arc"},
    {"cpu": 500, "disk": 0, "cp": "arc", "dp": "lru"},
]


def canon(x: Any) -> Any:
    """A JSON-able form of a hierarchy answer that ignores object identity
    and private state."""
    if is_dataclass(x) and not isinstance(x, type):
        return {f.name: canon(getattr(x, f.name)) for f in fields(x)}
    if isinstance(x, dict):
        return sorted((repr(canon(k)), canon(v)) for k, v in x.items())
    if isinstance(x, (set, frozenset)):
        return sorted(repr(canon(v)) for v in x)
    if isinstance(x, (list, tuple)):
        return [canon(v) for v in x]
    if hasattr(x, "_asdict"):
        return canon(x._asdict())
    if hasattr(x, "__slots__") and not isinstance(x, type):
        return {k: canon(getattr(x, k, None)) for k in x.__slots__}
    if hasattr(x, "__dict__") and not isinstance(x, type):
        return {k: canon(v) for k, v in sorted(vars(x).items()) if not k.startswith("_")}
    if hasattr(x, "value") and hasattr(x, "name"):  # enums
        return f"{type(x).__name__}.{x.name}"
    return repr(x)


def replay_digest(requests: list[Any], cfg: dict[str, Any]) -> str:
    h = TierHierarchy(
        cfg["cpu"], cfg["disk"], cpu_policy=cfg["cp"], disk_policy=cfg["dp"]
    )
    digest = hashlib.sha256()

    def fold(obj: Any) -> None:
        digest.update(json.dumps(obj, default=repr).encode())

    for name, _ in inspect.getmembers(TierHierarchy, inspect.isfunction):
        if name.startswith("_"):
            continue
        call = getattr(h, name)

        def traced(*a: Any, _call: Any = call, _name: str = name, **k: Any) -> Any:
            result = _call(*a, **k)
            fold([_name, canon(a), canon(k), canon(result)])
            return result

        setattr(h, name, traced)
    replayer = TraceReplayer(h)
    for req in requests:
        replayer.replay(request_keys(req))
        fold(canon(h.stats))
    fold(canon(replayer.finish()))
    return digest.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int, default=0, help="first N requests only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    requests = list(load_trace(args.trace))
    if args.limit:
        requests = requests[: args.limit]
    hashes = {json.dumps(c, sort_keys=True): replay_digest(requests, c) for c in CONFIGS}
    for cfg, h in hashes.items():
        print(f"{h}  {cfg}")
    path = write_json(
        "replay_hash",
        {"trace": args.trace, "requests": len(requests), "hashes": hashes},
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

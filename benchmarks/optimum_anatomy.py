"""Where the offline optimum's hits come from, by reuse distance.

    .venv/bin/python benchmarks/optimum_anatomy.py [--trace FILE]
        [--capacities 2000 12000]

For each capacity (one tier) and for the full trace and each half, bins
every reuse of a block by its reuse distance (blocks requested in between)
in multiples of the capacity, and prints the optimum's hits next to all
reuses of each bin, as fractions of all blocks of the trace. An LRU cache
hits (about) the first bin, the reuses closer than its capacity; the
optimum's hits beyond it are kept by knowing which blocks come back, which
an online policy has to guess. Writes benchmarks/results/optimum_anatomy.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is on the path, not ROOT
    sys.path.insert(0, str(ROOT))

from benchmarks._common import DEFAULT_TRACE, write_json  # noqa: E402
from kvtier.testing.oracles import optimal_hits_by_reuse_distance  # noqa: E402
from kvtier.tools.trace import load_trace  # noqa: E402

MULTS = (1, 2, 4, 8)  # bin edges, in multiples of the capacity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--capacities", type=int, nargs="+", default=[2000, 12000])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    keys = [r.hash_ids for r in load_trace(args.trace)]
    half = len(keys) // 2
    parts = {"full": keys, "first": keys[:half], "second": keys[half:]}
    labels = (
        [f"<{MULTS[0]}x"]
        + [f"{a}-{b}x" for a, b in zip(MULTS, MULTS[1:])]
        + [f">={MULTS[-1]}x"]
    )
    print(
        "optimum's hits / all reuses, by reuse distance (x = capacity), "
        "as fractions of all blocks"
    )
    print(
        f"{'part':<7}{'blocks':>7}  "
        + "".join(f"{lb:>15}" for lb in labels)
        + f"{'optimum':>9}"
    )
    rows = []
    for part, reqs in parts.items():
        total = sum(map(len, reqs))
        for cap in args.capacities:
            hits, reuses = optimal_hits_by_reuse_distance(
                reqs, cap, [m * cap for m in MULTS]
            )
            rows.append(
                {
                    "part": part,
                    "capacity": cap,
                    "bins": labels,
                    "optimum_hits": [h / total for h in hits],
                    "reuses": [n / total for n in reuses],
                    "optimum": sum(hits) / total,
                }
            )
            cells = "".join(
                f"{h / total:>7.3f}/{n / total:<7.3f}" for h, n in zip(hits, reuses)
            )
            print(f"{part:<7}{cap:>7}  {cells}{sum(hits) / total:>9.4f}")
    path = write_json(
        "optimum_anatomy",
        {"params": {"trace": args.trace, "bin_edges_x_capacity": MULTS}, "rows": rows},
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

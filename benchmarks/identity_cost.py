"""Start-up cost of the store identity's weight digest (issue #19).

``model_identity`` reads each weight file's safetensors header and 16
samples of 4 KiB spread over the file, so its cost grows with the number of
files, not their size. Two directories, each measured cold (page cache
dropped, root only) and warm, ``--repeats`` times, median:

  real    ``--real-files`` files of ``--real-gib`` GiB of random bytes each
          (written once; what a checkpoint's shards look like on disk)
  sparse  ``--sparse-files`` files making up ``--sparse-gib`` GiB in all
          (sparse: a 100 GB checkpoint's layout without 100 GB of disk)

and the cost projected to 100 GB of 5 GB shards (20 files) from the real
directory's cold cost per file. Prints a table and writes
benchmarks/results/identity_cost.json.

    .venv/bin/python benchmarks/identity_cost.py [--real-files 4 --real-gib 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import drop_caches, write_json  # noqa: E402
from kvtier.connector.identity import model_identity  # noqa: E402

_HEADER = json.dumps(
    {"w": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}
).encode()


def _weights(path: Path, size: int, real: bool) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(_HEADER)) + _HEADER)
        if real:
            chunk = os.urandom(64 << 20)
            left = size - f.tell()
            while left > 0:
                f.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)
        else:
            f.truncate(size)


def _time(root: Path, cold: bool, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        if cold and not drop_caches():
            return float("nan")
        t0 = time.perf_counter()
        model_identity(str(root))
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real-files", type=int, default=4)
    ap.add_argument("--real-gib", type=float, default=1.0)
    ap.add_argument("--sparse-files", type=int, default=20)
    ap.add_argument("--sparse-gib", type=float, default=100.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/identity_cost.json")
    )
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-ident-", dir=args.dir) as tmp:
        for kind, files, gib in (
            ("real", args.real_files, args.real_gib * args.real_files),
            ("sparse", args.sparse_files, args.sparse_gib),
        ):
            root = Path(tmp) / kind
            root.mkdir()
            (root / "config.json").write_text('{"model_type": "llama"}')
            size = int(gib * (1 << 30)) // files
            for i in range(files):
                _weights(root / f"model-{i:05d}.safetensors", size, kind == "real")
            rows[kind] = {
                "files": files,
                "gib": gib,
                "cold_s": _time(root, True, args.repeats),
                "warm_s": _time(root, False, args.repeats),
            }
    real = rows["real"]
    per_file = real["cold_s"] / real["files"]
    projected = 20 * per_file
    print(f"{'dir':>6} | {'files':>5} | {'GiB':>6} | {'cold s':>8} | {'warm s':>8}")
    for kind, r in rows.items():
        print(
            f"{kind:>6} | {r['files']:>5} | {r['gib']:>6.1f} | "
            f"{r['cold_s']:>8.4f} | {r['warm_s']:>8.4f}"
        )
    print(f"projected, 100 GB in 5 GB shards, cold: {projected:.4f} s (goal < 1 s)")
    path = write_json(
        "identity_cost",
        {
            "rows": rows,
            "cold_s_per_file": per_file,
            "projected_100gb_5gb_shards_cold_s": projected,
            "page_cache_dropped": drop_caches(),
        },
        args.out,
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

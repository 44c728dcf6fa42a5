#!/usr/bin/env bash
# What the byte-sum triggers (migration V5) cost SQLite on small tasks:
# 50,000 x 1 KiB burn-downs alternating a store file migrated as shipped
# and the same file with the two triggers dropped. BENCHMARKS.md, issue 32.
# Usage: tools/sqlite-trigger-cost.sh [target/release/taskbroker]
set -euo pipefail
cd "$(dirname "$0")/.."
broker=${1:-target/release/taskbroker}
bench=target/release/taskbroker-bench
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
TASKBROKER_SQLITE_PATH="$work/with.sqlite" "$broker" migrate >/dev/null 2>&1
TASKBROKER_SQLITE_PATH="$work/without.sqlite" "$broker" migrate >/dev/null 2>&1
python3 - "$work/without.sqlite" <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
db.execute("DROP TRIGGER taskbroker_inserted_bytes")
db.execute("DROP TRIGGER taskbroker_deleted_bytes")
db.commit()
PY
for round in 1 2; do
  for kind in with without; do
    rm -f "$work"/run.sqlite*
    cp "$work/$kind.sqlite" "$work/run.sqlite"
    out=$("$bench" e2e --tasks 50000 --payload-bytes 1024 --partitions 16 --store sqlite \
      --broker-bin "$broker" --broker-env "TASKBROKER_SQLITE_PATH=$work/run.sqlite" 2>&1)
    echo "triggers $kind, round $round:"
    echo "$out" | grep -E 'throughput:|peak RSS' | head -2
  done
done

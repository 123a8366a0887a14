"""One variant of a probe in a fresh process (its own compile cache or allocator settings, nothing left over
from the variant before it): the child prints one line, `RESULT <json>` (`report`), and the parent collects it
(`run`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

PREFIX = "RESULT "


def report(row: dict) -> None:
    print(PREFIX + json.dumps(row), flush=True)


def run(command: list[str], env: dict, key: str, name: str) -> dict:
    """The child's row, or {key: name, "failed": the tail of its stderr} (printed too)."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    found = [line[len(PREFIX):] for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if done.returncode or not found:
        print(f"{name}: failed (rc {done.returncode})\n{done.stderr[-3000:]}", flush=True)
        return {key: name, "failed": done.stderr[-2000:]}
    return json.loads(found[0])


def finish(rows: list[dict], path: str | None) -> int:
    """The rows to `path` (JSON) when given; the exit status: 1 if a variant failed."""
    if path:
        Path(path).write_text(json.dumps(dict(rows=rows), indent=1))
    return 0 if all("failed" not in row for row in rows) else 1

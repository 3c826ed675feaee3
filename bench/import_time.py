"""Import time: is `import artcloud` about as cheap as `import openai`?

Wall time of `python -c "import artcloud"` and `python -c "import openai"`, each in a fresh subprocess of
the same interpreter (sys.executable, run from the system temp dir), plus `python -c "pass"` as the
interpreter start-up baseline. Two untimed runs of each warm the filesystem and bytecode caches; then the
three commands alternate for --rounds rounds (default 15) and the median of each is reported, raw and with
the baseline subtracted. Target: artcloud / openai <= 1.2 (baseline-subtracted is the stricter figure).

Also: one `python -X importtime -c "import artcloud"`, summarised as the 8 slowest top-level packages it
pulls in (cumulative microseconds where the package is first entered), and a check that `import artcloud`
loads none of the heavy modules in HEAVY; any loaded one makes the script exit 1.
Results go to bench/out/import_time.json.

    .venv/bin/python bench/import_time.py
    .venv/bin/python bench/import_time.py --rounds 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

OUT = Path(__file__).resolve().parent / "out"
HEAVY = ["torch", "transformers", "fastapi", "sky", "modal", "boto3", "vllm", "unsloth", "uvicorn", "peft"]
COMMANDS = {"baseline": "pass", "artcloud": "import artcloud", "openai": "import openai"}
TARGET = 1.2

console = Console(width=max(Console().width, 110))


def python(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=tempfile.gettempdir(),
                          capture_output=True, text=True, check=True)


def slowest_packages(n: int = 8) -> tuple[list[tuple[str, int]], int]:
    """Top-level packages under `import artcloud` by cumulative us at their outermost import; and the total."""
    rows = []  # (cumulative us, depth, module), in the post-order importtime prints
    for line in python("import artcloud", "-X", "importtime").stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "cumulative" not in line:
            _, cum, name = line[len("import time:"):].split("|")
            rows.append((int(cum), (len(name) - len(name.lstrip())) // 2, name.strip()))
    root = max(i for i, r in enumerate(rows) if r[1] == 0 and r[2] == "artcloud")
    total, stack, packages = rows[root][0], [], {}
    for cum, depth, name in reversed(rows[:root + 1]):  # reversed post-order: every parent before its children
        if depth == 0 and name != "artcloud":
            break  # the subtree of `artcloud` ends here
        del stack[depth:]
        top = name.split(".")[0]
        if top != "artcloud" and top not in stack:
            packages[top] = packages.get(top, 0) + cum
        stack.append(top)
    return sorted(packages.items(), key=lambda kv: -kv[1])[:n], total


def heavy_loaded() -> list[str]:
    code = f"import sys, artcloud; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    return [m for m in python(code).stdout.strip().split(",") if m]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15, help="timed runs of each command, alternated; the median counts")
    args = p.parse_args()

    for _ in range(2):  # warm-up, untimed
        for code in COMMANDS.values():
            python(code)
    times = {k: [] for k in COMMANDS}
    for _ in range(args.rounds):
        for k, code in COMMANDS.items():
            t0 = time.perf_counter()
            python(code)
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    net = {k: med[k] - med["baseline"] for k in ("artcloud", "openai")}
    ratio = {"raw": med["artcloud"] / med["openai"], "minus_baseline": net["artcloud"] / net["openai"]}

    t = Table(title=f"Import wall time, median of {args.rounds} alternated rounds ({Path(sys.executable).name} "
                    f"{sys.version.split()[0]})")
    for col in ["command", "median ms", "minus start-up ms", "min ms", "max ms"]:
        t.add_column(col, justify="left" if col == "command" else "right")
    for k, code in COMMANDS.items():
        t.add_row(f'python -c "{code}"', f"{1000 * med[k]:.1f}", f"{1000 * net[k]:.1f}" if k in net else "-",
                  f"{1000 * min(times[k]):.1f}", f"{1000 * max(times[k]):.1f}")
    colour = {k: "green" if r <= TARGET else "red" for k, r in ratio.items()}
    t.add_row(f"artcloud / openai (target <= {TARGET})", f"[{colour['raw']}]{ratio['raw']:.2f}[/]",
              f"[{colour['minus_baseline']}]{ratio['minus_baseline']:.2f}[/]", "", "")
    console.print(t)

    packages, total = slowest_packages()
    s = Table(title=f"Slowest top-level packages under `import artcloud` (-X importtime, total {total / 1000:.1f} ms)")
    for col in ["package", "cumulative ms", "% of import"]:
        s.add_column(col, justify="left" if col == "package" else "right")
    for name, us in packages:
        s.add_row(name, f"{us / 1000:.1f}", f"{100 * us / total:.0f}")
    console.print(s)
    console.print("(cumulative includes what each package imports, so nested packages count in more than one row)")

    loaded = heavy_loaded()
    console.print(f"[red]heavy modules loaded by `import artcloud`: {', '.join(loaded)}[/]" if loaded
                  else f"[green]none of {', '.join(HEAVY)} is loaded by `import artcloud`[/]")

    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "import_time.json").write_text(json.dumps({
        "settings": vars(args), "time": time.time(), "python": sys.version, "target": TARGET,
        "median_s": med, "minus_baseline_s": net, "ratio_artcloud_over_openai": ratio, "runs_s": times,
        "importtime_total_us": total, "slowest_packages_us": dict(packages), "heavy_loaded": loaded,
    }, indent=2))
    console.print(f"wrote {OUT / 'import_time.json'}")
    sys.exit(1 if loaded else 0)


if __name__ == "__main__":
    main()

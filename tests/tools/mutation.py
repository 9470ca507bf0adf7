"""Mutation testing of the engines, the decoding code, the KV cache and the service layer with mutmut
(`make mutation`; not part of `make test` or CI). What is mutated and which tests run is in
pyproject.toml's [tool.mutmut]; docs/testing/mutation.md has the last results.

    python tests/tools/mutation.py                       # a seeded sample of 300 mutants, at most 60 minutes
    python tests/tools/mutation.py --sample 0            # every mutant
    python tests/tools/mutation.py --seed 7 --sample 200 --time-limit 90
    python tests/tools/mutation.py --reuse NAME ...      # re-run given mutants (globs allowed) on the last run's stats
    python tests/tools/mutation.py --sample 200 'tserve.service.*'   # a sample of the mutants the globs match
    python tests/tools/mutation.py --per-package 40      # 40 from each package (service.translation, model.decoding, ...)

1. mutants/ is made afresh (with --reuse the previous one, and mutmut's stats of which tests call which
   function, are kept), and mutmut writes every mutant of the mutated files into it.
2. A seeded random sample of the mutant names (or the names given) is handed to `mutmut run`. mutmut runs
   the selected tests once in its own process (training the tiny fixture models there, once), then forks
   one worker per mutant from that warm process; each worker runs only the tests that called the mutated
   function. Workers use one torch thread each (OMP_NUM_THREADS=1) unless it is set.
3. At the time limit mutmut is interrupted (SIGINT: it stops its workers and keeps the verdicts it has);
   mutants it did not reach count as "not checked". mutmut starts with the mutants whose tests are quickest,
   so a cut-off leaves the slow ones out: a smaller sample is the fairer way to fit the limit.
4. The kill rate (killed / sampled, timeouts counted as killed), the score of each package and module
   (killed / checked: the time limit's leftovers are not checked, a mutant no test reaches is checked and
   not killed) and every survivor's diff are printed, and written to mutants/mutation-report.txt.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KILLED = {"killed", "timeout", "caught by type check"}


def module_of(name: str) -> str:
    """tserve.model.kv_cache.xǁKVCacheǁwrite__mutmut_3 -> model.kv_cache (a mutant's name is its module's
    dotted path, then the function's, which has no dot)"""
    return name.removeprefix("tserve.").rsplit(".", 1)[0]


def package_of(name: str) -> str:
    """tserve.service.translation.routing.x_pick_route__mutmut_2 -> service.translation; a module right
    under tserve/ (none is mutated now) is its own package."""
    module = module_of(name)
    return module.rsplit(".", 1)[0] if "." in module else module


def scores(picked: dict[str, str], group) -> list[str]:  # noqa: ANN001 - group: name -> its module or package
    """One line per group: killed (timeouts included) / checked, where checked leaves out the mutants the
    time limit stopped mutmut before (a "no tests" mutant is checked and not killed), and the sample."""
    tally: dict[str, Counter] = {}
    for name, st in picked.items():
        c = tally.setdefault(group(name), Counter())
        c["killed"] += st in KILLED
        c["checked"] += st != "not checked"
        c["sampled"] += 1
    lines = []
    for key, c in sorted(tally.items()):
        rate = f"{100 * c['killed'] / c['checked']:5.1f}%" if c["checked"] else "    -"
        unchecked = c["sampled"] - c["checked"]
        lines.append(f"  {key:<40} {c['killed']:>4} / {c['checked']:<4} = {rate}"
                     + (f"  ({unchecked} of {c['sampled']} sampled not checked)" if unchecked else ""))
    return lines


def generate() -> list[str]:
    """Write the mutants into mutants/ (as `mutmut run` does first) and return every mutant's name."""
    import mutmut.__main__ as mm

    mm.set_mutant_under_test("mutant_generation")
    os.makedirs("mutants", exist_ok=True)
    mm.copy_src_dir()
    mm.copy_also_copy_files()
    mm.create_mutants(1)
    return sorted(name for _, name in verdicts())


def verdicts() -> list[tuple[str, str]]:
    """(status, mutant name) for every mutant mutmut knows of."""
    from mutmut.__main__ import SourceFileMutationData, walk_mutatable_files
    from mutmut.stats import status_by_exit_code

    out = []
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        out += [(status_by_exit_code[code], name) for name, code in data.exit_code_by_key.items()]
    return out


def diff(name: str) -> str:
    from mutmut.__main__ import find_mutant, get_diff_for_mutant

    try:
        return get_diff_for_mutant(name, path=find_mutant(name).path).rstrip()
    except Exception as exc:  # the report goes on without this one diff
        return f"(no diff: {exc})"


def mutmut_run(argv: list[str]) -> None:
    """`mutmut run ARGV` in this process, less one redundant pass: when mutmut has just collected its stats
    by running every selected test (and stops unless they all pass), its "clean" run of the same tests is
    skipped. With stats loaded from an earlier run (--reuse) the clean run happens, and warms the process
    that the forked workers then inherit."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]  # tests/ comes from mutants/
    # The time limit arrives as SIGINT, which a shell ignores in a job started in the background (nohup,
    # `&`) and the ignoring is inherited: mutmut stops its workers on KeyboardInterrupt, so take it back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import mutmut.__main__ as mm
    from mutmut.workers.isolation import ForkRunner

    fresh_stats = False
    collect_stats, run_clean_tests = ForkRunner.collect_stats, ForkRunner.run_clean_tests

    def collect(self, tests):  # noqa: ANN001, ANN202
        nonlocal fresh_stats
        code = collect_stats(self, tests)
        fresh_stats = fresh_stats or (not tests and code == 0)
        return code

    def clean(self, tests):  # noqa: ANN001, ANN202
        return 0 if fresh_stats else run_clean_tests(self, tests)

    ForkRunner.collect_stats, ForkRunner.run_clean_tests = collect, clean
    mm.cli(["run", *argv])


def run_mutmut(names: list[str], max_children: int, limit_s: float) -> bool:
    """`mutmut run NAMES` in a child process, interrupted at the time limit. Returns whether it was cut off."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--mutmut-run", "--max-children", str(max_children), *names]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        proc.wait(timeout=limit_s)
        if proc.returncode not in (0, None):
            print(f"mutmut exited with {proc.returncode}", file=sys.stderr)
        return False
    except subprocess.TimeoutExpired:
        print("\n-- time limit reached: stopping mutmut --", flush=True)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return True
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        proc.wait()
        raise


def report(sample: list[str], cut_off: bool, started: datetime, elapsed_s: float, command: str) -> str:
    status = dict((name, st) for st, name in verdicts())
    picked = {name: status.get(name, "not checked") for name in sample}
    counts = Counter(picked.values())
    killed = sum(n for st, n in counts.items() if st in KILLED)
    survivors = sorted(name for name, st in picked.items() if st == "survived")
    untested = sorted(name for name, st in picked.items() if st == "no tests")
    other = sorted(name for name, st in picked.items() if st not in KILLED | {"survived", "no tests"})
    checked = len(picked) - counts.get("not checked", 0)
    lines = [
        f"mutation testing, {started:%Y-%m-%d %H:%M}, {elapsed_s / 60:.1f} min{' (cut off at the time limit)' if cut_off else ''}",
        f"command: {command}",
        f"sampled {len(picked)} mutants; verdicts: " + ", ".join(f"{st} {n}" for st, n in sorted(counts.items())),
        f"kill rate: {killed}/{len(picked)} = {100 * killed / max(1, len(picked)):.1f}% of the sample"
        + (f" ({killed}/{checked} = {100 * killed / max(1, checked):.1f}% of those checked)" if checked < len(picked) else ""),
    ]
    lines += ["by package (killed / checked):", *scores(picked, package_of),
              "by module (killed / checked):", *scores(picked, module_of)]
    for title, names in (("survived", survivors), ("no tests call the mutated function", untested),
                         ("other (not checked, suspicious, segfault, ...)", other)):
        if names:
            lines += ["", f"== {title}: {len(names)} =="]
            for name in names:
                lines += [f"-- {name} [{picked[name]}]"] + ([diff(name)] if picked[name] != "not checked" else [])
    return "\n".join(lines) + "\n"


def ensure_mutmut() -> None:
    """Install the pinned mutmut (the `mutation` extra) into this environment when it is missing."""
    from importlib import metadata

    try:
        if metadata.version("mutmut").startswith("3."):
            return
    except metadata.PackageNotFoundError:
        pass
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", ".[mutation]"], cwd=ROOT, check=True)


def main(argv: list[str] | None = None) -> int:
    ensure_mutmut()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="mutant names or globs: run these (with --sample, a sample of them)")
    ap.add_argument("--sample", type=int, default=None,
                    help="how many mutants to sample (0: all; default 300, or all those NAMES match)")
    ap.add_argument("--per-package", type=int, default=0, metavar="N",
                    help="sample N mutants from each package (of those NAMES match, if given) instead")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    ap.add_argument("--time-limit", type=float, default=60.0, help="minutes before mutmut is stopped (default 60)")
    ap.add_argument("--max-children", type=int, default=max(1, min(2, os.cpu_count() or 1)),
                    help="mutants tested at once (default: up to 2)")
    ap.add_argument("--reuse", action="store_true", help="keep mutants/ and mutmut's stats from the last run")
    ap.add_argument("--list", action="store_true", help="only print the sampled mutant names")
    args = ap.parse_args(argv)

    os.chdir(ROOT)
    started, t0 = datetime.now(), time.monotonic()
    if not args.reuse and Path("mutants").exists():
        shutil.rmtree("mutants")
    everything = generate()
    pool, size = everything, 300 if args.sample is None else args.sample
    if args.names:  # the mutants they match; a sample of those only with --sample
        import fnmatch

        pool = [n for n in everything if any(fnmatch.fnmatchcase(n, p) for p in args.names)]
        size = args.sample or 0
    if args.per_package:  # the same number from each package (all of a smaller one), so that each has a score
        rng, sample = random.Random(args.seed), []
        for package in sorted({package_of(n) for n in pool}):
            names = [n for n in pool if package_of(n) == package]
            sample += rng.sample(names, args.per_package) if args.per_package < len(names) else names
        sample.sort()
    else:
        sample = sorted(random.Random(args.seed).sample(pool, size)) if 0 < size < len(pool) else pool
    per_file = Counter(module_of(n) for n in sample)
    print(f"{len(everything)} mutants in all; testing {len(sample)}: "
          + ", ".join(f"{k} {v}" for k, v in sorted(per_file.items())), flush=True)
    if args.list:
        print("\n".join(sample))
        return 0
    if not sample:
        print("no mutant matches", file=sys.stderr)
        return 2

    limit_s = args.time_limit * 60 - (time.monotonic() - t0)
    cut_off = run_mutmut(sample, args.max_children, limit_s)
    command = "python tests/tools/mutation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(sample, cut_off, started, time.monotonic() - t0, command.strip())
    Path("mutants/mutation-report.txt").write_text(text)
    print()
    print(text)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--mutmut-run"]:
        mutmut_run(sys.argv[2:])
    sys.exit(main())

"""The course: one assignment per component, graded by one command (walkthrough/README.md).

    python -m nanodspark.course list
    python -m nanodspark.course start UNIT DIR          # UNIT may be `all`
    python -m nanodspark.course test UNIT [--student DIR] [--quick] [-- PYTEST ARGS]
    python -m nanodspark.course grade [--student DIR] [--units a,b] [--quick]

(`nanodspark/course.py` hands its arguments to `main` here; `python -m nanodspark.lab.course`
is the same command.)

The idea
    The reference implementation is the assignment. A student's part of a component is marked
    in the reference file by two comment lines,

        # BEGIN STUDENT verify: the leading run of accepted drafts and the token after it
        ...reference code...
        # END STUDENT verify

    and the starter is generated from the reference (`starter_text`): every region of the unit
    is replaced by one statement that fails with the hint, `raise NotImplementedError("unit
    verify: implement the leading run of ...")` (inside a `@triton.jit` kernel, a
    `tl.static_assert(False, ...)` that the compiler and the interpreter both raise). There is
    no second copy of the code to keep in sync: change the reference, and the starter follows.
    `start` writes the starter into the student's folder at the file's own path
    (`DIR/nanodspark/verify.py`); `test` runs the unit's tests with the student's files in
    place of the reference's (course_runner.py swaps the modules, so the engine itself runs the
    student's code too); `grade` prints a score per unit: tests passed over tests run.

Invariants
    * Markers are comment lines only, so the reference runs unchanged. Regions sit inside
      function bodies, never around a `def` or at module level, so a starter imports.
    * Tests reach a unit only through its public names (no private state), so any
      implementation that keeps the contract passes; every graded test runs code of its unit's
      regions, so a fresh starter scores 0 and the reference full marks (tests/test_course.py
      asserts both on each unit's quick tests; `-m slow` on every test).
    * A unit is one `Unit` entry below: its name (the marker's), chapter, graded tests and a
      quick subset. Its files are the ones whose markers name it.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("nanodspark", "kernels")          # where student regions may live (the core, not the lab)
RUNNER = Path(__file__).with_name("course_runner.py")
BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN STUDENT (?P<unit>[a-z][a-z0-9_-]*)(?::\s*(?P<hint>.*\S))?\s*$")
END = re.compile(r"^\s*# END STUDENT (?P<unit>[a-z][a-z0-9_-]*)\s*$")
MORE = re.compile(r"^\s*#   +(?P<hint>\S.*?)\s*$")   # a hint continues on comment lines indented 3+ spaces


@dataclass(frozen=True)
class Unit:
    name: str                    # as in the markers
    title: str
    chapter: str                 # the walkthrough chapter with its Task section
    tests: tuple[str, ...]       # graded pytest node ids (a test function id covers its parameters)
    quick: tuple[str, ...]       # a fast subset for CI: each test hits only this unit's regions


UNITS: tuple[Unit, ...] = (
    Unit("paged-kv", "paged KV: block pool, prefix cache by hash chain, rollback, window release",
         "walkthrough/02_paged_kv.md",
         ("tests/test_paged_kv_contract.py",),
         ("tests/test_paged_kv_contract.py::test_prefix_hit_shares_full_blocks_and_caps_at_the_last_token",)),
    Unit("swa-replay", "SWA bounded replay: where a prefill starts after a prefix hit",
         "walkthrough/02_paged_kv.md",
         ("tests/test_swa_replay.py::test_plan_replay",
          "tests/test_swa_replay.py::test_exact_replay_equals_cold_prefill_and_bounded_replay_drift_is_measured"),
         ("tests/test_swa_replay.py::test_plan_replay",)),
    Unit("drafter", "the block drafter: parallel block pass, Markov head, confidence head",
         "walkthrough/05_drafter_verify.md",
         ("tests/test_drafter.py::test_paged_inference_equals_dense_training_path",
          "tests/test_drafter.py::test_context_is_strictly_before_the_anchor",
          "tests/test_drafter.py::test_markov_head_conditions_each_slot_on_the_sampled_previous_token",
          "tests/test_drafter.py::test_sts_temperature_scales_the_confidence",
          "tests/test_drafter.py::test_dflash_baseline_has_no_markov_or_confidence",
          "tests/test_drafter.py::test_batched_training_attention_equals_one_sequence_at_a_time"),
         ("tests/test_drafter.py::test_paged_inference_equals_dense_training_path",)),
    Unit("verify", "lossless verification: greedy and rejection sampling, one request and a batch",
         "walkthrough/05_drafter_verify.md",
         ("tests/test_verify_contract.py",
          "tests/test_verify.py::test_accept_sampling_matches_target_on_one_position",
          "tests/test_verify.py::test_cap_accept_commits_what_compact_would",
          "tests/test_verify.py::test_residual_is_renormalised",
          "tests/test_verify.py::test_greedy_spec_equals_target_only",
          "tests/test_verify.py::test_sampling_spec_follows_target_distribution"),
         ("tests/test_verify_contract.py::test_greedy_rows_accept_the_leading_matches",)),
    Unit("sts", "STS calibration: ECE, temperatures fitted left to right, their application",
         "walkthrough/06_calibration.md",
         ("tests/test_calibration.py::test_ece_hand_computed",
          "tests/test_calibration.py::test_sts_recovers_known_temperatures_and_lowers_ece",
          "tests/test_calibration.py::test_sts_with_shifts_removes_an_offset_that_temperatures_cannot",
          "tests/test_calibration.py::test_sts_identity_when_already_calibrated",
          "tests/test_calibration.py::test_sts_position_without_samples_keeps_identity",
          "tests/test_calibration.py::test_apply_temperatures_keeps_dtype_device_and_identity",
          "tests/test_calibration.py::test_position_metrics_use_only_valid_rows",
          "tests/test_calibration.py::test_online_metrics_match_batch_ece",
          "tests/test_calibration.py::test_ece_noise_floor_tracks_sampling_noise"),
         ("tests/test_calibration.py::test_ece_hand_computed",
          "tests/test_calibration.py::test_sts_position_without_samples_keeps_identity")),
    Unit("cost-scheduler", "the cost scheduler: Algorithm 1, the lagged budget, top-K windows",
         "walkthrough/07_cost_scheduler.md",
         ("tests/test_cost_scheduler.py::test_algorithm1_hand_example",
          "tests/test_cost_scheduler.py::test_algorithm1_stops_at_first_non_improvement",
          "tests/test_cost_scheduler.py::test_algorithm1_tie_break_lower_position_then_request",
          "tests/test_cost_scheduler.py::test_algorithm1_skips_zero_survival_and_admits_all_when_free",
          "tests/test_cost_scheduler.py::test_appendix_a_counterexample_exact",
          "tests/test_cost_scheduler.py::test_topk_window_iff_in_top_k_and_contiguous",
          "tests/test_cost_scheduler.py::test_topk_admission_of_x_k_ignores_what_depends_on_x_k",
          "tests/test_cost_scheduler.py::test_topk_tie_break_examples",
          "tests/test_cost_scheduler.py::test_topk_on_gpu_matches_cpu_without_host_sync",
          "tests/test_cost_scheduler.py::test_budget_hand_example_and_min_gain_guard",
          "tests/test_cost_scheduler.py::test_budget_is_a_global_search",
          "tests/test_cost_scheduler.py::test_budget_flat_cost_gives_full_budget",
          "tests/test_cost_scheduler.py::test_budget_drops_tiny_survivals",
          "tests/test_cost_scheduler.py::test_scheduler_compact_uses_lagged_budget_and_fresh_windows",
          "tests/test_cost_scheduler.py::test_scheduler_cap_accept_verifies_full_blocks"),
         ("tests/test_cost_scheduler.py::test_algorithm1_hand_example",
          "tests/test_cost_scheduler.py::test_topk_tie_break_examples",
          "tests/test_cost_scheduler.py::test_budget_hand_example_and_min_gain_guard")),
    Unit("kernel", "the Triton paged attention kernel: key range, paged online softmax, split-KV merge",
         "walkthrough/03_kernels.md",
         ("tests/test_kernels.py::test_paged_attention_matches_reference",
          "tests/test_kernels.py::test_paged_attention_random",
          "tests/test_kernels.py::test_split_and_single_pass_agree"),
         ("tests/test_kernels.py::test_paged_attention_matches_reference[verify_mixed_gqa1-{dev}]",
          "tests/test_kernels.py::test_paged_attention_matches_reference[more_splits_than_tiles-{dev}]")),
    Unit("ragged-graphs", "ragged CUDA-graph tiers: packing rows on the device, tiers, picking one",
         "walkthrough/10_ragged_graphs.md",
         ("tests/test_ragged_graphs.py::test_pack_rows_lays_requests_out_contiguously_and_pads_the_rest",
          "tests/test_ragged_graphs.py::test_tiers_fix_slots_and_tokens_and_the_smallest_fitting_one_is_picked",
          "tests/test_ragged_graphs.py::test_padded_tiers_give_the_unpadded_result"),
         ("tests/test_ragged_graphs.py::test_pack_rows_lays_requests_out_contiguously_and_pads_the_rest",
          "tests/test_ragged_graphs.py::test_tiers_fix_slots_and_tokens_and_the_smallest_fitting_one_is_picked")),
    Unit("overlap", "the overlapped step: launch step n+1, then commit step n",
         "walkthrough/11_overlap_loop.md",
         ("tests/test_overlap_loop.py",),
         ("tests/test_overlap_loop.py::test_the_step_launches_the_next_one_before_it_commits_this_one",)),
    Unit("eplb", "EPLB placement: pack groups to nodes, replicate hot experts, pack replicas to GPUs",
         "walkthrough/12_eplb.md",
         ("tests/test_eplb.py::test_balanced_packing_largest_first_into_the_lightest_pack_with_room",
          "tests/test_eplb.py::test_balanced_packing_fills_every_pack_exactly",
          "tests/test_eplb.py::test_replicate_experts_gives_each_extra_slot_to_the_most_loaded_per_replica",
          "tests/test_eplb.py::test_replicate_experts_minimises_the_largest_load_per_replica",
          "tests/test_eplb.py::test_readme_example_is_reproduced_up_to_order_within_a_gpu",
          "tests/test_eplb.py::test_global_policy_on_the_readme_loads_puts_two_replicas_of_one_expert_on_one_gpu",
          "tests/test_eplb.py::test_random_loads_keep_every_invariant",
          "tests/test_eplb.py::test_balancedness_after_placement_is_at_least_before_on_skewed_loads",
          "tests/test_eplb.py::test_logits_do_not_depend_on_the_placement",
          "tests/test_eplb.py::test_greedy_output_is_unchanged_by_rebalancing_mid_generation"),
         ("tests/test_eplb.py::test_balanced_packing_largest_first_into_the_lightest_pack_with_room",
          "tests/test_eplb.py::test_replicate_experts_gives_each_extra_slot_to_the_most_loaded_per_replica",
          "tests/test_eplb.py::test_readme_example_is_reproduced_up_to_order_within_a_gpu")),
)


def unit(name: str) -> Unit:
    for u in UNITS:
        if u.name == name:
            return u
    raise SystemExit(f"no unit {name!r}; units: {', '.join(u.name for u in UNITS)}")


def _device_id() -> str:
    """The parametrisation id of the device in tests that run on `cpu` or `cuda`."""
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:       # pragma: no cover
        return "cpu"


def test_ids(u: Unit, quick: bool = False) -> list[str]:
    ids = u.quick if quick else u.tests
    return [t.replace("{dev}", _device_id()) for t in ids]


# ----------------------------------------------------------------------------- regions and starters
@dataclass(frozen=True)
class Region:
    unit: str
    path: str            # relative to the repository root
    begin: int           # 1-based line of the BEGIN marker
    body: int            # 1-based first line after the marker and its hint's continuation lines
    end: int             # 1-based line of the END marker
    indent: str
    hint: str
    jit: bool            # inside a @triton.jit function: the starter uses tl.static_assert


def _jit_function_lines(source: str) -> list[tuple[int, int]]:
    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list):
            spans.append((node.lineno, node.end_lineno))
    return spans


def regions_in(path: Path) -> list[Region]:
    """The student regions of one file, checked: balanced, not nested, each with a hint."""
    text = path.read_text()
    rel = path.relative_to(ROOT).as_posix()
    if "# BEGIN STUDENT" not in text:
        return []
    jit_spans = _jit_function_lines(text)
    out, open_ = [], None
    for i, line in enumerate(text.splitlines(), 1):
        b, e = BEGIN.match(line), END.match(line)
        if b:
            if open_ is not None:
                raise ValueError(f"{rel}:{i}: region inside the region opened at line {open_[0]}")
            if not b.group("hint"):
                raise ValueError(f"{rel}:{i}: a BEGIN STUDENT marker needs a hint: '# BEGIN STUDENT unit: what to write'")
            open_ = [i, b, [b.group("hint")], i + 1]
        elif open_ is not None and open_[3] == i and MORE.match(line):
            open_[2].append(MORE.match(line).group("hint"))       # the hint goes on
            open_[3] = i + 1
        elif e:
            if open_ is None or open_[1].group("unit") != e.group("unit"):
                raise ValueError(f"{rel}:{i}: END STUDENT {e.group('unit')} without its BEGIN")
            j, b0, hint, body = open_
            out.append(Region(b0.group("unit"), rel, j, body, i, b0.group("indent"), " ".join(hint),
                              any(lo < j and i <= hi for lo, hi in jit_spans)))
            open_ = None
        elif "STUDENT" in line and re.search(r"#\s*(BEGIN|END)\s+STUDENT", line):
            raise ValueError(f"{rel}:{i}: malformed marker: {line.strip()!r}")
    if open_ is not None:
        raise ValueError(f"{rel}:{open_[0]}: BEGIN STUDENT without END")
    return out


def all_regions() -> list[Region]:
    out = []
    for d in SOURCE_DIRS:
        for p in sorted((ROOT / d).rglob("*.py")):
            if "lab" not in p.relative_to(ROOT).parts:
                out.extend(regions_in(p))
    return out


def unit_files(name: str) -> list[str]:
    return sorted({r.path for r in all_regions() if r.unit == name})


def failure_message(u: Unit, r: Region) -> str:
    return f"unit {u.name}: implement {r.hint} ({r.path}, see {u.chapter})"


def starter_text(path: str, name: str) -> str:
    """The reference file `path` with every region of unit `name` replaced by a failing stub."""
    u = unit(name)
    lines = (ROOT / path).read_text().splitlines(keepends=True)
    regions = [r for r in regions_in(ROOT / path) if r.unit == name]
    for r in sorted(regions, key=lambda r: r.begin, reverse=True):
        msg = json.dumps(failure_message(u, r))
        stub = (f"{r.indent}tl.static_assert(False, {msg})\n" if r.jit
                else f"{r.indent}raise NotImplementedError({msg})\n")
        lines[r.body - 1:r.end - 1] = [stub]
    text = "".join(lines)
    ast.parse(text)          # a starter always parses
    return text


def module_name(path: str) -> str:
    return path[:-3].replace("/", ".")


# ----------------------------------------------------------------------------- running tests
def run_tests(names: list[str], student: Path | None, quick: bool = False, timeout: float = 1800,
              capture: bool = True, extra: list[str] = ()) -> dict:
    """Run the tests of units `names` in one pytest process, with the student's files of those
    units (if `student`) in place of the reference's. Returns {"exit_code", "results": {nodeid:
    {"outcome", "message"}}, "seconds", "output"}."""
    swap = {}
    if student is not None:
        for n in names:
            for f in unit_files(n):
                p = Path(student, f).resolve()
                if not p.exists():
                    raise FileNotFoundError(f"{p} does not exist: run `python -m nanodspark.course "
                                            f"start {n} {student}` first")
                swap[module_name(f)] = str(p)
    ids = [t for n in names for t in test_ids(unit(n), quick)]
    with tempfile.TemporaryDirectory() as tmp:
        swap_json, result_json = Path(tmp, "swap.json"), Path(tmp, "result.json")
        swap_json.write_text(json.dumps(swap))
        cmd = [sys.executable, str(RUNNER), str(swap_json), str(result_json), "--",
               "-p", "no:cacheprovider", "--tb=short", *extra, *ids]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout, text=True,
                              stdout=subprocess.PIPE if capture else None,
                              stderr=subprocess.STDOUT if capture else None)
        seconds = time.perf_counter() - t0
        if not result_json.exists():
            raise RuntimeError(f"pytest did not finish (exit {proc.returncode}):\n{proc.stdout or ''}")
        res = json.loads(result_json.read_text())
    res.update(seconds=seconds, output=proc.stdout or "")
    return res


def results_of(u: Unit, res: dict, quick: bool = False) -> dict[str, dict]:
    """The results of `res` that belong to unit u's test ids (a function id covers its parameters)."""
    ids = test_ids(u, quick)
    return {k: v for k, v in res["results"].items()
            if any(k == i or k.startswith(i + "[") or k.startswith(i + "::") for i in ids)}


def score(results: dict[str, dict]) -> tuple[int, int]:
    """(passed, counted): skipped tests count neither way."""
    counted = [r for r in results.values() if r["outcome"] != "skipped"]
    return sum(r["outcome"] == "passed" for r in counted), len(counted)


def hints_seen(u: Unit, results: dict[str, dict]) -> list[str]:
    """The unit's "implement ..." messages that the failures show, in region order (a message
    the reports show otherwise than verbatim, e.g. through a compiler, is cut at a quote)."""
    known = [failure_message(u, r) for r in all_regions() if r.unit == u.name]
    seen = [m for m in known if any(m in r["message"] for r in results.values())]
    pat = re.compile(rf"unit {re.escape(u.name)}: implement [^\n\"']*")
    for r in results.values():
        for m in pat.findall(r["message"]):
            if m not in seen and not any(k.startswith(m) for k in seen):
                seen.append(m)
    return seen


# ----------------------------------------------------------------------------- commands
def cmd_list(args) -> int:
    regions = all_regions()
    for u in UNITS:
        files = sorted({r.path for r in regions if r.unit == u.name})
        n = sum(r.unit == u.name for r in regions)
        print(f"{u.name:15s} {u.title}")
        print(f"{'':15s} {n} region(s) in {', '.join(files) or '(none yet)'}; {len(test_ids(u))} test id(s); "
              f"chapter {u.chapter}")
    return 0


def task_text(u: Unit, student: Path) -> str:
    regions = [r for r in all_regions() if r.unit == u.name]
    lines = [f"# Unit {u.name}: {u.title}", "",
             f"Read {u.chapter} (walkthrough/README.md lists the units), then fill in the regions",
             "below, each between its `# BEGIN STUDENT` and `# END STUDENT` lines. Keep every name",
             "the starter already has: the tests and the engine call them.", ""]
    where = {}                                   # the BEGIN lines of the starter, file by file
    for f in sorted({r.path for r in regions}):
        where[f] = [i for i, line in enumerate(starter_text(f, u.name).splitlines(), 1)
                    if (m := BEGIN.match(line)) and m.group("unit") == u.name]
    seen: dict[str, int] = {}
    for r in regions:
        k = seen[r.path] = seen.get(r.path, -1) + 1
        lines.append(f"* `{r.path}` (line {where[r.path][k]}): {r.hint}")
    lines += ["", "Test your work (the engine runs your code in place of the reference's):", "",
              f"    python -m nanodspark.course test {u.name} --student {student}", "",
              "and see the score:", "",
              f"    python -m nanodspark.course grade --student {student} --units {u.name}", ""]
    return "\n".join(lines)


def cmd_start(args) -> int:
    names = [u.name for u in UNITS] if args.unit == "all" else [unit(args.unit).name]
    dest = Path(args.dir)
    for n in names:
        files = unit_files(n)
        if not files:
            print(f"unit {n}: no student regions in the reference yet", file=sys.stderr)
            continue
        for f in files:
            out = dest / f
            if out.exists() and not args.force:
                print(f"{out} exists (your work?); pass --force to overwrite it", file=sys.stderr)
                return 1
        for f in files:
            out = dest / f
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(starter_text(f, n))
            print(f"wrote {out}")
        (dest / f"{n}.md").write_text(task_text(unit(n), dest))
        print(f"wrote {dest / (n + '.md')}")
    return 0


def cmd_test(args) -> int:
    u = unit(args.unit)
    student = Path(args.student) if args.student else None
    res = run_tests([u.name], student, args.quick, capture=False, extra=args.pytest_args)
    passed, counted = score(results_of(u, res, args.quick))
    who = f"{args.student}" if student else "the reference"
    print(f"\nunit {u.name} ({who}): {passed}/{counted} tests passed in {res['seconds']:.0f} s")
    for h in hints_seen(u, results_of(u, res, args.quick)):
        print(f"  still to do: {h}")
    return 0 if counted and passed == counted else 1


def cmd_grade(args) -> int:
    names = args.units.split(",") if args.units else [u.name for u in UNITS]
    student = Path(args.student) if args.student else None
    rows, report = [], {}
    for n in names:
        u = unit(n)
        if not unit_files(n):
            rows.append((n, 0, 0, "no regions yet"))
            continue
        if student is not None and not all((student / f).exists() for f in unit_files(n)):
            rows.append((n, 0, len(test_ids(u, args.quick)), "not started"))
            continue
        res = run_tests([n], student, args.quick, timeout=args.timeout)
        r = results_of(u, res, args.quick)
        passed, counted = score(r)
        report[n] = r
        todo = hints_seen(u, r)
        first = todo[0][len(f"unit {n}: implement "):] if todo else ""
        rows.append((n, passed, counted, f"{res['seconds']:.0f} s"
                     + (f"; to do: {first[:60]}{'...' if len(first) > 60 else ''}" if todo else "")))
        if args.verbose and passed < counted:
            print(res["output"])
    who = args.student or "the reference"
    print(f"grade of {who}{' (quick tests)' if args.quick else ''}:")
    print(f"{'unit':15s} {'passed':>9s} {'score':>6s}  notes")
    total = []
    for n, p, c, note in rows:
        s = 100.0 * p / c if c else 0.0
        total.append(s)
        print(f"{n:15s} {p:>4d}/{c:<4d} {s:>6.0f}  {note}")
    print(f"{'total':15s} {'':9s} {sum(total) / max(1, len(total)):>6.0f}  (mean of the units)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "results": report}, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nanodspark.course", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the units, their regions, tests and chapters")
    s = sub.add_parser("start", help="write a unit's starter files into DIR")
    s.add_argument("unit", help="a unit name, or `all`")
    s.add_argument("dir")
    s.add_argument("--force", action="store_true", help="overwrite files already in DIR")
    t = sub.add_parser("test", help="run a unit's tests (on DIR's files with --student)")
    t.add_argument("unit")
    t.add_argument("--student", metavar="DIR")
    t.add_argument("--quick", action="store_true", help="only the unit's quick tests")
    t.epilog = "Arguments after `--` go to pytest, e.g. `-- -x -k decode`."
    g = sub.add_parser("grade", help="a score per unit")
    g.add_argument("--student", metavar="DIR")
    g.add_argument("--units", help="comma-separated unit names (default: all)")
    g.add_argument("--quick", action="store_true")
    g.add_argument("--timeout", type=float, default=1800, help="seconds per unit")
    g.add_argument("--json", help="write the rows and per-test results here")
    g.add_argument("-v", "--verbose", action="store_true", help="print pytest's output of units that lose points")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []     # the rest goes to pytest
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args = build_parser().parse_args(argv)
    args.pytest_args = extra
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    return {"list": cmd_list, "start": cmd_start, "test": cmd_test, "grade": cmd_grade}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

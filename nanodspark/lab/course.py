"""The course: one assignment per component, handed out with one command and graded with another.

    python -m nanodspark.course list
    python -m nanodspark.course export UNIT DIR          # or: export --all DIR
    python -m nanodspark.course test UNIT [--quick] [-- PYTEST ARGS]      # in the student's tree
    python -m nanodspark.course grade [--student DIR ...] [--units a,b] [--out results.json]

The idea
    The reference is the assignment. A student's part of a component is a region of the
    reference between two comment lines, `# BEGIN STUDENT verify accept-greedy` and
    `# END STUDENT verify`; what to write there is said once, in the unit's handout
    (walkthrough/course/UNIT.md, "What to write": one bullet per region id). `export` copies
    the repository without its history, without what is the instructor's (the hidden tests,
    the answer keys, the course's own tests) and with every region of the units replaced,
    wherever it occurs, by a statement that fails with the hint: `raise NotImplementedError(
    "unit verify, region accept-greedy: ...")` (in a `@triton.jit` kernel, a
    `tl.static_assert(False, ...)`). A chapter quoting region code marks it with
    `<!-- BEGIN STUDENT unit -->` / `<!-- END STUDENT unit -->`, and the quote goes too.
    `grade` (course_runner.py) runs the student's regions in the instructor's copy.

Invariants
    * Markers are comment lines only, so the reference runs unchanged; regions sit inside
      function bodies, so a starter imports; region ids are unique within a file.
    * Every graded test runs code of its unit's regions (a starter scores 0) and reaches the
      unit through public names (another implementation of the contract passes).
    * A unit's tests need no other unit's reference beyond `needs` (units its engine-level tests
      run); a unit's points are its groups' weights and add up to 100.
    * Hidden groups live in tests/hidden/: run by `grade`, never exported.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("nanodspark", "kernels")      # where regions may live (the core, not the lab)
HANDOUTS = "walkthrough/course"
KEYS = "walkthrough/course/key"              # answer keys: the instructor's
HIDDEN = "tests/hidden"                      # hidden tests: the instructor's
MANIFEST = ".course.json"                    # written into an export: its units, its starters' outside code
BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN STUDENT (?P<unit>[a-z][a-z0-9-]*) (?P<rid>[a-z][a-z0-9-]*)\s*$")
END = re.compile(r"^[ \t]*# END STUDENT (?P<unit>[a-z][a-z0-9-]*)\s*$")
ANY_MARKER = re.compile(r"#\s*(BEGIN|END)\s+STUDENT")
MD_BEGIN = re.compile(r"^<!-- BEGIN STUDENT (?P<unit>[a-z][a-z0-9-]*) -->\s*$")
MD_END = re.compile(r"^<!-- END STUDENT (?P<unit>[a-z][a-z0-9-]*) -->\s*$")
HINT = re.compile(r"^- \*\*(?P<rid>[a-z][a-z0-9-]*)\*\* (?P<text>.*\S)\s*$")   # a bullet of "What to write"


def instructor_only(rel: str) -> bool:
    """Paths that never leave the instructor's copy."""
    return (rel.startswith((HIDDEN + "/", KEYS + "/")) or rel == MANIFEST
            or re.fullmatch(r"tests/test_course(_\w+)?\.py", rel) is not None)


# ----------------------------------------------------------------------------- units
@dataclass(frozen=True)
class Group:
    name: str
    points: int
    tests: tuple[str, ...]       # pytest node ids; a function's id covers its parameters
    hidden: bool = False         # in tests/hidden/: run by grade only


@dataclass(frozen=True)
class Unit:
    name: str                    # as in the markers
    title: str
    chapter: str                 # the walkthrough chapter that teaches it
    groups: tuple[Group, ...]
    quick: tuple[str, ...]       # a fast subset of the visible tests (CI, `test --quick`)
    needs: tuple[str, ...] = ()  # units whose reference its engine-level tests run

    @property
    def handout(self) -> str:
        return f"{HANDOUTS}/{self.name}.md"

    def test_ids(self, hidden: bool = True, quick: bool = False) -> list[str]:
        if quick:
            return [_dev(t) for t in self.quick]
        return [_dev(t) for g in self.groups if hidden or not g.hidden for t in g.tests]


def _ids(prefix: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{prefix}::{n}" if n else prefix for n in names)


_V, _VC, _VH = "tests/test_verify.py", "tests/test_verify_contract.py", "tests/hidden/test_hidden_verify.py"
_P, _PH = "tests/test_paged_kv_contract.py", "tests/hidden/test_hidden_paged_kv.py"
_C, _CH = "tests/test_cost_scheduler.py", "tests/hidden/test_hidden_cost_scheduler.py"

UNITS: tuple[Unit, ...] = (
    Unit("paged-kv", "paged KV: block pool, prefix cache by hash chain, rollback, window release",
         "walkthrough/02_paged_kv.md", (
             Group("pool, tables and cache indices", 10, _ids(_P, "test_allocation_reserves_whole_blocks_and_cache_indices_follow_the_table")),
             Group("prefix cache: hits on a shared prefix", 35, _ids(
                 _P, "test_prefix_hit_shares_full_blocks_and_caps_at_the_last_token", "test_a_hit_needs_the_whole_chain",
                 "test_a_hash_collision_is_not_a_hit", "test_commit_publishes_only_full_committed_blocks_from_any_offset",
                 "test_the_first_publisher_of_a_prefix_keeps_it", "test_a_released_published_block_stays_cached",
                 "test_a_hit_takes_its_block_off_the_free_list", "test_without_the_prefix_cache_nothing_is_shared")),
             Group("refusals change nothing", 10, _ids(_P, "test_a_refused_prompt_changes_nothing",
                                                        "test_free_hit_blocks_count_as_taken",
                                                        "test_ensure_capacity_grows_and_fails_atomically")),
             Group("rollback, window release, eviction order", 15, _ids(
                 _P, "test_truncate_frees_the_blocks_of_rejected_drafts", "test_release_outside_window",
                 "test_free_then_evict_unpublished_first_then_least_recently_freed")),
             Group("random sequences of calls (a state machine)", 15, _ids(_P, "test_paged_kv_public_state_machine")),
             Group("hidden: prefix hits against a model of the cache", 15, _ids(_PH, ""), hidden=True)),
         quick=_ids(_P, "test_prefix_hit_shares_full_blocks_and_caps_at_the_last_token")),
    Unit("swa-replay", "SWA bounded replay: where a prefill starts after a prefix hit",
         "walkthrough/13_swa_replay.md", (
             Group("the replay plan", 50, _ids("tests/test_swa_replay.py", "test_plan_replay")),
             Group("exact replay equals a cold prefill (engine)", 30, _ids(
                 "tests/test_swa_replay.py", "test_exact_replay_equals_cold_prefill_and_bounded_replay_drift_is_measured")),
             Group("hidden: plans against the definition", 20,
                   _ids("tests/hidden/test_hidden_swa_replay.py", ""), hidden=True)),
         quick=_ids("tests/test_swa_replay.py", "test_plan_replay"),
         needs=("paged-kv", "ragged-graphs")),
    Unit("drafter", "the block drafter: parallel block pass, Markov head, confidence head",
         "walkthrough/05_drafter_verify.md", (
             Group("the paged block pass equals the dense training pass", 25, _ids(
                 "tests/test_drafter.py", "test_paged_inference_equals_dense_training_path",
                 "test_batched_training_attention_equals_one_sequence_at_a_time")),
             Group("the context is strictly before the anchor, from kv_start", 15, _ids(
                 "tests/test_drafter.py", "test_context_is_strictly_before_the_anchor",
                 "test_the_block_reads_no_context_below_its_kv_start")),
             Group("the Markov head", 20, _ids(
                 "tests/test_drafter.py", "test_markov_head_conditions_each_slot_on_the_sampled_previous_token")),
             Group("the confidence head and its temperatures", 15, _ids(
                 "tests/test_drafter.py", "test_sts_temperature_scales_the_confidence",
                 "test_dflash_baseline_has_no_markov_or_confidence")),
             Group("hidden: the heads against their formulas", 25,
                   _ids("tests/hidden/test_hidden_drafter.py", ""), hidden=True)),
         quick=_ids("tests/test_drafter.py", "test_paged_inference_equals_dense_training_path")),
    Unit("verify", "lossless verification: greedy and rejection sampling, one request and a batch",
         "walkthrough/05_drafter_verify.md", (
             Group("one request, on host values", 10, _ids(
                 _V, "test_accept_sampling_matches_target_on_one_position", "test_cap_accept_commits_what_compact_would",
                 "test_residual_is_renormalised")),
             Group("a batch: greedy rows and the bounds", 15, _ids(
                 _VC, "test_greedy_rows_accept_the_leading_matches", "test_nothing_past_the_verified_drafts_is_accepted")),
             Group("a batch: sampled rows follow the target's law", 15, _ids(
                 _VC, "test_sampled_rows_commit_the_target_law_whatever_the_draft",
                 "test_a_row_depends_on_its_seed_and_position_only")),
             Group("an oracle's drafts are accepted in full, in every mode", 20, _ids(
                 _VC, "test_an_oracle_draft_is_accepted_in_full_in_every_mode")
                   + _ids(_V, "test_greedy_spec_equals_target_only[True-static]",
                          "test_greedy_spec_equals_target_only[True-compact]",
                          "test_greedy_spec_equals_target_only[True-cap-accept]")),
             Group("the engine: greedy output equals target-only", 10, _ids(
                 _V, "test_greedy_spec_equals_target_only[False-static]",
                 "test_greedy_spec_equals_target_only[False-compact]",
                 "test_greedy_spec_equals_target_only[False-cap-accept]")),
             Group("the engine: sampled output follows the target's law", 10, _ids(
                 _V, "test_sampling_spec_follows_target_distribution[static]",
                 "test_sampling_spec_follows_target_distribution[compact-forced]")),
             Group("coupled rows commit the target's own sample", 10, _ids(
                 _VC, "test_coupled_rows_commit_the_targets_own_sample")
                   + _ids(_V, "test_coupled_sampling_gives_target_only_tokens")),
             Group("hidden: more batches against the one-request rules", 10, _ids(_VH, ""), hidden=True)),
         quick=_ids(_VC, "test_greedy_rows_accept_the_leading_matches"),
         needs=("paged-kv", "swa-replay", "drafter", "ragged-graphs")),
    Unit("sts", "STS calibration: ECE, temperatures (and shifts) fitted left to right",
         "walkthrough/06_calibration.md", (
             Group("ECE", 25, _ids("tests/test_calibration.py", "test_ece_hand_computed", "test_position_metrics_use_only_valid_rows",
                                   "test_online_metrics_match_batch_ece", "test_ece_noise_floor_tracks_sampling_noise")),
             Group("the left-to-right fit", 55, _ids(
                 "tests/test_calibration.py", "test_sts_recovers_known_temperatures_and_lowers_ece",
                 "test_sts_with_shifts_removes_an_offset_that_temperatures_cannot",
                 "test_sts_identity_when_already_calibrated", "test_sts_position_without_samples_keeps_identity")),
             Group("hidden: ECE and the fit against brute force", 20,
                   _ids("tests/hidden/test_hidden_sts.py", ""), hidden=True)),
         quick=_ids("tests/test_calibration.py", "test_ece_hand_computed", "test_sts_position_without_samples_keeps_identity")),
    Unit("cost-scheduler", "the cost scheduler: Algorithm 1, the lagged budget, the device top-K",
         "walkthrough/07_cost_scheduler.md", (
             Group("Algorithm 1", 20, _ids(
                 _C, "test_algorithm1_hand_example", "test_algorithm1_stops_at_first_non_improvement",
                 "test_algorithm1_tie_break_lower_position_then_request",
                 "test_algorithm1_skips_zero_survival_and_admits_all_when_free")),
             Group("Appendix A: the early stop keeps the law", 10, _ids(_C, "test_appendix_a_counterexample_exact")),
             Group("the device top-K against Algorithm 1's order", 25, _ids(
                 _C, "test_topk_window_iff_in_top_k_and_contiguous", "test_topk_admission_of_x_k_ignores_what_depends_on_x_k",
                 "test_topk_tie_break_examples", "test_choose_windows_trims_with_trim_only_and_caps_every_window",
                 "test_topk_on_gpu_matches_cpu_without_host_sync")),
             Group("the lagged budget: trims where the table says", 20, _ids(
                 _C, "test_budget_hand_example_and_min_gain_guard", "test_budget_is_a_global_search",
                 "test_budget_flat_cost_gives_full_budget", "test_budget_drops_tiny_survivals")),
             Group("the scheduler, step by step", 10, _ids(
                 _C, "test_scheduler_compact_uses_lagged_budget_and_fresh_windows",
                 "test_scheduler_skips_the_search_where_no_trim_can_pass_the_guard",
                 "test_scheduler_cap_accept_verifies_full_blocks")),
             Group("hidden: random tables against brute force", 15, _ids(_CH, ""), hidden=True)),
         quick=_ids(_C, "test_algorithm1_hand_example", "test_topk_tie_break_examples",
                    "test_budget_hand_example_and_min_gain_guard")),
    Unit("kernel", "the Triton paged attention kernel: key range, paged online softmax, split-KV merge",
         "walkthrough/03_kernels.md", (
             Group("named cases against the reference", 35, _ids(
                 "tests/test_kernels.py", "test_paged_attention_matches_reference")),
             Group("random cases against the reference", 20, _ids("tests/test_kernels.py", "test_paged_attention_random")),
             Group("split-KV and one pass agree", 15, _ids("tests/test_kernels.py", "test_split_and_single_pass_agree")),
             Group("the fixed (batch-invariant) schedule", 10, _ids(
                 "tests/test_batch_invariance.py", "test_fixed_schedule_matches_the_reference_on_ragged_batches")),
             Group("hidden: more shapes", 20, _ids("tests/hidden/test_hidden_kernel.py", ""), hidden=True)),
         quick=_ids("tests/test_kernels.py", "test_paged_attention_matches_reference[verify_mixed_gqa1-{dev}]",
                    "test_paged_attention_matches_reference[more_splits_than_tiles-{dev}]")),
    Unit("ragged-graphs", "ragged CUDA-graph tiers: packing rows on the device, tiers, picking one",
         "walkthrough/10_ragged_graphs.md", (
             Group("packing rows", 30, _ids(
                 "tests/test_ragged_graphs.py", "test_pack_rows_lays_requests_out_contiguously_and_pads_the_rest")),
             Group("tiers and picking one", 30, _ids(
                 "tests/test_ragged_graphs.py", "test_tiers_fix_slots_and_tokens_and_the_smallest_fitting_one_is_picked")),
             Group("padded tiers give the unpadded result (engine)", 20, _ids(
                 "tests/test_ragged_graphs.py", "test_padded_tiers_give_the_unpadded_result")),
             Group("hidden: random batches against a loop", 20,
                   _ids("tests/hidden/test_hidden_ragged_graphs.py", ""), hidden=True)),
         quick=_ids("tests/test_ragged_graphs.py", "test_pack_rows_lays_requests_out_contiguously_and_pads_the_rest",
                    "test_tiers_fix_slots_and_tokens_and_the_smallest_fitting_one_is_picked"),
         needs=("paged-kv", "swa-replay", "drafter", "verify")),
    Unit("overlap", "the overlapped step: launch step n+1, then commit step n",
         "walkthrough/11_overlap_loop.md", (
             Group("the order of launches and commits", 40, _ids(
                 "tests/test_overlap_loop.py", "test_the_step_launches_the_next_one_before_it_commits_this_one",
                 "test_a_drain_commits_the_step_in_flight_before_scheduling_again",
                 "test_every_launched_step_is_committed_once_in_order")),
             Group("the engine: what the synchronous step commits", 40, _ids(
                 "tests/test_overlap_loop.py", "test_the_overlapped_loop_commits_what_the_synchronous_one_does",
                 "test_a_poisoned_speculative_request_fails_alone_in_the_overlapped_loop",
                 "test_eplb_closes_one_step_per_window_row_in_the_overlapped_loop",
                 "test_a_stream_leaves_the_overlapped_engine_idle")),
             Group("hidden: random schedules against the overlapped order", 20,
                   _ids("tests/hidden/test_hidden_overlap.py", ""), hidden=True)),
         quick=_ids("tests/test_overlap_loop.py", "test_the_step_launches_the_next_one_before_it_commits_this_one"),
         needs=("paged-kv", "swa-replay", "drafter", "verify", "ragged-graphs", "eplb")),
    Unit("eplb", "EPLB placement: pack groups to nodes, replicate hot experts, pack replicas to GPUs",
         "walkthrough/12_eplb.md", (
             Group("balanced packing", 20, _ids(
                 "tests/test_eplb.py", "test_balanced_packing_largest_first_into_the_lightest_pack_with_room",
                 "test_balanced_packing_fills_every_pack_exactly")),
             Group("replicating hot experts", 20, _ids(
                 "tests/test_eplb.py", "test_replicate_experts_gives_each_extra_slot_to_the_most_loaded_per_replica",
                 "test_replicate_experts_minimises_the_largest_load_per_replica")),
             Group("the hierarchical placement", 25, _ids(
                 "tests/test_eplb.py", "test_readme_example_is_reproduced_up_to_order_within_a_gpu",
                 "test_global_policy_on_the_readme_loads_puts_two_replicas_of_one_expert_on_one_gpu",
                 "test_random_loads_keep_every_invariant",
                 "test_balancedness_after_placement_is_at_least_before_on_skewed_loads")),
             Group("the engine: placement changes no logit", 15, _ids(
                 "tests/test_eplb.py", "test_logits_do_not_depend_on_the_placement",
                 "test_greedy_output_is_unchanged_by_rebalancing_mid_generation")),
             Group("hidden: random loads against brute force", 20,
                   _ids("tests/hidden/test_hidden_eplb.py", ""), hidden=True)),
         quick=_ids("tests/test_eplb.py", "test_balanced_packing_largest_first_into_the_lightest_pack_with_room",
                    "test_replicate_experts_gives_each_extra_slot_to_the_most_loaded_per_replica",
                    "test_readme_example_is_reproduced_up_to_order_within_a_gpu"),
         needs=("paged-kv", "swa-replay", "verify", "ragged-graphs")),
)


def unit(name: str) -> Unit:
    for u in UNITS:
        if u.name == name:
            return u
    raise SystemExit(f"no unit {name!r}; units: {', '.join(u.name for u in UNITS)}")


def _dev(node: str) -> str:
    """Fill in the device of tests parametrised by it (`{dev}`): cuda where there is one."""
    if "{dev}" not in node:
        return node
    try:
        import torch
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:       # pragma: no cover
        dev = "cpu"
    return node.replace("{dev}", dev)


# ----------------------------------------------------------------------------- regions and hints
@dataclass(frozen=True)
class Region:
    unit: str
    rid: str
    path: str            # relative to the root of its tree
    begin: int           # 1-based line of the BEGIN marker
    end: int             # 1-based line of the END marker
    indent: str
    jit: bool            # inside a @triton.jit function: the stub is a tl.static_assert

    @property
    def key(self) -> tuple[str, str]:
        return self.unit, self.rid


def _jit_spans(source: str) -> list[tuple[int, int]]:
    return [(n.lineno, n.end_lineno) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and any("jit" in ast.unparse(d) for d in n.decorator_list)]


def parse_regions(text: str, rel: str) -> list[Region]:
    """The regions of one Python file, checked: balanced, not nested, one line per marker, ids
    unique in the file. Raises ValueError naming the line."""
    if "STUDENT" not in text:
        return []
    spans = _jit_spans(text) if "jit" in text else []
    out, open_, seen = [], None, set()
    for i, line in enumerate(text.splitlines(), 1):
        b, e = BEGIN.match(line), END.match(line)
        if b:
            if open_ is not None:
                raise ValueError(f"{rel}:{i}: a region inside the region opened at line {open_[0]}")
            if (b.group("unit"), b.group("rid")) in seen:
                raise ValueError(f"{rel}:{i}: region {b.group('unit')} {b.group('rid')} twice in one file")
            seen.add((b.group("unit"), b.group("rid")))
            open_ = (i, b)
        elif e:
            if open_ is None or open_[1].group("unit") != e.group("unit"):
                raise ValueError(f"{rel}:{i}: END STUDENT {e.group('unit')} without its BEGIN")
            j, b0 = open_
            out.append(Region(b0.group("unit"), b0.group("rid"), rel, j, i, b0.group("indent"),
                              any(lo < j and i <= hi for lo, hi in spans)))
            open_ = None
        elif ANY_MARKER.search(line):
            raise ValueError(f"{rel}:{i}: malformed marker {line.strip()!r} (write '# BEGIN STUDENT unit "
                             "region-id' and '# END STUDENT unit' on lines of their own)")
    if open_ is not None:
        raise ValueError(f"{rel}:{open_[0]}: BEGIN STUDENT without END")
    return out


def regions_in_file(rel: str, root: Path = ROOT) -> list[Region]:
    return parse_regions((root / rel).read_text(), rel)


def region_files(root: Path = ROOT) -> list[str]:
    out = []
    for d in SOURCE_DIRS:
        for p in sorted((root / d).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            if "/lab/" not in rel and "STUDENT" in p.read_text():
                out.append(rel)
    return out


def all_regions(root: Path = ROOT) -> list[Region]:
    return [r for f in region_files(root) for r in parse_regions((root / f).read_text(), f)]


def unit_files(name: str, root: Path = ROOT) -> list[str]:
    return sorted({r.path for r in all_regions(root) if r.unit == name})


def hints(name: str, root: Path = ROOT) -> dict[str, str]:
    """region id -> what to write, from the handout's "What to write" bullets (a bullet may go on
    over lines indented by two spaces)."""
    path = root / HANDOUTS / f"{name}.md"
    if not path.exists():
        return {}
    out, rid, section = {}, None, False
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            section, rid = line.strip() == "## What to write", None
            continue
        if not section:
            continue
        m = HINT.match(line)
        if m:
            rid = m.group("rid")
            out[rid] = m.group("text")
        elif rid and line.startswith("  ") and line.strip():
            out[rid] += " " + line.strip()
        else:
            rid = None
    return out


def stub_message(r: Region, root: Path = ROOT) -> str:
    hint = hints(r.unit, root).get(r.rid, "see the handout")
    return f"unit {r.unit}, region {r.rid}: {hint} ({HANDOUTS}/{r.unit}.md)"


def render(text: str, rel: str, units, bodies: dict | None = None, root: Path = ROOT, check: bool = True) -> str:
    """`text` (a file at `rel`) with the body of every region of `units` replaced: by
    bodies[(unit, rid)] (a list of lines) where given, else by the failing stub."""
    lines = text.splitlines(keepends=True)
    for r in sorted((r for r in parse_regions(text, rel) if r.unit in units), key=lambda r: -r.begin):
        body = (bodies or {}).get(r.key)
        if body is None:
            msg = json.dumps(stub_message(r, root))
            body = [f"{r.indent}tl.static_assert(False, {msg})\n" if r.jit
                    else f"{r.indent}raise NotImplementedError({msg})\n"]
        lines[r.begin:r.end - 1] = body
    out = "".join(lines)
    if check:
        ast.parse(out)       # a starter always parses (SyntaxError names the line)
    return out


def starter_text(path: str, name: str, root: Path = ROOT) -> str:
    return render((root / path).read_text(), path, {name}, root=root)


def bodies_of(text: str, rel: str) -> dict[tuple[str, str], list[str]]:
    """(unit, rid) -> the lines between the markers of each region of a file."""
    lines = text.splitlines(keepends=True)
    return {r.key: lines[r.begin:r.end - 1] for r in parse_regions(text, rel)}


def outside_hash(text: str, rel: str) -> str:
    """A hash of a file without its region bodies: what the grader takes from the instructor."""
    lines = text.splitlines(keepends=True)
    for r in sorted(parse_regions(text, rel), key=lambda r: -r.begin):
        del lines[r.begin:r.end - 1]
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:16]


def strip_markdown(text: str, units) -> str:
    """A chapter with the quotes of the units' region code (between <!-- BEGIN/END STUDENT unit
    --> lines) replaced by a pointer to the handout."""
    out, skip = [], None
    for line in text.splitlines(keepends=True):
        b, e = MD_BEGIN.match(line), MD_END.match(line)
        if b and b.group("unit") in units:
            skip = b.group("unit")
            out.append(f"*(Code of your assignment, unit `{skip}`: see {HANDOUTS}/{skip}.md.)*\n")
        elif e and skip == e.group("unit"):
            skip = None
        elif skip is None:
            out.append(line)
    return "".join(out)


# ----------------------------------------------------------------------------- export
def tree_files(root: Path = ROOT) -> list[str]:
    """The files of the tree: git's (tracked, and untracked ones it does not ignore) in a
    checkout, else every file but caches and environments."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
                             capture_output=True, text=True, check=True).stdout
        return sorted(f for f in out.split("\0") if f and (root / f).is_file())
    except (subprocess.CalledProcessError, FileNotFoundError):
        skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis"}
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                      if p.is_file() and not skip & set(p.relative_to(root).parts)
                      and not p.name.endswith(".egg-info"))


def export(names: list[str], dest: Path, force: bool = False, root: Path = ROOT) -> dict:
    """Write the students' tree for units `names` into dest; returns its manifest."""
    for n in names:
        unit(n)
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()) and not force:
        raise SystemExit(f"{dest} is not empty; pass --force to write into it")
    units, manifest = set(names), {"units": list(names), "outside": {}}
    regions = [r for r in all_regions(root) if r.unit in units]
    region_paths = {r.path for r in regions}
    for rel in tree_files(root):
        if instructor_only(rel):
            continue
        src, out = root / rel, dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if rel in region_paths:
            text = render(src.read_text(), rel, units, root=root)
            out.write_text(text)
            manifest["outside"][rel] = outside_hash(text, rel)
        elif rel.endswith(".md") and "<!-- BEGIN STUDENT" in (t := src.read_text()):
            out.write_text(strip_markdown(t, units))
        else:
            shutil.copy2(src, out)
    (dest / "ASSIGNMENT.md").write_text(assignment_text(names, dest))
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def assignment_text(names: list[str], dest: Path) -> str:
    lines = ["# Your assignment", "",
             "This tree is nanodspark with the code of your unit(s) taken out. For each unit, read its",
             "handout, then write the code between the markers listed below. Write **only** between a",
             "region's `# BEGIN STUDENT` and `# END STUDENT` lines: the grader takes what is between them",
             "and nothing else of your files (put imports and helper functions inside the region).", ""]
    for n in names:
        u = unit(n)
        lines += [f"## Unit `{n}`: {u.title}", "", f"Handout: [{u.handout}]({u.handout}); chapter: {u.chapter}.",
                  "", "| file | line | region |", "|---|---|---|"]
        for r in (r for r in all_regions(dest) if r.unit == n):
            lines.append(f"| `{r.path}` | {r.begin} | `{r.rid}` |")
        if u.needs:
            lines += ["", f"Its engine-level tests also run {', '.join(f'`{x}`' for x in u.needs)}: "
                      "if you exported those too, do them first."]
        lines += ["", "```bash", f"python -m nanodspark.course test {n}                  # its tests, in this tree",
                  f"python -m nanodspark.course grade --student . --units {n}   # its score without the hidden tests",
                  "```", ""]
    lines += ["Submit the files named above (or this whole folder): your instructor grades them with",
              "`python -m nanodspark.course grade --student YOUR_FOLDER`.", ""]
    return "\n".join(lines)


def read_manifest(tree: Path) -> dict | None:
    p = Path(tree) / MANIFEST
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def outside_changes(tree: Path) -> list[str]:
    """Files of an exported tree whose code outside the regions differs from the export's."""
    m = read_manifest(tree) or {}
    changed = []
    for rel, h in m.get("outside", {}).items():
        p = Path(tree) / rel
        try:
            if outside_hash(p.read_text(), rel) != h:
                changed.append(rel)
        except (OSError, ValueError):
            changed.append(rel)
    return changed


# ----------------------------------------------------------------------------- commands
def cmd_list(args) -> int:
    regions = all_regions()
    for u in UNITS:
        files = sorted({r.path for r in regions if r.unit == u.name})
        n = sum(r.unit == u.name for r in regions)
        hidden = sum(g.points for g in u.groups if g.hidden)
        print(f"{u.name:15s} {u.title}")
        print(f"{'':15s} {n} region(s) in {', '.join(files) or '(none)'}; {len(u.groups)} test groups "
              f"({hidden} of 100 points hidden); handout {u.handout}"
              + (f"; needs {', '.join(u.needs)}" if u.needs else ""))
    return 0


def cmd_export(args) -> int:
    names = [u.name for u in UNITS] if args.all else [unit(n).name for n in args.units]
    if not names:
        raise SystemExit("name a unit (or pass --all)")
    export(names, Path(args.dir), args.force)
    print(f"wrote {args.dir}: units {', '.join(names)}; start with {Path(args.dir) / 'ASSIGNMENT.md'}")
    return 0


def cmd_test(args) -> int:
    from .course_runner import print_rows, run_pytest, score_groups, todo
    u = unit(args.unit)
    for rel in outside_changes(ROOT):
        print(f"note: {rel} changed outside its regions; the grader uses only what is between the markers",
              file=sys.stderr)
    hidden = (ROOT / HIDDEN).is_dir() and not args.quick
    ids = u.test_ids(hidden=hidden, quick=args.quick)
    run = run_pytest(ROOT, ids, capture=False, extra=args.pytest_args)
    rows = score_groups(u, run.results, expected=None, hidden=hidden)
    print()
    print_rows(u.name, rows)
    for m in todo(u, run.results):
        print(f"  still to do: {m}")
    return 0 if rows and all(r["score"] == r["max_score"] for r in rows) else 1


def cmd_grade(args) -> int:
    from .course_runner import grade_many
    return grade_many(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m nanodspark.course", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the units: regions, test groups, handouts")
    e = sub.add_parser("export", help="write a students' tree: the repository without the units' code")
    e.add_argument("units", nargs="*", metavar="UNIT")
    e.add_argument("dir", metavar="DIR")
    e.add_argument("--all", action="store_true", help="every unit")
    e.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    t = sub.add_parser("test", help="run a unit's tests in this tree, with its score per group")
    t.add_argument("unit")
    t.add_argument("--quick", action="store_true", help="only the unit's quick tests")
    t.epilog = "Arguments after `--` go to pytest, e.g. `-- -x -k greedy`."
    g = sub.add_parser("grade", help="grade students' folders in the instructor's copy; writes results.json")
    g.add_argument("--student", nargs="+", metavar="DIR",
                   help="students' folders (default: the reference, which must score 100)")
    g.add_argument("--units", help="comma-separated units (default: the folder's .course.json, else all)")
    g.add_argument("--out", help="results file (one student; default DIR/results.json)")
    g.add_argument("--pass-mark", type=float, default=60.0, help="percent below which grade exits 1 (60)")
    g.add_argument("--quick", action="store_true", help="only the quick tests")
    g.add_argument("--no-hidden", action="store_true", help="leave the hidden tests out")
    g.add_argument("--together", action="store_true",
                   help="one pytest run for all units (faster; a unit's engine tests then run the student's other units)")
    g.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run (1800)")
    g.add_argument("-v", "--verbose", action="store_true", help="print pytest's output")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []     # the rest goes to pytest
    argv = argv[:argv.index("--")] if "--" in argv else argv
    args = build_parser().parse_args(argv)
    args.pytest_args = extra
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    return {"list": cmd_list, "export": cmd_export, "test": cmd_test, "grade": cmd_grade}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

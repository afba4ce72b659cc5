"""One results file from the archives of `measure.sh api` (or `apis`, or `ttft`) calls.

`api`: each call's HTTP rounds (`http_SIDE_ROUND.json`) and its in-process run (`engine.json`)
become rows, and a summary per call, side and concurrency: the median tok/s of the rounds, and
each round's tok/s over the in-process tok/s of the same call (median, min, max). `ttft`: the
runs of one call, as rows. Unpack each call's `$OUT/STAGE.tgz` first:

    python tests/device/api_summary.py api CALL1/api CALL2/api CALL3/api --out benchmarks/api_lean_h200.json
    python tests/device/api_summary.py ttft CALL/ttft --out benchmarks/ttft_split_h200.json
    python tests/device/api_summary.py apis CALL1/apis CALL2/apis --commits A B --out benchmarks/api_servers_h200.json

`apis`: the same rows per side (n1, n2, n4: `--api-server-count`), with the rounds' two-client runs
at 256 (`two_SIDE_ROUND_a/b.json`, 128 streams each) summed into one row with clients = 2.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics as st
import sys

HEAD = {"device": "NVIDIA H200", "host": "16-core host of the device machine", "torch": "2.11.0+cu130",
        "triton": "3.6.0", "python": "3.12.3", "weights": "the default pair (trained), drafter on, static windows"}
TTFT_RUNS = ("http_waits_auto", "http_waits_0", "engine", "one_client", "two_a", "two_b")


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(st.median(xs), 2) if xs else None


def _row(r: dict, command: str, **extra) -> dict:
    return {**extra, "concurrency": r["concurrency"], "total_tok_s": r["total_tok_s"],
            "per_user_tok_s": r["per_user_tok_s"], "ttft_p50_ms": round(r["ttft_ms"]["p50"], 1),
            "ttft_mean_ms": round(r["ttft_ms"]["mean"], 1), "server_ms": r.get("server_ms"),
            "api_cpu_share": r.get("api_cpu_share"), "client_cpu_share": r.get("client_cpu_share"),
            "command": command}


def api(dirs: list[str]) -> dict:
    out = {"benchmark": "serve.py's API process before (06ab263) and after (the lean stream path), over HTTP "
                        f"beside the engine in-process, {len(dirs)} calls", **HEAD,
           "command": "bash tests/device/measure.sh api   (carry: .whl, .carry/shared, .carry/old = git archive of "
                      "06ab263; call 2 also .carry/swi: sitecustomize.py with sys.setswitchinterval(0.0005)); then "
                      "python tests/device/api_summary.py api " + " ".join(f"CALL{i + 1}/api" for i in range(len(dirs))),
           "method": "both (three) servers up at once, each warmed by an unmeasured 4 s run at 256, then rounds "
                     "old new [swi swi] new old; each round one 6 s window after 2 s at 256, then at 64; the engine "
                     "in-process after the servers stopped, same call",
           "runs": [], "engine": [], "summary": []}
    for call, d in enumerate(dirs, 1):
        for f in sorted(glob.glob(os.path.join(d, "http_*.json"))):
            side, rnd = os.path.basename(f)[5:-5].split("_")
            j = json.load(open(f))
            out["runs"] += [_row(r, j["command"], call=str(call), side=side, round=int(rnd)) for r in j["runs"]]
        j = json.load(open(os.path.join(d, "engine.json")))
        out["engine"] += [{"call": str(call), "concurrency": r["concurrency"], "total_tok_s": r["total_tok_s"],
                           "ttft_p50_ms": round(r["ttft_ms"]["p50"], 1), "command": j["command"]} for r in j["runs"]]
    for call in range(1, len(dirs) + 1):
        for side in ("old", "new", "swi"):
            for c in (64, 256):
                rs = [r for r in out["runs"] if (r["call"], r["side"], r["concurrency"]) == (str(call), side, c)]
                if not rs:
                    continue
                eng = next(e["total_tok_s"] for e in out["engine"] if (e["call"], e["concurrency"]) == (str(call), c))
                ratios = [r["total_tok_s"] / eng for r in rs]
                out["summary"].append({
                    "call": str(call), "side": side, "concurrency": c, "rounds": len(rs),
                    "total_tok_s": round(st.median(r["total_tok_s"] for r in rs), 1), "in_process_tok_s": eng,
                    "over_in_process": round(st.median(ratios), 3), "over_in_process_min": round(min(ratios), 3),
                    "over_in_process_max": round(max(ratios), 3),
                    "ttft_p50_ms": round(st.median(r["ttft_p50_ms"] for r in rs), 1),
                    "first_token_after_submit_ms": _median((r["server_ms"] or {}).get("first_token_after_submit")
                                                           for r in rs),
                    "api_cpu_share": _median(r["api_cpu_share"] for r in rs)})
    return out


def apis(dirs: list[str], commits: list[str]) -> dict:
    out = {"benchmark": "serve.py with 1, 2 and 4 API processes (--api-server-count) on one engine core, over HTTP "
                        f"beside the engine in-process, {len(dirs)} calls", **HEAD,
           "commits": {str(i + 1): c for i, c in enumerate(commits)},
           "command": "bash tests/device/measure.sh apis   (carry: .whl, .carry with shared/data); then "
                      "python tests/device/api_summary.py apis " + " ".join(f"CALL{i + 1}/apis" for i in range(len(dirs)))
                      + " --commits " + " ".join(commits),
           "method": "the three servers up at once, each warmed by an unmeasured 4 s run at 256, then rounds n1 n2 n4 n4 "
                     "n2 n1; each round one 6 s window after 2 s at 256, then at 64, from one client process, then "
                     "(when present) at 256 from two client processes of 128 streams at once; the engine in-process "
                     "after the servers stopped, same call",
           "runs": [], "engine": [], "summary": []}
    for call, d in enumerate(dirs, 1):
        for f in sorted(glob.glob(os.path.join(d, "http_*.json"))):
            side, rnd = os.path.basename(f)[5:-5].split("_")
            j = json.load(open(f))
            out["runs"] += [_row(r, j["command"], call=str(call), side=side, round=int(rnd), clients=1)
                            for r in j["runs"]]
        for f in sorted(glob.glob(os.path.join(d, "two_*_a.json"))):
            side, rnd, _ = os.path.basename(f)[4:-5].split("_")
            a, b = (json.load(open(f.replace("_a.json", x)))["runs"][0] for x in ("_a.json", "_b.json"))
            row = _row(a, json.load(open(f))["command"].replace("--concurrency 128", "--concurrency 128 (x2)"),
                       call=str(call), side=side, round=int(rnd), clients=2)
            row.update(concurrency=256, total_tok_s=round(a["total_tok_s"] + b["total_tok_s"], 2),
                       per_user_tok_s=round((a["per_user_tok_s"] + b["per_user_tok_s"]) / 2, 2),
                       ttft_p50_ms=round((a["ttft_ms"]["p50"] + b["ttft_ms"]["p50"]) / 2, 1),
                       client_cpu_share=round((a.get("client_cpu_share") or 0) + (b.get("client_cpu_share") or 0), 3))
            out["runs"].append(row)
        j = json.load(open(os.path.join(d, "engine.json")))
        out["engine"] += [{"call": str(call), "concurrency": r["concurrency"], "total_tok_s": r["total_tok_s"],
                           "ttft_p50_ms": round(r["ttft_ms"]["p50"], 1), "command": j["command"]} for r in j["runs"]]
    for call in range(1, len(dirs) + 1):
        for side in ("n1", "n2", "n4"):
            for c, clients in ((64, 1), (256, 1), (256, 2)):
                rs = [r for r in out["runs"] if (r["call"], r["side"], r["concurrency"], r["clients"]) ==
                      (str(call), side, c, clients)]
                if not rs:
                    continue
                eng = next(e["total_tok_s"] for e in out["engine"] if (e["call"], e["concurrency"]) == (str(call), c))
                ratios = [r["total_tok_s"] / eng for r in rs]
                out["summary"].append({
                    "call": str(call), "side": side, "concurrency": c, "clients": clients, "rounds": len(rs),
                    "total_tok_s": round(st.median(r["total_tok_s"] for r in rs), 1), "in_process_tok_s": eng,
                    "over_in_process": round(st.median(ratios), 3), "over_in_process_min": round(min(ratios), 3),
                    "over_in_process_max": round(max(ratios), 3),
                    "per_user_tok_s": round(st.median(r["per_user_tok_s"] for r in rs), 1),
                    "ttft_p50_ms": round(st.median(r["ttft_p50_ms"] for r in rs), 1),
                    "api_cpu_share": _median(r["api_cpu_share"] for r in rs),
                    "client_cpu_share": _median(r["client_cpu_share"] for r in rs)})
    return out


def ttft(d: str) -> dict:
    out = {"benchmark": "where serve.py's TTFT goes at 256 (the API process of 06ab263, with the engine's queue "
                        "and prefill metrics)", **HEAD,
           "command": "bash tests/device/measure.sh ttft   (carry: .whl, .carry/shared); then "
                      "python tests/device/api_summary.py ttft CALL/ttft", "runs": []}
    for name in TTFT_RUNS:
        j = json.load(open(os.path.join(d, f"{name}.json")))
        out["runs"] += [_row(r, j["command"], run=name) for r in j["runs"]]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=["api", "apis", "ttft"])
    p.add_argument("dirs", nargs="+", help="each call's unpacked $OUT/STAGE folder")
    p.add_argument("--commits", nargs="*", default=[], help="apis: the commit each call ran")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    res = api(a.dirs) if a.stage == "api" else apis(a.dirs, a.commits) if a.stage == "apis" else ttft(a.dirs[0])
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()

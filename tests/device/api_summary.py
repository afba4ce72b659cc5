"""One results file from the archives of `measure.sh api` (or `ttft`) calls.

`api`: each call's HTTP rounds (`http_SIDE_ROUND.json`) and its in-process run (`engine.json`)
become rows, and a summary per call, side and concurrency: the median tok/s of the rounds, and
each round's tok/s over the in-process tok/s of the same call (median, min, max). `ttft`: the
runs of one call, as rows. Unpack each call's `$OUT/STAGE.tgz` first:

    python tests/device/api_summary.py api CALL1/api CALL2/api CALL3/api --out benchmarks/api_lean_h200.json
    python tests/device/api_summary.py ttft CALL/ttft --out benchmarks/ttft_split_h200.json
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
    p.add_argument("stage", choices=["api", "ttft"])
    p.add_argument("dirs", nargs="+", help="each call's unpacked $OUT/STAGE folder")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    res = api(a.dirs) if a.stage == "api" else ttft(a.dirs[0])
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# The measurements of walkthrough/09_results.md §8 (the host-light step, DSpark's thesis) on the
# device, one stage per call, each well inside a call's 10 minutes:
#   carry: [".whl", ".carry/old", ".carry/shared"]     command: bash tests/device/measure.sh STAGE
# .whl: the wheels the image lacks (tests/device/run_suite.sh); .carry/old: the engine before the
# host-light step (nanodspark/ and kernels/ of the commit named in $OUT/old_commit.txt, its assets a
# link to this tree's), run side by side in the same call; .carry/shared: ../shared's data.
#   step     bench host before and after (after: no text in the step, as serve.py's engine core;
#            and with text streamed in the engine), batch 1/64/256, the default pair with its
#            drafter; bench engine: tok/s and GPU busy with and without the drafter, and the engine
#            before (no drafter, batch 256); a timeline at 256
#   serve    serve.py over HTTP (closed loop) beside the engine in-process on the same work
#   thesis   the step-cost profile, then the steady-state sweep no-spec / static / compact / A/A
set -o pipefail
stage=${1:?usage: measure.sh step|serve|thesis}
case $stage in step|serve|thesis) ;; *) echo "unknown stage $stage (step, serve, thesis)" >&2; exit 2 ;; esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONUNBUFFERED=1 NANODSPARK_DATA=$PWD/.carry/shared/data
NEW="env PYTHONPATH=.:/tmp/site python3 -m nanodspark.bench"
OLD="env PYTHONPATH=.carry/old:/tmp/site python3 -m nanodspark.bench"
PAIR=nanodspark/assets/default
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
case $stage in
step)
  for side in old new new-stream; do
    B=$([ $side = old ] && echo "$OLD" || echo "$NEW"); X=$([ $side = new-stream ] && echo --stream-text)
    timeout 100 $B host --batches 1 64 256 --steps 12 --repeats 3 $X > "$OUT/host_$side.txt" 2>&1
    echo "host $side rc=$?"
  done
  timeout 200 $NEW engine --model $PAIR --drafter $PAIR/drafter --systems overlap --batches 1 64 256 \
    --max-tokens 128 --repeats 3 --out "$OUT/engine_new.json" > "$OUT/engine_new.txt" 2>&1
  echo "engine new rc=$?"
  timeout 90 $OLD engine --model $PAIR --systems overlap --batches 256 --max-tokens 128 --repeats 3 \
    --out "$OUT/engine_old.json" > "$OUT/engine_old.txt" 2>&1
  echo "engine old rc=$?"
  timeout 60 $NEW timeline --batch 256 --loops sync overlap --out "$OUT/timeline_256.png" > "$OUT/timeline.txt" 2>&1
  echo "timeline rc=$?"
  grep -h "batch  *256" "$OUT"/host_*.txt; grep -E "^\|" "$OUT/engine_new.txt" | tail -7
  grep -E "^\|" "$OUT/engine_old.txt" | tail -2; tail -3 "$OUT/timeline.txt" ;;
serve)
  timeout 150 $NEW serve --frontend http --spawn --systems no-spec static --concurrency 1 64 256 --warmup-s 3 \
    --duration 8 --out "$OUT/serve_http.json" > "$OUT/serve_http.txt" 2>&1
  echo "serve http rc=$?"
  timeout 120 $NEW serve --frontend engine --systems no-spec static --concurrency 1 64 256 --warmup-s 3 \
    --duration 8 --out "$OUT/serve_engine.json" > "$OUT/serve_engine.txt" 2>&1
  echo "serve engine rc=$?"
  tail -9 "$OUT/serve_http.txt" "$OUT/serve_engine.txt" ;;
thesis)
  timeout 120 $NEW profile --batch-sizes 1 16 64 256 --repeats 2 --out "$OUT/cost_default.json" \
    > "$OUT/profile.txt" 2>&1
  echo "profile rc=$?"
  timeout 240 $NEW serve --frontend engine --systems no-spec static compact static-b --cost-table "$OUT/cost_default.json" \
    --concurrency 1 16 64 256 --warmup-s 2 --duration 6 --budget-s 220 --out "$OUT/thesis_default.json" \
    > "$OUT/thesis.txt" 2>&1
  echo "thesis rc=$?"
  tail -12 "$OUT/profile.txt"; tail -24 "$OUT/thesis.txt" ;;
esac

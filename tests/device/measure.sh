#!/usr/bin/env bash
# The measurements of the results page (the host-light step, DSpark's thesis) on the
# device, one stage per call, each well inside a call's 10 minutes:
#   carry: [".whl", ".carry/old", ".carry/shared"]     command: bash tests/device/measure.sh STAGE
# .whl: the wheels the image lacks (tests/device/run_suite.sh); .carry/old: the engine before the
# host-light step (nanodspark/ and kernels/ of the commit in .carry/old/COMMIT, its assets a link
# to this tree's), run from its own folder (`python -m` puts the working directory first on the
# path) side by side in the same call; .carry/shared: ../shared's data.
#   step     before / after, alternating (A B A B): bench host with no text in the step (before:
#            --offline; after: the default, as serve.py's engine core adds requests) and bench
#            engine without the drafter at 64 and 256; then bench engine with the drafter, bench
#            host with text streamed in the engine (before: what serve.py ran), a timeline at 256
#   serve    serve.py over HTTP (closed loop) beside the engine in-process on the same work
#   api-profile  serve.py's API process under cProfile (tests/device/profile_api.py) while 256
#            closed-loop streams run; the top of the profile, by own time and by cumulative time
#   busy     bench host at batch 1 / 64 / 256, then GPU busy in the overlapped loop at 1 / 64 / 256
#            with and without the drafter (bench engine's profiled steps)
#   overlap  the step-cost profiles timed in the overlapped loop (with and without the drafter), the
#            sweep no-spec / static / compact / A/A on them with traces (the simulator's check), then
#            bench host at 1 / 64 / 256 and GPU busy at 64 / 256 with and without the drafter
#   thesis   the step-cost profiles (with and without the drafter), then the steady-state sweep
#            no-spec / static / compact / A/A with acceptance traces (the simulator's input)
#   waves    the sweep with admission in waves (the default) beside admitting at once, then the
#            step-cost profiles of random-weight Qwen3-8B (TABLE=a default-pair cost table)
#   repeat   no-spec / static / compact / A/A at 64 and 256, two rotating rounds (TABLE as for waves)
#   front    serve.py over HTTP at 64 / 256: before the relay (when .carry/old is carried), this tree's
#            with every body prepared in a worker thread, this tree's default; then the serve stage
#   ttft     where serve.py's TTFT goes at 256: HTTP at 64 / 256 with the server's split (admission in
#            waves, the default, and at once), the engine in-process on the same work, then one
#            server loaded by one client process at 256 and by two at 128 each (is the client the bound?)
#   api      the API process before (.carry/old) and after, side by side: both servers up, each warmed,
#            then c256 and c64 over HTTP in alternating rounds (old new new old), then the engine
#            in-process at 64 / 256 on the same work
#   apis     serve.py with 1, 2 and 4 API processes (--api-server-count) side by side over HTTP at 64 / 256,
#            rounds n1 n2 n4 n4 n2 n1 (each also at 256 from two client processes of 128; TWO=0: not),
#            then the engine in-process on the same work
#   scale    DSpark at paper scale, measured: the Qwen3-8B shape with random weights, its drafts accepted
#            by a synthetic law (each request's rate uniform in LO:HI; LAWS, default 0.3:0.96, tau 2.5):
#            the step-cost profiles in the overlapped loop (unless TABLE names one; SHARES, default
#            "0.25 0.5": also those of the steps where that share drafts), a sweep no-spec / static /
#            compact per law with static's traces (the simulator's input), then the A/A control
#            static / static-b at 64 and 256 (AA=0: not)
#   last     a short thesis sweep, serve.py over HTTP at 64 / 256, GPU busy at 256 (one call's worth;
#            the archive is rewritten after each part, so a cut call still brings back what ran)
# Everything lands in $OUT/STAGE.tgz (a call brings back at most 8 files) and a summary.
set -o pipefail
stage=${1:?usage: measure.sh step|serve|front|api-profile|busy|overlap|thesis|waves|repeat|ttft|api|apis|scale|last}
case $stage in step|serve|front|api-profile|busy|overlap|thesis|waves|repeat|ttft|api|apis|scale|last) ;; *) echo "unknown stage $stage (step, serve, front, api-profile, busy, overlap, thesis, waves, repeat, ttft, api, apis, scale, last)" >&2; exit 2 ;; esac
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONUNBUFFERED=1 NANODSPARK_DATA=$PWD/.carry/shared/data
R=$OUT/$stage; mkdir -p "$R"
new="env PYTHONPATH=.:/tmp/site python3 -m nanodspark.bench"
old="env -C .carry/old PYTHONPATH=.:/tmp/site python3 -m nanodspark.bench"
PAIR=nanodspark/assets/default
up() {      # up DIR PORT [a folder first on PYTHONPATH]: serve.py from DIR on PORT, in the background
  env -C "$1" PYTHONPATH=${3:+$3:}.:/tmp/site python3 serve.py --port "$2" --log-level warning --max-num-seqs 256 \
    --kv-cache-memory-gb 4 --no-enable-prefix-cache > "$R/server_$2.log" 2>&1 &
  pids+=($!)
}
ready() {   # ready PORT: wait for its /health
  python3 -c "import sys, time, urllib.request as u
for _ in range(480):
    try: u.urlopen(sys.argv[1] + '/health', timeout=2); sys.exit(0)
    except OSError: time.sleep(0.5)
sys.exit(1)" "http://127.0.0.1:$1" || echo "the server on $1 did not come up"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$R/gpu.txt"
echo "old: $(cat .carry/old/COMMIT 2>/dev/null); new: $(git rev-parse --short HEAD 2>/dev/null)" | tee "$R/versions.txt"
case $stage in
step)
  for round in 1 2; do
    for side in old new; do
      X=$([ $side = old ] && echo --offline)      # no text in the step: before, LLM.generate's path
      timeout 60 ${!side} host --batches 64 256 --steps 12 --repeats 3 $X > "$R/host_${side}_$round.txt" 2>&1
      echo "host $side $round rc=$?"
    done
  done
  for round in 1 2; do
    for side in old new; do
      timeout 60 ${!side} engine --model $PAIR --systems overlap --batches 64 256 --max-tokens 128 --repeats 3 \
        --out "$R/engine_${side}_$round.json" > "$R/engine_${side}_$round.txt" 2>&1
      echo "engine $side $round rc=$?"
    done
  done
  timeout 90 $new engine --model $PAIR --drafter $PAIR/drafter --systems overlap --batches 64 256 --max-tokens 128 \
    --repeats 3 --out "$R/engine_new_drafter.json" > "$R/engine_new_drafter.txt" 2>&1
  echo "engine new drafter rc=$?"
  timeout 40 $new host --batches 64 256 --steps 12 --repeats 3 --stream-text > "$R/host_new_stream.txt" 2>&1
  timeout 40 $old host --batches 64 256 --steps 12 --repeats 3 > "$R/host_old_stream.txt" 2>&1   # before: serve.py's path
  timeout 50 $new timeline --batch 256 --loops sync overlap --out "$R/timeline_256.png" > "$R/timeline.txt" 2>&1
  echo "timeline rc=$?"
  grep -H "batch  *256" "$R"/host_*.txt
  grep -hE "^\| overlap" "$R"/engine_*.txt ;;
front)
  # serve.py over HTTP at 64 / 256: before the relay (.carry/old, when carried), this tree's with
  # every body prepared in a worker thread (--prepare-inline-bytes 0), and this tree's default;
  # then on into the serve stage
  flags="--port {port} --log-level warning --max-num-seqs 256 --kv-cache-memory-gb 4 --no-enable-prefix-cache {flags}"
  for side in old threads new; do
    dir=$([ $side = old ] && echo .carry/old || echo .)
    [ -d "$dir/nanodspark" ] || continue
    x=$([ $side = threads ] && echo "--prepare-inline-bytes 0")
    timeout 110 $new serve --frontend http --systems static --concurrency 64 256 --warmup-s 3 --duration 6 \
      --serve-cmd "env PYTHONPATH=$dir:/tmp/site python3 $dir/serve.py $flags $x" \
      --out "$R/http_$side.json" > "$R/http_$side.txt" 2>&1
    echo "http $side rc=$?"
  done
  for f in "$R"/http_*.txt; do echo "$f"; tail -n 3 "$f" | head -n 2; done ;&
serve)
  timeout 200 $new serve --frontend http --spawn --systems no-spec static --concurrency 1 16 64 256 --warmup-s 3 \
    --duration 6 --out "$R/serve_http.json" > "$R/serve_http.txt" 2>&1
  echo "serve http rc=$?"
  timeout 110 $new serve --frontend engine --systems no-spec static --concurrency 64 256 --warmup-s 3 \
    --duration 6 --out "$R/serve_engine.json" > "$R/serve_engine.txt" 2>&1
  echo "serve engine rc=$?"
  tail -n 9 "$R/serve_http.txt" "$R/serve_engine.txt" ;;
api-profile)
  timeout 100 $new serve --frontend http --systems static --concurrency 256 --warmup-s 3 --duration 8 \
    --serve-cmd "env PROF_OUT=$R/api.prof PYTHONPATH=.:/tmp/site python3 tests/device/profile_api.py --port {port} --log-level warning --max-num-seqs 256 --kv-cache-memory-gb 4 --no-enable-prefix-cache {flags}" \
    --out "$R/api_profile.json" > "$R/api_profile.txt" 2>&1
  echo "api profile rc=$?"
  python3 -c "import pstats, sys; p = pstats.Stats(sys.argv[1]); p.sort_stats('tottime').print_stats(45); p.sort_stats('cumtime').print_stats('nanodspark|starlette|fastapi|uvicorn', 60)" \
    "$R/api.prof" > "$R/api_stats.txt" 2>&1
  tail -n 3 "$R/api_profile.txt"; head -c 4000 "$R/api_stats.txt" ;;
busy)
  timeout 60 $new host --batches 1 64 256 --steps 12 --repeats 3 --out "$R/host.json" > "$R/host.txt" 2>&1
  echo "host rc=$?"
  timeout 150 $new engine --model $PAIR --drafter $PAIR/drafter --systems overlap --batches 1 64 256 --max-tokens 128 \
    --repeats 2 --out "$R/engine_busy.json" > "$R/engine_busy.txt" 2>&1
  echo "engine rc=$?"
  grep -h "batch" "$R/host.txt"; grep -hE "^\| overlap" "$R/engine_busy.txt" ;;
overlap)
  pack() { tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage"; }
  timeout 110 $new profile --loop overlap --batch-sizes 1 16 64 256 --repeats 2 --out "$R/cost_default.json" \
    > "$R/profile.txt" 2>&1
  echo "profile rc=$?"; pack
  timeout 60 $new profile-plain --loop overlap --batch-sizes 1 16 64 256 --repeats 3 --out "$R/plain_default.json" \
    > "$R/profile_plain.txt" 2>&1
  echo "profile-plain rc=$?"; pack
  timeout 250 $new serve --frontend engine --systems no-spec static compact static-b --cost-table "$R/cost_default.json" \
    --concurrency 1 16 64 256 --warmup-s 2 --duration 5 --budget-s 220 --record-traces "$R/traces" \
    --out "$R/thesis_default.json" > "$R/thesis.txt" 2>&1
  echo "thesis rc=$?"
  rm -f "$R"/traces/no-spec_* "$R"/traces/compact_* "$R"/traces/static-b_*   # the simulator replays static's; $OUT takes 16 MiB a file
  pack
  timeout 45 $new host --batches 1 64 256 --steps 12 --repeats 3 --out "$R/host.json" > "$R/host.txt" 2>&1
  echo "host rc=$?"; pack
  timeout 80 $new engine --model $PAIR --drafter $PAIR/drafter --systems overlap --batches 64 256 --max-tokens 128 \
    --repeats 2 --out "$R/engine_busy.json" > "$R/engine_busy.txt" 2>&1
  echo "engine rc=$?"
  tail -n 8 "$R/profile.txt"; tail -n 20 "$R/thesis.txt"; grep -h "batch" "$R/host.txt"; grep -hE "^\| overlap" "$R/engine_busy.txt" ;;
thesis)
  pack() { tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage"; }
  timeout 130 $new profile --batch-sizes 1 16 64 128 256 --repeats 2 --out "$R/cost_default.json" > "$R/profile.txt" 2>&1
  echo "profile rc=$?"; pack
  timeout 60 $new profile-plain --batch-sizes 1 16 64 128 256 --repeats 3 --out "$R/plain_default.json" \
    > "$R/profile_plain.txt" 2>&1
  echo "profile-plain rc=$?"; pack
  timeout 290 $new serve --frontend engine --systems no-spec static compact static-b --cost-table "$R/cost_default.json" \
    --concurrency 1 16 64 256 --warmup-s 2 --duration 6 --budget-s 230 --record-traces "$R/traces" \
    --out "$R/thesis_default.json" > "$R/thesis.txt" 2>&1
  echo "thesis rc=$?"; pack
  tail -n 12 "$R/profile.txt"; tail -n 24 "$R/thesis.txt" ;;
waves)       # TABLE: a cost table of the default pair (the thesis stage's); the 8B profile after
  pack() { tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage"; }
  timeout 230 $new serve --frontend engine --systems no-spec static compact static-b --cost-table "$TABLE" \
    --concurrency 1 16 64 256 --warmup-s 2 --duration 6 --budget-s 200 --record-traces "$R/traces" \
    --out "$R/thesis_waves.json" > "$R/thesis_waves.txt" 2>&1
  echo "waves rc=$?"; pack
  timeout 90 $new serve --frontend engine --systems no-spec static --max-waiting-steps 0 --concurrency 64 256 \
    --warmup-s 2 --duration 6 --out "$R/thesis_nowaves.json" > "$R/thesis_nowaves.txt" 2>&1
  echo "no waves rc=$?"; pack
  timeout 170 $new profile --shape qwen3-8b --batch-sizes 1 16 64 128 256 --repeats 2 \
    --out "$R/cost_qwen3_8b.json" > "$R/profile_8b.txt" 2>&1
  echo "8b profile rc=$?"; pack
  timeout 60 $new profile-plain --shape qwen3-8b --batch-sizes 1 16 64 128 256 --repeats 3 \
    --out "$R/plain_qwen3_8b.json" > "$R/plain_8b.txt" 2>&1
  echo "8b plain rc=$?"; pack
  tail -n 8 "$R/thesis_waves.txt" "$R/thesis_nowaves.txt"; tail -n 50 "$R/profile_8b.txt" | grep -v "profiling step" ;;
repeat)      # TABLE as for waves: no-spec / static / compact / A/A at 64 and 256, rotating rounds
  pack() { tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage"; }
  timeout 290 $new serve --frontend engine --systems no-spec static compact static-b --cost-table "$TABLE" \
    --concurrency 64 256 --repeats 2 --warmup-s 2 --duration 6 --budget-s 250 \
    --out "$R/thesis_repeat.json" > "$R/thesis_repeat.txt" 2>&1
  echo "repeat rc=$?"; pack
  tail -n 14 "$R/thesis_repeat.txt" ;;
ttft)
  pack() { tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage"; }
  for w in auto 0; do
    timeout 110 $new serve --frontend http --spawn --systems static --concurrency 64 256 --warmup-s 3 --duration 6 \
      --max-waiting-steps $w --out "$R/http_waits_$w.json" > "$R/http_waits_$w.txt" 2>&1
    echo "http waits $w rc=$?"; pack
  done
  timeout 100 $new serve --frontend engine --systems static --concurrency 64 256 --warmup-s 3 --duration 6 \
    --out "$R/engine.json" > "$R/engine.txt" 2>&1
  echo "engine rc=$?"; pack
  port=18731
  up . $port; ready $port
  url="--frontend http --url http://127.0.0.1:$port --systems static --warmup-s 3 --duration 6"
  timeout 40 $new serve $url --concurrency 256 --out "$R/one_client.json" > "$R/one_client.txt" 2>&1
  echo "one client rc=$?"
  timeout 40 $new serve $url --concurrency 128 --out "$R/two_a.json" > "$R/two_a.txt" 2>&1 &
  a=$!
  timeout 40 $new serve $url --concurrency 128 --out "$R/two_b.json" > "$R/two_b.txt" 2>&1
  wait $a
  echo "two clients done"
  kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null; pack
  for f in http_waits_auto http_waits_0 engine one_client two_a two_b; do echo "== $f"; tail -n 9 "$R/$f.txt"; done ;;
api)
  pack() { tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage"; }
  # sides: old (.carry/old), new (this tree) and, when .carry/swi is carried, this tree with its
  # sitecustomize.py first on the path (an interpreter setting tried in both server processes)
  declare -A port=([old]=18701 [new]=18702 [swi]=18703)
  sides="old new"; order="old new new old"
  [ -d .carry/swi ] && sides="old new swi" && order="old new swi swi new old"
  for side in $sides; do
    case $side in old) up .carry/old 18701 ;; new) up . 18702 ;; swi) up . 18703 "$PWD/.carry/swi" ;; esac
  done
  for side in $sides; do ready ${port[$side]}; done
  for side in $sides; do   # warm each: the first seconds of a fresh server are not its steady state
    timeout 40 $new serve --frontend http --url http://127.0.0.1:${port[$side]} --systems static --concurrency 256 \
      --warmup-s 2 --duration 4 > "$R/warm_$side.txt" 2>&1
  done
  round=0
  for side in $order; do
    round=$((round + 1))
    timeout 60 $new serve --frontend http --url http://127.0.0.1:${port[$side]} --systems static --concurrency 256 64 \
      --warmup-s 2 --duration 6 --out "$R/http_${side}_$round.json" > "$R/http_${side}_$round.txt" 2>&1
    echo "http $side round $round rc=$?"; pack
  done
  kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null
  timeout 100 $new serve --frontend engine --systems static --concurrency 256 64 --warmup-s 2 --duration 6 \
    --out "$R/engine.json" > "$R/engine.txt" 2>&1
  echo "engine rc=$?"; pack
  for f in "$R"/http_*.txt "$R/engine.txt"; do echo "== $f"; grep -E "c=|server, mean" "$f"; done ;;
apis)        # serve.py with 1, 2 and 4 API processes (--api-server-count), all up at once and warmed, then
             # rounds n1 n2 n4 n4 n2 n1 over HTTP at 256 and 64, then the engine in-process on the same work
  pack() { tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage"; }
  declare -A port=([n1]=18711 [n2]=18712 [n4]=18714)
  for side in n1 n2 n4; do
    env PYTHONPATH=.:/tmp/site python3 serve.py --port ${port[$side]} --log-level warning --max-num-seqs 256 \
      --kv-cache-memory-gb 4 --no-enable-prefix-cache --api-server-count ${side#n} > "$R/server_$side.log" 2>&1 &
    pids+=($!)
  done
  for side in n1 n2 n4; do ready ${port[$side]}; done
  for side in n1 n2 n4; do
    timeout 40 $new serve --frontend http --url http://127.0.0.1:${port[$side]} --systems static --concurrency 256 \
      --warmup-s 2 --duration 4 > "$R/warm_$side.txt" 2>&1
  done
  round=0
  for side in n1 n2 n4 n4 n2 n1; do
    round=$((round + 1))
    url="--frontend http --url http://127.0.0.1:${port[$side]} --systems static --warmup-s 2 --duration 6"
    timeout 60 $new serve $url --concurrency 256 64 --out "$R/http_${side}_$round.json" > "$R/http_${side}_$round.txt" 2>&1
    echo "http $side round $round rc=$?"
    if [ "${TWO:-1}" = 1 ]; then    # the same server at 256 from two client processes of 128: is one client the bound?
      timeout 40 $new serve $url --concurrency 128 --out "$R/two_${side}_${round}_a.json" > "$R/two_${side}_${round}_a.txt" 2>&1 &
      a=$!
      timeout 40 $new serve $url --concurrency 128 --out "$R/two_${side}_${round}_b.json" > "$R/two_${side}_${round}_b.txt" 2>&1
      wait $a; echo "two clients $side round $round done"
    fi
    pack
  done
  kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null
  echo "server exits: $(grep -l "^error" "$R"/server_*.log 2>/dev/null | wc -l) with an error"
  timeout 100 $new serve --frontend engine --systems static --concurrency 256 64 --warmup-s 2 --duration 6 \
    --out "$R/engine.json" > "$R/engine.txt" 2>&1
  echo "engine rc=$?"; pack
  for f in "$R"/http_*.txt "$R"/two_*.txt "$R/engine.txt"; do echo "== ${f##*/}"; grep -E "c=" "$f"; done ;;
scale)       # LAWS (default 0.3:0.96): a sweep per law of SYSTEMS at CONC; TABLE: a Qwen3-8B cost table (else
             # profiled here, the target's own profile in the same file); AA=0: no A/A; AA_ONLY=1: only it (AA_CONC)
  pack() { tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage"; }
  LAWS=${LAWS:-0.3:0.96}
  if [ -z "$TABLE" ] && [ "${AA_ONLY:-0}" != 1 ]; then
    timeout 100 $new profile --shape qwen3-8b --loop overlap --batch-sizes 1 16 64 128 256 --repeats 1 \
      --out "$R/cost_qwen3_8b.json" > "$R/profile_8b.txt" 2>&1
    echo "8b profile rc=$?"; pack
    timeout 60 $new profile-plain --shape qwen3-8b --loop overlap --batch-sizes 1 16 64 128 256 --repeats 1 \
      --out "$R/cost_qwen3_8b.json" > "$R/plain_8b.txt" 2>&1
    echo "8b plain rc=$?"; pack
    for f in ${SHARES:-0.25 0.5}; do     # the partial steps' own profiles (SHARES="": none)
      timeout 100 $new profile --shape qwen3-8b --loop overlap --batch-sizes 1 16 64 128 256 --repeats 1 \
        --draft-fraction $f --out "$R/cost_qwen3_8b.json" > "$R/share_8b_$f.txt" 2>&1
      echo "8b share $f rc=$?"; pack
    done
    TABLE=$R/cost_qwen3_8b.json
  fi
  for LAW in $LAWS; do
    [ "${AA_ONLY:-0}" = 1 ] && break
    S8="--shape qwen3-8b --synthetic-acceptance $LAW --prompt-tokens 128 --output-len 96 --kv-gb 12 --warmup-s 2"
    tag=${LAW/:/-}
    timeout 260 $new serve $S8 --systems ${SYSTEMS:-no-spec static compact} --cost-table "$TABLE" \
      --concurrency ${CONC:-1 16 64 128 256} --duration 5 --warmup-round-s 2 --budget-s 225 --record-traces "/tmp/tr_$tag" \
      --out "$R/scale_8b_$tag.json" > "$R/scale_8b_$tag.txt" 2>&1
    echo "8b sweep $LAW rc=$?"
    mkdir -p "$R/traces_$tag" && cp /tmp/tr_$tag/static_* "$R/traces_$tag/" 2>/dev/null; pack
    tail -n 18 "$R/scale_8b_$tag.txt"
  done
  if [ "${AA:-1}" = 1 ]; then
    S8="--shape qwen3-8b --synthetic-acceptance ${LAWS%% *} --prompt-tokens 128 --output-len 96 --kv-gb 12 --warmup-s 2"
    timeout 120 $new serve $S8 --systems static static-b --concurrency ${AA_CONC:-64 256} --duration 5 --warmup-round-s 2 \
      --out "$R/aa_8b.json" > "$R/aa_8b.txt" 2>&1
    echo "8b A/A rc=$?"; pack
    tail -n 8 "$R/aa_8b.txt"
  fi ;;
last)
  pack() { tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage"; }
  timeout 75 $new profile --batch-sizes 16 64 256 --repeats 2 --out "$R/cost_default.json" > "$R/profile.txt" 2>&1
  echo "profile rc=$?"; pack
  timeout 150 $new serve --frontend engine --systems no-spec static compact static-b --cost-table "$R/cost_default.json" \
    --concurrency 16 64 256 --warmup-s 2 --duration 5 --budget-s 130 --out "$R/thesis_default.json" \
    > "$R/thesis.txt" 2>&1
  echo "thesis rc=$?"; pack
  timeout 75 $new serve --frontend http --spawn --systems no-spec static --concurrency 64 256 --warmup-s 2 \
    --duration 5 --out "$R/serve_http.json" > "$R/serve_http.txt" 2>&1
  echo "serve http rc=$?"; pack
  timeout 40 $new engine --model $PAIR --drafter $PAIR/drafter --systems overlap --batches 256 --max-tokens 128 \
    --repeats 2 --out "$R/engine_busy.json" > "$R/engine_busy.txt" 2>&1
  echo "engine rc=$?"
  tail -n 6 "$R/profile.txt"; tail -n 14 "$R/thesis.txt"; tail -n 8 "$R/serve_http.txt"; grep -hE "^\| overlap" "$R/engine_busy.txt" ;;
esac
tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage" && rm -rf "$R"

#!/usr/bin/env bash
# The test suite on the device machine (one GPU), as the device tool runs it:
#   carry: [".carry/shared", ".whl"]   command: bash tests/device/run_suite.sh [pytest args, default tests/]
# .whl holds the wheels the image lacks (fastapi, uvicorn, prometheus_client, openai and their
# needs: walkthrough/results/device_notes.md; openai 3.x needs httpx2, httpcore2 and truststore,
# which the image's httpx is not); .carry/shared a copy of ../shared, which does not
# travel (mkdir -p .carry/shared && cp -r ../shared/data ../shared/reference .carry/shared/).
# xdist workers share the GPU (tests/conftest.py gives each 1/N of its memory); each failure's
# traceback lands in $OUT/failures.txt at once, the whole log in $OUT/suite.log.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=.:/tmp/site:tests:tests/device PYTHONUNBUFFERED=1
[ -d .carry/shared ] && mkdir -p ../shared && cp -r .carry/shared/. ../shared/
start=$(date +%s)
timeout "${SUITE_S:-540}" python3 -m pytest -p no:cacheprovider -p no:warnings -o addopts= -m "not slow" \
  -p failures_to_out -v --timeout 300 -n "${WORKERS:-12}" --dist "${DIST:-load}" -rfEs --tb=short \
  "${@:-tests/}" > "$OUT/suite.log" 2>&1
echo "suite rc=$? wall=$(( $(date +%s) - start ))s" | tee -a "$OUT/suite.log"
grep -E "(FAILED|ERROR) tests|passed|failed" "$OUT/suite.log" | sed "s/^.*\(FAILED\|ERROR\)/\1/" | sort -u | tail -45

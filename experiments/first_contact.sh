#!/usr/bin/env bash
# First contact with the real pair (docs/real-models.md, "The first answer, process by process"):
# vanilla and the default, each over a fresh auto store, compile cache and weights cache, then a
# second process of each; wall and peak RSS from /usr/bin/time -v, texts compared. Needs the real pair
# (../shared/scripts/fetch-real-models.sh). Usage: bash experiments/first_contact.sh
# (WC=on: with the opt-in weights cache, each run dir its own)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
R=~/.cache/ouroboros-real
T=$R/qwen2.5-coder-1.5b-instruct-q4_k.gguf; D=$R/qwen2.5-coder-0.5b-instruct-q4.gguf
CHAT="Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."
out=${OUT:-/tmp/first_contact}; rm -rf $out; mkdir -p $out/v $out/d
run() { # label dir args...
  local label=$1 dir=$2; shift 2
  XDG_CACHE_HOME=$dir/cache OUROBOROS_JAX_CACHE=$dir/auto /usr/bin/time -v \
    python -m ouroboros_jax.cli generate --model $T "$@" --chat "$CHAT" --max-new-tokens 128 --stats \
    --weights-cache ${WC:-off} \
    > $out/$label.out 2> $out/$label.err
  echo "$label wall $(grep 'Elapsed (wall' $out/$label.err | awk '{print $NF}') maxrss_kb $(grep 'Maximum resident' $out/$label.err | awk '{print $NF}')" | tee -a $out/summary.txt
}
# a second process of a user re-running a command finds the weights cache its first one wrote
# in the page cache; the other run's entries (both on this 24 GB machine) may have pushed them
# out, so each second process starts with its own entries read once (as a re-run would)
warm() { cat $1/cache/ouroboros-jax/weights/*.bin > /dev/null 2>&1 || true; }
run vanilla1 $out/v --method vanilla
run default1 $out/d --draft $D
warm $out/d; run default2 $out/d --draft $D
warm $out/v; run vanilla2 $out/v --method vanilla
for f in vanilla1 default1 default2 vanilla2; do cmp -s $out/vanilla1.out $out/$f.out && echo "$f text == vanilla1" || echo "$f text DIFFERS"; done | tee -a $out/summary.txt

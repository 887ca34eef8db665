#!/bin/sh
# Description: mlensd refuses a gpus list of several GPUs at start-up, in
# plain words (it serves on one GPU), and names the key when the list is bad;
# one GPU listed goes past the check (to the missing model).
set -u
B="${MLENS_BUILDDIR:-.}"
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT
bad=0
run() { "$B/daemon/mlensd" --foreground --model "$tmp/none" --socket "$tmp/t.sock" --log "$tmp/log" "$@" >"$tmp/out" 2>&1; }

run --gpus 0,1; rc=$?
[ $rc -eq 2 ] || { echo "FAIL: --gpus 0,1 exit $rc"; bad=1; }
grep -q "lists 2 GPUs, but this mlensd serves on one GPU only" "$tmp/out" || { echo "FAIL: message: $(cat "$tmp/out")"; bad=1; }
run --gpus 0,0; rc=$?
[ $rc -eq 2 ] && grep -q "'--gpus'.*listed twice" "$tmp/out" || { echo "FAIL: duplicate: $rc $(cat "$tmp/out")"; bad=1; }
printf 'gpus = 0,x\n' >"$tmp/c.conf"
run --config "$tmp/c.conf"; rc=$?
[ $rc -eq 2 ] && grep -q "c.conf:1: key 'gpus'" "$tmp/out" || { echo "FAIL: file: $rc $(cat "$tmp/out")"; bad=1; }
run --gpus 3; rc=$?
grep -q "GPUs" "$tmp/out" && { echo "FAIL: one GPU refused: $(cat "$tmp/out")"; bad=1; }
[ $rc -ne 0 ] || { echo "FAIL: started without a model"; bad=1; }
[ $bad -eq 0 ] && echo "shard_gpus: several GPUs refused, bad lists name the key"
exit $bad

#!/usr/bin/env bash
# The training figures of docs/TRAINING-FIGURES.md on the GPU machine, in one go (each run's
# console and metrics under ${OUT:-gpu-logs}/train/, packed into train.tar.gz):
#   throughput   m3h train at the official shape (d_model 1024, headdim 64, d_state 128,
#                expand 2, B 8, T 4096, bf16, chunked, 1, 2 and 4 layers) on text, with
#                --step-times (the step's forward, backward, optimizer and the rest on the
#                device), next to m3h bench's forward+backward of the backbone alone
#                (official, official2)
#   jargon       a byte-level model on the Jargon File (data/jargon.txt: scripts/fetch-jargon.sh)
#   parity       with angles (d_state 2, rope_fraction 1: one angle) and without (rope_fraction
#                0.5: none), trained on lengths 3…64, evaluated at 256; also f16 (loss scaling)
#   copy         selective-copy
#   parallel     data parallelism (TRAINING.md §8) at the official shape, 2 layers, global batch
#                B 8 x T 4096, bf16: one GPU on the plain path; one GPU through the data-parallel
#                path (a one-process job: NCCL, the sharded optimizer, the gathers); and G = 2,
#                4, 8 where that many GPUs are present: median tokens/s of steps 6-30, the
#                scaling efficiency against the plain path, the exchange's ms per step. Text:
#                the repository's own sources (no download needed)
# Usage: bash scripts/train-figures.sh M3H [STEP...]
#   (steps: throughput jargon parity parity16 copy parallel; default all)
# Exit status 1 when a run fails (m3h train's status: a verification failure stops a run with
# 1) or a bit-for-bit check fails, naming them on the last line; a step whose data is missing
# is skipped with a line that says so.
set -uo pipefail
m3h="$1"
shift
steps=("$@")
((${#steps[@]})) || steps=(throughput jargon parity parity16 copy parallel)
logs="${OUT:-gpu-logs}/train"
mkdir -p "$logs"
run() {  # NAME ARGS...: m3h train --out $logs/NAME ARGS, console to $logs/NAME.log
  local name="$1"
  shift
  echo "=== $name: m3h train $*"
  /usr/bin/time -v "$m3h" train --out "$logs/$name" --force "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  tail -n 3 "$logs/$name.log"
  echo "rc=$rc"
  ((rc == 0)) || failed+=("$name (rc=$rc)")
}
failed=()  # the runs and checks that failed: the script exits 1 when there is any
for s in "${steps[@]}"; do
  case "$s" in
    throughput)
      [[ -f data/jargon.txt ]] || { echo "throughput: data/jargon.txt missing"; continue; }
      for L in 1 2 4; do
        run "official_L$L" --data data/jargon.txt --d-model 1024 --headdim 64 --d-state 128 \
          --expand 2 --layers "$L" --B 8 --T 4096 --steps 30 --warmup 5 --dtype bf16 \
          --scan chunked --val-batches 0 --log-every 10 --step-times
        grep -h "step times" "$logs/official_L$L.log"
      done
      "$m3h" bench --no-reference --shapes official,official2 --dtype bf16 --scan chunked \
        >"$logs/bench_official.log" 2>&1
      tail -n 12 "$logs/bench_official.log"
      ;;
    jargon)
      [[ -f data/jargon.txt ]] || { echo "jargon: data/jargon.txt missing"; continue; }
      # 1.68 MB of text overfits quickly: 1000 steps of 16x512 bytes are ~5 passes over it.
      run jargon --data data/jargon.txt --d-model 384 --headdim 64 --d-state 64 --layers 4 \
        --B 16 --T 512 --steps 1000 --warmup 100 --lr 2e-3 --wd 0.1 --dtype bf16 \
        --val-every 100 --val-batches 10 --log-every 100 --verify-every 100
      "$m3h" sample --device gpu --checkpoint "$logs/jargon/ckpt-00001000.h5" \
        --prompt "hacker n." --tokens 400 --temperature 0.8 --seed 1 >"$logs/jargon_sample.txt" 2>&1
      cat "$logs/jargon_sample.txt"
      "$m3h" compare --device gpu --checkpoint "$logs/jargon/ckpt-00001000.h5" --mode both \
        --failures-only >"$logs/jargon_compare.log" 2>&1
      tail -n 4 "$logs/jargon_compare.log"
      run jargon_wide --data data/jargon.txt --d-model 512 --headdim 64 --d-state 64 --layers 6 \
        --B 16 --T 512 --steps 800 --warmup 80 --lr 1.5e-3 --wd 0.1 --dtype bf16 \
        --val-every 100 --val-batches 10 --log-every 100
      ;;
    parity)
      for rf in 1.0 0.5; do
        run "parity_rf$rf" --task parity --task-opt n_min=3 --task-opt n_max=64 --eval-len 256 \
          --d-model 64 --headdim 16 --d-state 2 --rope-fraction "$rf" --layers 2 --B 64 --T 64 \
          --steps 3000 --warmup 100 --lr 3e-3 --dtype bf16 --val-every 500 --val-batches 8 \
          --log-every 500 --verify-every 500
      done
      ;;
    parity16)  # the same model in f16 (dynamic loss scaling) and in f32
      for dt in f16 f32; do
        run "parity_$dt" --task parity --task-opt n_min=3 --task-opt n_max=64 --eval-len 256 \
          --d-model 64 --headdim 16 --d-state 2 --rope-fraction 1.0 --layers 2 --B 64 --T 64 \
          --steps 3000 --warmup 100 --lr 3e-3 --dtype "$dt" --val-every 500 --val-batches 8 \
          --log-every 500 --verify-every 500
      done
      ;;
    copy)
      run copy --task selective-copy --task-opt K=16 --task-opt alphabet=8 --d-model 128 \
        --headdim 32 --d-state 32 --layers 2 --B 32 --T 256 --steps 3000 --warmup 100 \
        --lr 3e-3 --dtype bf16 --val-every 500 --val-batches 8 --log-every 500 --verify-every 500
      ;;
    parallel)
      text="$logs/sources.txt"
      find reference gpu train harness tools tests docs -type f \( -name '*.cpp' -o -name '*.cu' \
        -o -name '*.cuh' -o -name '*.hpp' -o -name '*.md' \) -print0 | sort -z | xargs -0 cat >"$text"
      shape=(--data "$text" --d-model 1024 --headdim 64 --d-state 128 --expand 2 --layers 2
        --B 8 --T 4096 --steps 30 --warmup 5 --dtype bf16 --scan chunked --val-batches 0
        --log-every 10)
      # Median tokens/s of steps 6..30 (metrics.csv column 7).
      median() { awk -F, 'NR > 6 { print $7 }' "$1/metrics.csv" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
      run par_plain "${shape[@]}"
      rm -f "$logs/nccl.id"
      run par_job1 "${shape[@]}" --nccl-id-file "$logs/nccl.id" --rank 0 --world-size 1
      base=$(median "$logs/par_plain")
      echo "parallel: plain 1 GPU $base tok/s; one-process job through NCCL $(median "$logs/par_job1") tok/s"
      if cmp -s "$logs/par_job1/ckpt-00000030.h5" "$logs/par_plain/ckpt-00000030.h5"; then
        echo "parallel: the one-process job equals the plain path bit for bit (final checkpoint)"
      else
        echo "parallel: FAIL: the one-process job differs from the plain path"
        failed+=("par_job1 differs from par_plain")
      fi
      n=$(nvidia-smi -L 2>/dev/null | wc -l)
      for G in 2 4 8; do
        ((G <= n)) || break
        run "par_g$G" "${shape[@]}" --gpus "$G"
        t=$(median "$logs/par_g$G")
        echo "parallel: G = $G: $t tok/s, scaling efficiency $(awk -v t="$t" -v b="$base" -v g="$G" 'BEGIN { printf "%.1f %%", 100 * t / (g * b) }')"
      done
      if ((n >= 2)); then  # a job of 2 processes (the launcher's environment) against --gpus 2
        rm -f "$logs/nccl2.id"
        for r in 0 1; do
          M3_RANK=$r M3_WORLD_SIZE=2 M3_LOCAL_RANK=$r "$m3h" train --out "$logs/par_job2" --force \
            "${shape[@]}" --nccl-id-file "$logs/nccl2.id" >"$logs/par_job2_rank$r.log" 2>&1 &
        done
        wait
        if cmp -s "$logs/par_job2/ckpt-00000030.h5" "$logs/par_g2/ckpt-00000030.h5"; then
          echo "parallel: a job of 2 processes equals --gpus 2 bit for bit (final checkpoint)"
        else
          echo "parallel: FAIL: a job of 2 processes differs from --gpus 2"
          failed+=("par_job2 differs from par_g2")
        fi
      fi
      ;;
    *)
      echo "unknown step $s"
      failed+=("unknown step $s")
      ;;
  esac
done
tar --exclude='*.h5' -C "$logs/.." -czf "${OUT:-gpu-logs}/train.tar.gz" train
if ((${#failed[@]})); then
  echo "train-figures: FAIL: ${failed[*]}"
  exit 1
fi

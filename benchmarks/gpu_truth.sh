#!/usr/bin/env bash
# The GPU checks of issue 21, in one call on a machine with one CUDA GPU (results under $OUT, default ./gpu_out):
#   bash benchmarks/gpu_truth.sh
# 1. benchmarks/gpu_truth.py: burst and sustained GEMMs of real layer shapes, compute beside a collective's copy;
# 2. real training steps of two zoo models on one GPU under torchrun (NCCL, world size 1) with the plan autopar
#    makes for it (tp = pp = dp = 1 pinned; micro-batch, recompute and ZeRO chosen by the planner), recorded
#    and compared by `autopar report`: step time and torch.cuda.max_memory_allocated against the prediction.
set -o pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu --format=csv
[ -n "${SKIP_GEMMS:-}" ] || python3 benchmarks/gpu_truth.py --sustain-s "${SUSTAIN_S:-150}" --out "$OUT/gpu_truth.json" 2>&1 | tee "$OUT/gpu_truth.log"
run() {  # name seq_len global_batch [--override K=V]
  local m=$1 s=$2 g=$3; shift 3
  python3 -m autopar.cli.main plan "$m" --cluster local --nproc 1 --global-batch-size "$g" --seq-len "$s" \
      --tp 1 --pp 1 --dp 1 --precision bf16 "$@" --out "$OUT/plan_$m.json" 2>&1 | grep -v "Warn\|warn"
  python3 -m torch.distributed.run --nproc_per_node 1 examples/train_gpt.py --model "$m" --seq-len "$s" \
      --global-batch-size "$g" --plan "$OUT/plan_$m.json" --steps 8 --precision bf16 --record "$OUT/run_$m.json" "$@" \
      2>&1 | grep -v "Warn\|warn\|Failed to\|_pytree" | tail -40
  python3 -m autopar.cli.main report "$OUT/plan_$m.json" "$OUT/run_$m.json" 2>&1 | tee "$OUT/report_$m.txt"
}
run gpt3-1.3b 2048 8
run llama3-8b 4096 4 --override n_layers=8

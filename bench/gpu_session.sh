#!/usr/bin/env bash
# bench/gpu_session.sh PART: the GPU runs behind BENCHMARKS.md, one PART per device call (each < 10 minutes).
# The machine is staged as ../shared/device/README.md says (vllm 0.26.0 in /tmp/site, SmolLM2 in /tmp/models); the
# six wheels TRL needs beyond the image are carried in .stage/trl. Every run's metrics.jsonl and log are copied to
# $OUT (the device tool brings it back), named after the run.
#   install   TRL's wheels into /tmp/site
#   checks    packed attention vs each sequence alone; lm_head logprob variants
#   resume    a run resumed from checkpoint-2 reproduces steps 3-4 of the uninterrupted run
#   fixed     ours (defaults) vs TRL (its defaults), fixed 256-token completions: SmolLM2-135M and the 1.5B shape
#   varlen    the same on completions of natural, widely spread lengths (SmolLM2, "write N sentences about X")
#   learn [SEED]  60-step learning runs (seeds 42 and 7, or SEED), ours vs TRL (BENCHMARKS.md "Learning on the GPU")
#   seeds     generate with and without per-request seeds (run after fixed: it needs the 1.5B shape)
#   lora      the 1.5B shape: LoRA vs full fine-tuning, memory and step time
#   trainbench  the train phase alone, variants and profiles (bench/train_bench.py; needs no vLLM)
#   smol      SmolLM2-135M, ours vs TRL (its defaults): the fixed and the variable-length workloads
#   ours15    the 1.5B shape, ours only: fixed and variable lengths; then the push A/B (bench/push_ab.py)
#   trl15 [W] the 1.5B shape, TRL only (its defaults): fixed and/or varlen (compare on the CPU afterwards)
#   push      bench/push_ab.py on the 1.5B shape (made first if missing)
#   7b STEPS  the 7B shape, FSDP2 on 2 GPUs, 128 completions per GPU and step (the defaults' 16 x 8), 5 steps; STEPS of
#             make (the shape), pre11 (the code before issue 11, carried in .stage/pre11), main, lora (main + --use_peft)
#   loragap   the trainer/vLLM logprob gap at step 1, full vs LoRA (bf16 base, and fp32 base: .stage/lorafp32), SmolLM2
#             and the 1.5B shape (MODELS: smol 1.5b; VARIANTS=... a subset of full fsdp lora lorafp32)
#   refkl     the KL at step 1 (policy = reference) with --beta 0.04: reference in bf16 (.stage/refbf16) vs fp32 (SmolLM2)
#   s10 STEPS (BENCHMARKS.md "The train phase", "Against TRL 1.16"): STEPS of make (the 1.5B shape), old15 (older code,
#             carried in .stage/old, on the 1.5B shape), new15 (the working tree: the same run, then generation against
#             standalone vLLM), trl15 (ours, then TRL at its defaults, one call), smol (ours vs TRL, fixed and natural
#             lengths), learn (40 steps, ours vs TRL, LEARN_SEEDS), resume (a resume's step 1), default (run.sh's GPU
#             default run, 20 steps, old vs new)
#   s11       the tests marked gpu, run.sh's default run (6 steps, saved at 3) and its resume (BENCHMARKS.md "Checks on the GPU")
#   ab        the default run (run.sh's GPU settings, 20 steps) at the commit carried in .stage/old vs the working
#             tree, alternating old, new, old, new
#   s12 STEPS (BENCHMARKS.md "Checks on the GPU", "Scaling over GPUs"), after staging: STEPS of
#             tests   the tests marked gpu (on every GPU: 7 on 2 GPUs), and a 2-step run of run.sh's GPU default
#             det1    two identical 3-step runs on 2 GPUs (DDP), plain and with DETERMINISTIC=1: where they part
#                     (bench/determinism.py); det2: the same with ENGINE_SYNC=1 too, DDP and FSDP2 (both before the
#                     flag; DETERMINISTIC=1 crashed the engine's compiler); det3: DDP plain (once, the cost), DDP and
#                     FSDP2 with --full_determinism (twice each)
#             learn   run.sh --max_steps 20 on one GPU (held-out accuracy before and after)
#             smol    ours vs TRL at its defaults, SmolLM2, fixed 256-token completions, one GPU
#             scale   the 1.5B shape (sleep on): one GPU, then 2 GPUs with DDP, FSDP2 and tp 2
#   s13 STEPS generation settings and sleep mode, one GPU, after staging: STEPS of
#             make    the 1.5B shape (gen makes it too, if missing, out of its own time)
#             gen     bench/gen_settings.py on SmolLM2 and the 1.5B shape (made first if missing): each variant of the
#                     trainer's engine (base, no_logprobs, async, max_num_seqs, fp8, cudagraph sizes; sleep/wake/push
#                     timings in base) in a fresh process, the most important first, all within GEN_BUDGET (505 s of
#                     the script's clock); GEN_JOBS="KEY:VARIANT[:WORKLOADS] ..." picks others (keys smol, q15).
#                     Results: $OUT/s13-gen.jsonl, s13-gen-table.md, s13-gen.tar.gz (every job's log)
#             sleep1  the trainer (run.sh bench, STANDALONE=0, 8 steps), --vllm_enable_sleep_mode true vs false:
#                     SmolLM2 fixed 256 tokens, SmolLM2 natural stops (V); sleep2: the 1.5B shape fixed; sleep: all
#                     three (too long for one call on an H100). Each run ends by S13_DEADLINE (550 s) or is skipped.
#   s14       2 GPUs, after staging: the tests marked gpu but the 2-GPU ones (GPU 0) beside run.sh's GPU default for
#             20 steps (GPU 1); S14_FSDP=1: the 2-GPU --full_determinism test under FSDP2
#                     Results: $OUT/s13-STEP.tar.gz (metrics, logs), s13-STEP-ledger.md
#   s15 STEPS four GPUs, after staging (BENCHMARKS.md "Four GPUs"): STEPS of
#             make    the 1.5B and the 7B shapes (7B: bf16 on GPU 0, about 15 GB on disk)
#             scale   the 1.5B shape, 32 x 8 completions per rank, 8 steps, under bench/phases.py (a per-rank
#                     timeline): 1 GPU, DDP x 4, FSDP2 x 4, tp 2 x dp 2; S15_SETUPS="N NAME FLAGS;..." others
#             gen     vLLM alone (bench.py standalone) on the 1.5B shape: 256 and 512 sequences on one GPU, 512 on
#                     tp 2: does tensor parallelism make one engine faster at this size?
#             7b      the docstring's 7B line at half width: torchrun 4 GPUs, tp 2, --fsdp, the defaults (16 x 8
#                     completions per rank), 5 steps; host and GPU memory sampled every 5 s
#                     Results: $OUT/s15-STEP.tar.gz (timelines, logs, metrics) and s15-STEP.txt
#   s16       ours vs TRL 1.16 at its defaults, one pair per GPU on 4 GPUs, the four pairs at once (each pair back to
#             back on its own GPU, as the issue's first measurement): GPU 0 SmolLM2 fixed 256 tokens, GPU 1 SmolLM2
#             natural stops, GPU 2 the 1.5B shape, GPU 3 the 40-step learning run (accuracy, lr 1e-5). Needs .stage/trl.
#             Results: $OUT/s16.tar.gz (every run's metrics and log) and s16.txt (the compare tables)
#   s17       4 GPUs at once: bench/gen_settings.py on GPUs 0-2 (the variants not yet measured: V2 vs V1 model runner,
#             CUDA-graph sizes, FP8 weights (carry .stage/fp8: compressed-tensors 0.17.0 and loguru wheels), sleep mode
#             off; S17_GPU0..2 to pick others), run.sh --max_steps 20 on GPU 3
#             (held-out accuracy before and after). Results: $OUT/s17.txt, s17-gen-tables.md, s17.tar.gz
#   s19 STEP  one GPU, after staging (needs .stage/trl): STEP a: run.sh --max_steps 20 (held-out accuracy before and
#             after), then the 40-step learning run of s16, ours then TRL at its defaults (run.sh warmed the compile
#             cache ours reads; TRL's first run warms its own); STEP b: the same pair again, TRL first, both warm.
#             Results: $OUT/s19-STEP.txt (accuracy, time to each reward level), s19-STEP.tar.gz (metrics and logs)
#   s20 STEP  sleep mode auto against the other choice, one GPU, after staging (BENCHMARKS.md "Sleep mode, decided by
#             time"): STEP smol (SmolLM2, fixed 256 tokens and natural stops) or q15 (the 1.5B shape, fixed; made if
#             missing). Per workload four runs of S20_STEPS (10) steps, alternated: auto, the other, auto, the other.
#             Results: $OUT/s20-STEP.txt (each run's median step, and per mode), s20-STEP.tar.gz (metrics and logs)
#   s21 STEPS four GPUs (BENCHMARKS.md "Four GPUs"): ec (bench/empty_cache.py: empty_cache's cost after a DDP step,
#             torch alone, no staging needed), make (the 1.5B shape), scale (the trainer under bench/phases.py, setups
#             in S21_SETUPS with environment variables; PHASES_PYSPY=/tmp/pyspy/bin/py-spy profiles rank 0's rollouts:
#             carry .stage/pyspy, py-spy's wheel). Results: $OUT/s21-STEP.txt, s21.tar.gz
#   s22 STEPS one GPU, after staging (BENCHMARKS.md "One GPU: each decoder layer compiled whole"): STEPS of
#             prec (bench/precision_bench.py on S22_SHAPES, the variants of S22_VARIANTS, each in a fresh process;
#             S22_PROFILE: the variants profiled; PREC_BUDGET=TOKENS: micro-batches other than the memory plan's),
#             cmp15 and cmpsmol (ours then TRL at its defaults, the 1.5B shape or SmolLM2, 256 forced tokens, 8 steps;
#             needs .stage/trl). Results: $OUT/s22-STEP.txt, s22.tar.gz
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHON=python3 \
  MODEL_DIR=/tmp/models/SmolLM2-135M-Instruct NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 NPROC=${NPROC:-1}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SMOL=$MODEL_DIR
keep() {  # keep DIR NAME: a run's metrics and log, flat in $OUT
  for f in metrics.jsonl train.log trl/metrics.jsonl trl.log; do
    [ -f "$1/$f" ] && cp "$1/$f" "$OUT/$2-$(echo "$f" | tr / -)"
  done
}
latest() { ls -td outputs/bench/"$1"* | head -1; }
phases_setup() {  # phases_setup DIR LOG DEADLINE CAP "N NAME ENV|- FLAGS": the 1.5B shape under bench/phases.py (ENV: A=1,B=2)
  local n name envs flags left
  read -r n name envs flags <<< "$5"; [ "$envs" = - ] && envs=
  left=$(( $3 - SECONDS )); [ $left -lt 90 ] && { echo "== $name skipped" | tee -a "$2"; return; }
  echo "== $name: $n GPUs ${envs//,/ } $flags (${SECONDS}s)" | tee -a "$2"
  # shellcheck disable=SC2086
  env ${envs//,/ } CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout -k 10 $(( left < $4 ? left : $4 )) \
    python3 -m torch.distributed.run --standalone --nproc_per_node $n bench/phases.py $1/$name --model "$M15" "${W[@]}" \
    $flags --output_dir $1/$name/out > $1/$name.log 2>&1 || echo "   FAILED: $(tail -3 $1/$name.log)" | tee -a "$2"
  grep -h "^engine: \|^memory\|^step 8/" $1/$name.log | cut -c1-400 | tee -a "$2"
  python3 bench/phases.py report $1/$name 3 2>&1 | tee -a "$2"
}
# staged_wheels NAME TARGET: install the carried wheels of .stage/NAME, if carried (trl: TRL 1.16's six; fp8:
# compressed-tensors 0.17.0, which vLLM 0.26's quantization="fp8" imports; pyspy: py-spy)
staged_wheels() {
  ls .stage/"$1"/*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target "$2" .stage/"$1"/*.whl
}
versions() { python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'transformers', transformers.__version__)" 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; }

varlen_data() {  # "Write N sentences about X": natural stops, lengths spread widely
  python3 - <<'EOF'
import json, random
topics = ["the sea", "a city at night", "bread", "trains", "the moon", "winter", "a library", "bees", "rain", "chess",
          "a market", "volcanoes", "music", "the desert", "a bicycle", "clocks"]
rng = random.Random(0)
with open("/tmp/varlen.jsonl", "w") as f:
    for i in range(4000):
        n = rng.choice([1, 1, 2, 3, 4, 6, 8, 12, 16])
        f.write(json.dumps({"prompt": f"Write {n} sentence{'s' * (n > 1)} about {rng.choice(topics)}.", "answer": ""}) + "\n")
EOF
}
V=(--dataset /tmp/varlen.jsonl --reward_funcs reward_len --num_eval 8 --ignore_eos false --temperature 1.0)
W=(--num_generations 8 --per_device_train_batch_size 32 --gradient_accumulation_steps 8 --max_prompt_length 128
   --max_completion_length 256 --ignore_eos --max_steps 8 --eval_steps 0 --save_steps -1 --learning_rate 1e-6)  # run.sh's
M15=$HOME/.cache/grpo_colocate/qwen2.5-1.5b-random
# the 40-step learning run (SmolLM2, arithmetic, accuracy reward) of s10 learn, s16 and s19
LEARN=(--model "$SMOL" --num_generations 8 --per_device_train_batch_size 64 --gradient_accumulation_steps 4
       --max_completion_length 128 --lr_scheduler_type constant --max_steps 40 --eval_steps 0 --save_steps -1
       --reward_funcs accuracy_reward --learning_rate 1e-5 --temperature 1.0)

case ${1:?part} in
trainbench)
  OUT=$OUT python3 -u bench/train_bench.py "${2:-all}" > "$OUT/train_bench.txt" 2>&1; grep '^{' "$OUT/train_bench.txt" ;;
smol)
  varlen_data
  TRL_FLAGS=--trl_defaults bash run.sh compare smollm2-135m; keep "$(latest smollm2-135m)" fixed-smol
  TRL_FLAGS=--trl_defaults bash run.sh compare smollm2-135m "${V[@]}"; keep "$(latest smollm2-135m)" varlen-smol ;;
ours15)
  varlen_data
  STANDALONE=0 bash run.sh bench qwen2.5-1.5b-shape; keep "$(latest qwen2.5-1.5b)" fixed-1.5b
  STANDALONE=0 bash run.sh bench qwen2.5-1.5b-shape "${V[@]}"; keep "$(latest qwen2.5-1.5b)" varlen-1.5b
  python3 bench/push_ab.py "$M15" > "$OUT/push_ab.txt" 2>&1; grep "median" "$OUT/push_ab.txt" ;;
7b)
  M7=$HOME/.cache/grpo_colocate/qwen2.5-7b-random
  S=(--fsdp --per_device_train_batch_size 16 --gradient_accumulation_steps 8 --max_steps 5)
  for w in ${2:-make main}; do
    case $w in
    make) [ -f "$M7/config.json" ] || python3 bench/bench.py make-model qwen2.5-7b "$M7" "$SMOL" > "$OUT/make7b.txt" 2>&1
          tail -1 "$OUT/make7b.txt" ;;
    pre11) (cd .stage/pre11 && timeout 500 python3 -m torch.distributed.run --standalone --nproc_per_node 2 grpo_colocate.py \
             --model "$M7" "${W[@]}" "${S[@]}" --output_dir "$OUT/7b-pre11" > "$OUT/7b-pre11.log" 2>&1)
           tail -4 "$OUT/7b-pre11.log" ;;  # (no checkpoints: save_steps -1; metrics.jsonl comes back if the call dies)
    main) NPROC=2 STANDALONE=0 timeout 540 bash run.sh bench qwen2.5-7b-shape "${S[@]}" > "$OUT/7b-main.txt" 2>&1
          keep "$(latest qwen2.5-7b)" 7b-main; tail -3 "$OUT/7b-main.txt" ;;
    lora) NPROC=2 STANDALONE=0 timeout 540 bash run.sh bench qwen2.5-7b-shape "${S[@]}" --use_peft --learning_rate 1e-5 \
            > "$OUT/7b-lora.txt" 2>&1; keep "$(latest qwen2.5-7b)" 7b-lora; tail -3 "$OUT/7b-lora.txt" ;;
    esac
  done ;;
loragap)
  A=(--num_generations 8 --per_device_train_batch_size 64 --gradient_accumulation_steps 4 --max_completion_length 128
     --reward_funcs accuracy_reward --learning_rate 1e-5 --lr_scheduler_type constant --eval_steps 0 --save_steps -1)
  M15=$HOME/.cache/grpo_colocate/qwen2.5-1.5b-random
  for model in ${2:-smol 1.5b}; do
    m=$SMOL; steps=4; [ $model = 1.5b ] && { m=$M15; steps=3
      [ -f "$M15/config.json" ] || python3 bench/bench.py make-model qwen2.5-1.5b "$M15" "$SMOL" > /dev/null 2>&1; }
    for v in ${VARIANTS:-full fsdp lora lorafp32}; do
      dir=.; flags=(); case $v in fsdp) flags=(--fsdp);; lora) flags=(--use_peft);;
        lorafp32) flags=(--use_peft); dir=.stage/lorafp32;; esac
      (cd $dir && timeout 280 python3 -m torch.distributed.run --standalone --nproc_per_node 1 grpo_colocate.py --model "$m" \
        "${A[@]}" --max_steps $steps "${flags[@]}" --output_dir "$OUT/gap-$model-$v" > "$OUT/gap-$model-$v.log" 2>&1)
      grep -h "^step\|^world" "$OUT/gap-$model-$v.log" | cut -c1-200
    done
  done ;;
refkl)
  A=(--model "$SMOL" --num_generations 8 --per_device_train_batch_size 64 --gradient_accumulation_steps 4
     --max_completion_length 128 --reward_funcs accuracy_reward --learning_rate 1e-5 --eval_steps 0 --save_steps -1
     --beta 0.04 --max_steps 2)
  for v in refbf16 reffp32; do
    dir=.; [ $v = refbf16 ] && dir=.stage/refbf16
    (cd $dir && timeout 250 python3 -m torch.distributed.run --standalone --nproc_per_node 1 grpo_colocate.py "${A[@]}" \
      --output_dir "$OUT/kl-$v" > "$OUT/kl-$v.log" 2>&1)
    grep -h "^step" "$OUT/kl-$v.log"
  done ;;
s10)
  for w in ${2:-make}; do
    case $w in
    make) [ -f "$M15/config.json" ] || python3 bench/bench.py make-model qwen2.5-1.5b "$M15" "$SMOL" > "$OUT/make15.txt" 2>&1
          tail -1 "$OUT/make15.txt" ;;
    old15) (cd .stage/old && timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node 1 grpo_colocate.py \
              --model "$M15" "${W[@]}" --output_dir /tmp/s10-old15 > "$OUT/s10-old15.log" 2>&1)
           cp /tmp/s10-old15/metrics.jsonl "$OUT/s10_old15.jsonl"; grep -h "^step" "$OUT/s10-old15.log" | cut -c1-230 ;;
    new15) timeout 330 bash run.sh bench qwen2.5-1.5b-shape > "$OUT/s10-new15.txt" 2>&1
           keep "$(latest qwen2.5-1.5b)" s10-new15; tail -4 "$OUT/s10-new15.txt" ;;
    trl15) TRL_FLAGS=--trl_defaults timeout 540 bash run.sh compare qwen2.5-1.5b-shape > "$OUT/s10-trl15.txt" 2>&1
           keep "$(latest qwen2.5-1.5b)" s10-cmp15; tail -4 "$OUT/s10-trl15.txt" ;;
    smol) varlen_data
          TRL_FLAGS=--trl_defaults bash run.sh compare smollm2-135m > "$OUT/s10-smol.txt" 2>&1
          keep "$(latest smollm2-135m)" s10-fixed-smol
          TRL_FLAGS=--trl_defaults bash run.sh compare smollm2-135m "${V[@]}" >> "$OUT/s10-smol.txt" 2>&1
          keep "$(latest smollm2-135m)" s10-varlen-smol; grep -A3 "ours / TRL\|step s" "$OUT/s10-smol.txt" | tail -12 ;;
    learn) L=("${LEARN[@]}")
           for seed in ${LEARN_SEEDS:-42}; do
             python3 -m torch.distributed.run --standalone --nproc_per_node 1 grpo_colocate.py "${L[@]}" --seed $seed \
               --output_dir /tmp/s10-learn-ours-s$seed > "$OUT/s10-learn-ours-s$seed.log" 2>&1
             python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/bench_trl.py train \
               /tmp/s10-learn-trl-s$seed "${L[@]}" --seed $seed --trl_defaults > "$OUT/s10-learn-trl-s$seed.log" 2>&1
             cp /tmp/s10-learn-ours-s$seed/metrics.jsonl "$OUT/s10_learn_ours-s$seed.jsonl"
             cp /tmp/s10-learn-trl-s$seed/metrics.jsonl "$OUT/s10_learn_trl-s$seed.jsonl"
           done ;;
    resume) R=(--model "$SMOL" --num_generations 8 --per_device_train_batch_size 64 --gradient_accumulation_steps 4
               --max_completion_length 128 --reward_funcs accuracy_reward --learning_rate 1e-5 --eval_steps 0)
            python3 -m torch.distributed.run --standalone --nproc_per_node 1 grpo_colocate.py "${R[@]}" --max_steps 4 \
              --save_steps 2 --output_dir /tmp/s10-resume > "$OUT/s10-resume-full.log" 2>&1
            python3 -m torch.distributed.run --standalone --nproc_per_node 1 grpo_colocate.py "${R[@]}" --max_steps 8 \
              --save_steps -1 --output_dir /tmp/s10-resumed --resume_from_checkpoint /tmp/s10-resume/checkpoint-2 \
              > "$OUT/s10-resume-half.log" 2>&1
            cp /tmp/s10-resume/metrics.jsonl "$OUT/s10_resume_full.jsonl"; cp /tmp/s10-resumed/metrics.jsonl "$OUT/s10_resumed.jsonl"
            grep -h "^step" "$OUT/s10-resume-full.log" "$OUT/s10-resume-half.log" | cut -c1-200 ;;
    default) A=(--model "$SMOL" --num_generations 8 --per_device_train_batch_size 64 --gradient_accumulation_steps 4
                --max_completion_length 128 --reward_funcs accuracy_reward --learning_rate 1e-5 --lr_scheduler_type constant
                --max_steps 20 --eval_steps 0 --save_steps -1)
             for code in old new; do
               dir=.; [ $code = old ] && dir=.stage/old
               (cd $dir && python3 -m torch.distributed.run --standalone --nproc_per_node 1 grpo_colocate.py "${A[@]}" \
                 --output_dir /tmp/s10-default-$code > "$OUT/s10-default-$code.log" 2>&1)
               cp /tmp/s10-default-$code/metrics.jsonl "$OUT/s10_default_$code.jsonl"; grep -h "^step 20" "$OUT/s10-default-$code.log" | cut -c1-200
             done ;;
    esac
  done ;;
s11)
  # issues 25, 27 and 30 on the GPU, one call after staging: the tests marked gpu; run.sh's GPU default run for 6 steps
  # saved at 3 (what a newcomer's log shows), then resumed from checkpoint-3 (a resume's step 1)
  staged_wheels pyt /tmp/site > /dev/null 2>&1
  versions | tee "$OUT/versions.txt"
  timeout "${T_TESTS:-300}" bash run.sh test --gpu -v > "$OUT/s11-gpu-tests.txt" 2>&1; tail -4 "$OUT/s11-gpu-tests.txt"
  D=(--model "$SMOL" --max_steps 6 --eval_steps 3 --num_eval 64)
  timeout 170 bash run.sh "${D[@]}" --save_steps 3 --output_dir outputs/s11 > "$OUT/s11-default.log" 2>&1
  timeout 130 bash run.sh "${D[@]}" --save_steps -1 --output_dir outputs/s11r \
    --resume_from_checkpoint outputs/s11/checkpoint-3 > "$OUT/s11-resumed.log" 2>&1
  cp outputs/s11/metrics.jsonl "$OUT/s11-default-metrics.jsonl"; cp outputs/s11r/metrics.jsonl "$OUT/s11-resumed-metrics.jsonl"
  grep -h "^step\|engine ready\|eval at\|^world" "$OUT"/s11-*.log | cut -c1-250; wc -l "$OUT"/s11-*.log ;;
s12)
  shift
  for step in "$@"; do case $step in
  tests)
    versions | tee "$OUT/s12-versions.txt"
    timeout 540 bash run.sh test --gpu -v -rs > "$OUT/s12-gpu-tests.txt" 2>&1  # every GPU: the 2-GPU tests too
    tail -3 "$OUT/s12-gpu-tests.txt"
    CUDA_VISIBLE_DEVICES=0 timeout 150 bash run.sh --model "$SMOL" --max_steps 2 --eval_steps 0 \
      --output_dir outputs/s12-smoke > "$OUT/s12-smoke.log" 2>&1; tail -4 "$OUT/s12-smoke.log" | cut -c1-300 ;;
  det1|det2|det3)  # det1: plain, torch's deterministic algorithms; det2: and a synchronous engine; FSDP2 with it
    mkdir -p /tmp/det
    D=(--model "$SMOL" --max_steps 3 --save_steps -1 --eval_steps 0 --num_eval 8)
    variants="ddp-plain ddp-det"; [ $step = det2 ] && variants="ddp-sync fsdp-sync"
    [ $step = det3 ] && variants="ddp-plain ddp-fd fsdp-fd"
    for variant in $variants; do
      extra=(); [ "${variant%-*}" = fsdp ] && extra=(--fsdp)
      [ "${variant#*-}" = fd ] && extra+=(--full_determinism)
      runs="a b"; [ $step-$variant = det3-ddp-plain ] && runs=a
      for run in $runs; do
        ENGINE_SYNC=$([ "${variant#*-}" = sync ] && echo 1 || echo 0) timeout 150 python3 -m torch.distributed.run \
          --standalone --nproc_per_node 2 bench/determinism.py /tmp/det/$variant-$run "${D[@]}" "${extra[@]}" \
          --output_dir /tmp/det/out-$variant-$run > /tmp/det/$variant-$run.log 2>&1 || tail -5 /tmp/det/$variant-$run.log
      done
      echo "== $variant"; [ -f /tmp/det/$variant-b.rank0.jsonl ] && python3 bench/determinism.py compare /tmp/det/$variant-a /tmp/det/$variant-b
      grep -h "^step" /tmp/det/$variant-a.log | cut -c1-160
    done
    tar -czf "$OUT/$step.tar.gz" -C /tmp det --exclude='out-*' ;;
  learn)
    CUDA_VISIBLE_DEVICES=0 timeout 300 bash run.sh --model "$SMOL" --max_steps 20 --eval_steps 20 \
      --output_dir outputs/s12-learn > "$OUT/s12-learn.log" 2>&1
    cp outputs/s12-learn/metrics.jsonl "$OUT/s12-learn.jsonl"; grep -c "" "$OUT/s12-learn.log"; grep "eval at\|^step 20" "$OUT/s12-learn.log" | cut -c1-250 ;;
  smol)
    staged_wheels trl /tmp/site
    CUDA_VISIBLE_DEVICES=0 NPROC=1 TRL_FLAGS=--trl_defaults timeout 400 bash run.sh compare smollm2-135m \
      > "$OUT/s12-smol.txt" 2>&1; keep "$(latest smollm2-135m)" s12-smol; tail -6 "$OUT/s12-smol.txt" ;;
  scale)
    [ -f "$M15/config.json" ] || python3 bench/bench.py make-model qwen2.5-1.5b "$M15" "$SMOL" > /dev/null 2>&1
    for setup in "1 " "2 " "2 --fsdp" "2 --vllm_tensor_parallel_size 2"; do
      n=${setup%% *}; flags=${setup#* }
      # shellcheck disable=SC2086
      CUDA_VISIBLE_DEVICES=$([ $n = 1 ] && echo 0 || echo 0,1) NPROC=$n STANDALONE=0 timeout 200 bash run.sh bench \
        qwen2.5-1.5b-shape --vllm_enable_sleep_mode true $flags 2>&1 | tail -2
    done ;;
  esac; done ;;
s13)
  shift
  for step in "$@"; do case $step in
  make)
    [ -f "$M15/config.json" ] || python3 bench/bench.py make-model qwen2.5-1.5b "$M15" "$SMOL" 2>&1 | tail -1 ;;
  gen)
    D=/tmp/s13-gen; rm -rf $D; mkdir -p $D
    staged_wheels fp8 /tmp/site
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $D/gpu.txt
    [ -f "$M15/config.json" ] || python3 bench/bench.py make-model qwen2.5-1.5b "$M15" "$SMOL" > $D/make15.txt 2>&1
    [ -f $D/make15.txt ] && tail -1 $D/make15.txt; echo "== ${SECONDS}s: jobs start"
    J="smol:base q15:base:fixed smol:async_off q15:async_off:fixed smol:mns1024 q15:fp8:fixed smol:fp8 smol:cg_fit"
    J+=" smol:async_on smol:sleep_off q15:cg_fit:fixed smol:v1_runner"  # (the random 1.5B never stops early: fixed only)
    python3 bench/gen_settings.py run --model smol="$SMOL" --model q15="$M15" --jobs "${GEN_JOBS:-$J}" \
      --out $D/gen.jsonl --logs $D/logs --budget_s $(( ${GEN_BUDGET:-505} - SECONDS )) --min_job_s 60 2>&1 | tee $D/driver.txt
    cp $D/gen.jsonl "$OUT/s13-gen.jsonl"
    python3 bench/gen_settings.py table $D/gen.jsonl > "$OUT/s13-gen-table.md" 2>&1
    tar -czf "$OUT/s13-gen.tar.gz" --exclude=s13-gen/logs/out -C /tmp s13-gen
    cat "$OUT/s13-gen-table.md"; echo "== s13 gen: ${SECONDS}s" ;;
  sleep|sleep1|sleep2)
    D=/tmp/s13-$step; rm -rf $D; mkdir -p $D; varlen_data
    case $step in sleep1) runs="smol-fixed smol-natural";; sleep2) runs="q15-fixed";;
                  *) runs="smol-fixed smol-natural q15-fixed";; esac
    for w in $runs; do
      model=smollm2-135m; [ ${w%-*} = q15 ] && model=qwen2.5-1.5b-shape
      extra=(); [ $w = smol-natural ] && extra=("${V[@]}")
      for mode in true false; do
        left=$(( ${S13_DEADLINE:-550} - SECONDS - 10 )); cap=$([ ${w%-*} = q15 ] && echo 240 || echo 200)
        [ $left -lt 75 ] && { echo "== $w sleep $mode: skipped (${left}s left)"; continue; }
        echo "== $w sleep $mode (${SECONDS}s)"; touch $D/.start
        STANDALONE=0 timeout -k 10 $(( left < cap ? left : cap )) bash run.sh bench $model "${extra[@]}" \
          --vllm_enable_sleep_mode $mode > $D/$w-sleep$mode.txt 2>&1 || echo "   FAILED (rc $?): see $w-sleep$mode.txt"
        dir=$(find outputs/bench -maxdepth 1 -name "${model%-shape}*" -newer $D/.start | head -1)  # this run's
        [ -n "$dir" ] || dir=/nonexistent
        cp $dir/metrics.jsonl $D/$w-sleep$mode.jsonl 2>/dev/null; cp $dir/train.log $D/$w-sleep$mode.log 2>/dev/null
        grep -h "^engine: \|engine ready\|^step 8/" $D/$w-sleep$mode.log 2>/dev/null | cut -c1-300
        grep -h "^| " $D/$w-sleep$mode.txt | tail -1
      done
    done
    python3 bench/gen_settings.py ledger $(for w in $runs; do for mode in true false; do
      echo "$w-sleep$mode=$D/$w-sleep$mode.jsonl"; done; done) > "$OUT/s13-$step-ledger.md" 2>&1
    tar -czf "$OUT/s13-$step.tar.gz" -C /tmp s13-$step
    cat "$OUT/s13-$step-ledger.md"; echo "== s13 $step: ${SECONDS}s" ;;
  esac; done ;;
s15)
  shift
  M7=$HOME/.cache/grpo_colocate/qwen2.5-7b-random
  for step in "$@"; do
    D=/tmp/s15-$step; rm -rf $D; mkdir -p $D; T=$OUT/s15-$step.txt; SECONDS=0
    case $step in
    make)
      versions | tee $T
      [ -f "$M15/config.json" ] || python3 bench/bench.py make-model qwen2.5-1.5b "$M15" "$SMOL" 2>&1 | tail -1 | tee -a $T
      [ -f "$M7/config.json" ] || python3 bench/bench.py make-model qwen2.5-7b "$M7" "$SMOL" 2>&1 | tail -1 | tee -a $T
      echo "made in ${SECONDS}s" | tee -a $T ;;
    scale)
      setups=("1 one" "4 ddp" "4 fsdp --fsdp" "4 tp2 --vllm_tensor_parallel_size 2")
      [ -n "${S15_SETUPS:-}" ] && IFS=';' read -ra setups <<< "$S15_SETUPS"  # e.g. "1 one;1 one-fsdp --fsdp"
      for setup in "${setups[@]}"; do
        read -r n name flags <<< "$setup"
        phases_setup $D $T ${S15_DEADLINE:-580} 200 "$n $name - $flags"
      done ;;
    gen)
      for setup in "1 256 32" "1 512 64" "2 tp2-512 32 --vllm_tensor_parallel_size 2"; do
        read -r n name per flags <<< "$setup"
        echo "== $name: $n GPUs, $per x 8 per rank $flags (${SECONDS}s)" | tee -a $T
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout 150 python3 -m torch.distributed.run --standalone \
          --nproc_per_node $n bench/bench.py standalone $D/$name.json --model "$M15" "${W[@]}" \
          --per_device_train_batch_size $per $flags > $D/$name.log 2>&1 || echo "   FAILED: $(tail -3 $D/$name.log)"
        grep -h "standalone vLLM" $D/$name.log | tee -a $T
      done ;;
    7b)
      (while :; do echo "$(date +%s) host_used_mb $(free -m | awk '/Mem:/ {print $3}') rss_mb $(ps -C python3 -o rss= \
         | awk '{s+=$1} END {print int(s/1024)}') gpu_mb $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits \
         | paste -sd,)"; sleep 5; done > $D/memory.txt) &
      monitor=$!
      timeout -k 10 540 python3 -m torch.distributed.run --standalone --nproc_per_node 4 grpo_colocate.py --model "$M7" \
        --vllm_tensor_parallel_size 2 --fsdp --max_steps 5 --eval_steps 0 --save_steps -1 --output_dir $D/out \
        > $D/7b.log 2>&1 || echo "FAILED (rc $?): $(tail -5 $D/7b.log)" | tee -a $T
      kill $monitor
      grep -h "^engine\|^memory\|^world\|^step " $D/7b.log | cut -c1-500 | tee -a $T
      sort -k3 -n $D/memory.txt | tail -1 | sed 's/^/peak host: /' | tee -a $T
      awk '{split($7, g, ","); for (i in g) if (g[i] > m[i]) m[i] = g[i]} END {printf "peak GPU MiB:"; for (i in m) printf " %s", m[i]; print ""}' \
        $D/memory.txt | tee -a $T ;;
    esac
    tar -czf "$OUT/s15-$step.tar.gz" --exclude=out/checkpoint-* -C /tmp s15-$step; echo "== s15 $step: ${SECONDS}s" | tee -a $T
  done ;;
s16)
  staged_wheels trl /tmp/site
  versions | tee "$OUT/s16.txt"; varlen_data; D=/tmp/s16; rm -rf $D; mkdir -p $D
  L=("${LEARN[@]}" --seed 42)
  export NPROC=1 TRL_FLAGS=--trl_defaults
  (CUDA_VISIBLE_DEVICES=0 timeout 560 bash run.sh compare smollm2-135m > $D/fixed-smol.txt 2>&1) &
  (CUDA_VISIBLE_DEVICES=1 timeout 560 bash run.sh compare smollm2-135m "${V[@]}" > $D/natural-smol.txt 2>&1) &
  (CUDA_VISIBLE_DEVICES=2 timeout 560 bash run.sh compare qwen2.5-1.5b-shape > $D/fixed-1.5b.txt 2>&1) &
  (export CUDA_VISIBLE_DEVICES=3
   timeout 270 python3 -m torch.distributed.run --standalone --nproc_per_node 1 grpo_colocate.py "${L[@]}" \
     --output_dir $D/learn-ours > $D/learn-ours.log 2>&1
   timeout 280 python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/bench_trl.py train \
     $D/learn-trl "${L[@]}" --trl_defaults > $D/learn-trl.log 2>&1) &
  wait
  for f in outputs/bench/*/metrics.jsonl outputs/bench/*/trl/metrics.jsonl; do
    [ -f "$f" ] && cp "$f" "$D/$(echo "${f#outputs/bench/}" | tr / -)"
  done
  for w in fixed-smol natural-smol fixed-1.5b; do echo "== $w"; grep -A4 "ours / TRL\|step s" $D/$w.txt | tail -8; done \
    | tee -a "$OUT/s16.txt"
  tar -czf "$OUT/s16.tar.gz" --exclude='*/checkpoint-*' -C /tmp s16 ;;
s19)
  staged_wheels trl /tmp/site
  D=/tmp/s19-$2; rm -rf $D; mkdir -p $D; T="$OUT/s19-$2.txt"; versions | tee $T
  L=("${LEARN[@]}" --seed 42)
  ours() { timeout 280 python3 -m torch.distributed.run --standalone --nproc_per_node 1 grpo_colocate.py "${L[@]}" \
             --output_dir $D/learn-ours-$1 > $D/learn-ours-$1.log 2>&1; }
  trl() { timeout 280 python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/bench_trl.py train \
            $D/learn-trl-$1 "${L[@]}" --trl_defaults > $D/learn-trl-$1.log 2>&1; }
  if [ "$2" = a ]; then
    timeout 200 bash run.sh --model "$SMOL" --max_steps 20 --eval_steps 20 --output_dir $D/check > $D/check.log 2>&1
    grep "eval at\|^step 20\|engine ready" $D/check.log | cut -c1-250 | tee -a $T
    ours 1; trl 1
  else
    trl 2; ours 2
  fi
  python3 bench/reach.py $D/learn-*/metrics.jsonl 2>&1 | tee -a $T
  tar -czf "$OUT/s19-$2.tar.gz" --exclude='*/checkpoint-*' -C /tmp s19-$2 ;;
s20)
  D=/tmp/s20-$2; rm -rf $D; mkdir -p $D; T="$OUT/s20-$2.txt"; versions | tee $T; varlen_data
  case $2 in smol) runs="smol-fixed smol-natural";; natural) runs="smol-natural";; q15) runs="q15-fixed"
    [ -f "$M15/config.json" ] || python3 bench/bench.py make-model qwen2.5-1.5b "$M15" "$SMOL" 2>&1 | tail -1;; esac
  for w in $runs; do
    model=smollm2-135m; [ ${w%-*} = q15 ] && model=qwen2.5-1.5b-shape
    extra=(--max_steps ${S20_STEPS:-10}); [ $w = smol-natural ] && extra+=("${V[@]}")
    other=
    for i in $(seq ${S20_RUNS:-4}); do
      mode=auto; [ $((i % 2)) = 0 ] && mode=$other
      left=$(( ${S20_DEADLINE:-560} - SECONDS - 10 ))
      [ $left -lt 60 ] && { echo "== $w $i $mode: skipped (${left}s left)" | tee -a $T; continue; }
      echo "== $w $i sleep $mode (${SECONDS}s)" | tee -a $T; touch $D/.start
      STANDALONE=0 timeout -k 10 $left bash run.sh bench $model "${extra[@]}" --vllm_enable_sleep_mode $mode \
        > $D/$w-$i-$mode.txt 2>&1 || echo "   FAILED (rc $?)" | tee -a $T
      dir=$(find outputs/bench -maxdepth 1 -name "${model%-shape}*" -newer $D/.start | head -1)
      cp ${dir:-/nonexistent}/metrics.jsonl $D/$w-$i-$mode.jsonl 2>/dev/null
      cp ${dir:-/nonexistent}/train.log $D/$w-$i-$mode.log 2>/dev/null
      grep -ho "sleep .*, push via" $D/$w-$i-$mode.log | head -1 | tee -a $T
      # the other choice: false where auto slept, true where it stayed awake
      [ $i = 1 ] && { other=false; grep -q "sleep off" $D/$w-1-auto.log 2>/dev/null && other=true; }
    done
  done
  python3 - $D/*.jsonl <<'PY' | tee -a $T
import json, statistics, sys
by_mode = {}
for path in sys.argv[1:]:
    steps = [json.loads(line) for line in open(path)]
    times = [s["time/step"] for s in steps if "time/step" in s and s["step"] > 2]
    name = path.rsplit("/", 1)[1][:-6]
    print(f"{name}: {len(times)} steps, median {statistics.median(times):.3f} s, mean {statistics.mean(times):.3f}")
    by_mode.setdefault(name.rsplit("-", 2)[0] + " " + name.rsplit("-", 1)[1], []).extend(times)
for key, times in sorted(by_mode.items()):
    print(f"{key}: {len(times)} steps, median {statistics.median(times):.3f} s, mean {statistics.mean(times):.3f}")
PY
  tar -czf "$OUT/s20-$2.tar.gz" -C /tmp s20-$2 ;;
s21)  # four GPUs (BENCHMARKS.md "Four GPUs"): STEPS of
  # ec     bench/empty_cache.py (torch alone): empty_cache after a DDP step vs alone; S21_EC lines "MODE NPROC ENV|-"
  # make   the 1.5B shape
  # gather bench/gather_ab.py on 4 GPUs: the push's FSDP2 gather, one full_tensor a parameter vs one all-gather a layer
  # scale  the trainer under bench/phases.py as s15 scale; S21_SETUPS="N NAME ENV|- FLAGS;..." (ENV: A=1,B=2)
  shift; D=/tmp/s21; mkdir -p $D
  staged_wheels pyspy /tmp/pyspy  # its own folder: --target would not add bin/py-spy beside /tmp/site's bin/
  for step in "$@"; do
    T=$OUT/s21-$step.txt; SECONDS=0; versions >> $T
    case $step in
    ec)
      while read -r mode n envs; do
        [ -z "$mode" ] && continue; [ "$envs" = - ] && envs=
        echo "== $mode x$n ${envs:-} (${SECONDS}s)" | tee -a $T
        log=$D/ec-$mode-$n-${envs//[^A-Za-z0-9]/_}.log
        # shellcheck disable=SC2086
        env $envs CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout 150 python3 -m torch.distributed.run --standalone \
          --nproc_per_node $n bench/empty_cache.py $mode 6 > $log 2>&1 || echo "   FAILED: $(tail -3 $log)" | tee -a $T
        grep -h '^{' $log | python3 -c "
import json, sys
for r in map(json.loads, sys.stdin):
    print(f\"   rank {r['rank']}: empty_cache {r['median_s']:.3f} s ({r['segments_freed']} segments, {r['gib_freed']} GiB),\",
          f\"fwd_bwd {r['fwd_bwd_s']:.3f} s; per step {[x['s'] for x in r['steps']]}\")" | tee -a $T
      done <<< "${S21_EC:-plain 1 -
plain 4 -
ddp 4 -
ddp 4 NCCL_P2P_DISABLE=1
ddp 4 TORCH_NCCL_AVOID_RECORD_STREAMS=1
ddp 4 NCCL_CUMEM_ENABLE=0
ddp:200 4 -}" ;;
    make)
      [ -f "$M15/config.json" ] || python3 bench/bench.py make-model qwen2.5-1.5b "$M15" "$SMOL" 2>&1 | tail -1 | tee -a $T ;;
    gather)
      timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node 4 bench/gather_ab.py "$M15" 5 \
        > $D/gather_ab.log 2>&1; grep "^gather_ab" $D/gather_ab.log | tee -a $T ;;
    scale)
      IFS=';' read -ra setups <<< "${S21_SETUPS:-1 one -;4 ddp -}"
      for setup in "${setups[@]}"; do phases_setup $D $T ${S21_DEADLINE:-570} 220 "$setup"; done ;;
    esac
    tar -czf "$OUT/s21.tar.gz" -C /tmp s21
  done ;;
s22)  # one GPU: the train phase's variants, ours against TRL (BENCHMARKS.md "One GPU: each decoder layer ...")
  shift; D=/tmp/s22; mkdir -p $D
  for step in "$@"; do
    T=$OUT/s22-$step.txt; versions >> $T
    case $step in
    prec)
      VARIANTS="${S22_VARIANTS:-main parts}" OUT=$D PROFILE="${S22_PROFILE:-}" \
        python3 bench/precision_bench.py all ${S22_SHAPES:-qwen2.5-1.5b} 2>&1 | grep -v Warning | tee -a $T
      cp $D/profile-* "$OUT"/ 2>/dev/null ;;
    cmp15|cmpsmol)
      staged_wheels trl /tmp/site; model=qwen2.5-1.5b-shape; [ $step = cmpsmol ] && model=smollm2-135m
      TRL_FLAGS=--trl_defaults STANDALONE=0 timeout 560 bash run.sh compare $model > $D/$step.txt 2>&1
      keep "$(latest ${model%-shape})" s22-$step; mv "$OUT"/s22-$step-* $D/; tail -12 $D/$step.txt | tee -a $T ;;
    esac
    tar -czf "$OUT/s22.tar.gz" -C /tmp s22
  done ;;
s17)  # 4 GPUs at once: three gen_settings drivers (one GPU each) and run.sh's 20-step learning run on the fourth
  D=/tmp/s17; rm -rf $D; mkdir -p $D; versions | tee "$OUT/s17.txt"
  staged_wheels fp8 /tmp/site
  [ -f "$M15/config.json" ] || python3 bench/bench.py make-model qwen2.5-1.5b "$M15" "$SMOL" > $D/make15.txt 2>&1
  gen() {  # gen GPU JOBS
    CUDA_VISIBLE_DEVICES=$1 python3 bench/gen_settings.py run --model smol="$SMOL" --model q15="$M15" --jobs "$2" \
      --out $D/gen-$1.jsonl --logs $D/logs-$1 --budget_s $(( 520 - SECONDS )) --min_job_s 60 > $D/driver-$1.txt 2>&1
  }
  gen 0 "${S17_GPU0:-smol:base smol:v1_runner smol:cg_fit smol:cg_pow2}" &
  gen 1 "${S17_GPU1:-q15:base:fixed q15:fp8:fixed q15:v1_runner:fixed q15:cg_fit:fixed}" &
  gen 2 "${S17_GPU2:-smol:fp8 smol:base smol:sleep_off}" &
  (CUDA_VISIBLE_DEVICES=3 timeout 330 bash run.sh --model "$SMOL" --max_steps 20 --eval_steps 20 \
     --output_dir outputs/s17-learn > $D/learn.log 2>&1; cp outputs/s17-learn/metrics.jsonl $D/learn.jsonl) &
  wait
  for g in 0 1 2; do echo "== GPU $g"; python3 bench/gen_settings.py table $D/gen-$g.jsonl; done > "$OUT/s17-gen-tables.md" 2>&1
  grep "eval at\|^step 20" $D/learn.log | cut -c1-250 | tee -a "$OUT/s17.txt"; cat "$OUT/s17-gen-tables.md"
  tar -czf "$OUT/s17.tar.gz" --exclude='logs-*/out' -C /tmp s17 ;;
ab)
  A=(--model "$SMOL" --num_generations 8 --per_device_train_batch_size 64 --gradient_accumulation_steps 4
     --max_completion_length 128 --reward_funcs accuracy_reward --learning_rate 1e-5 --lr_scheduler_type constant
     --max_steps 20 --eval_steps 0 --save_steps -1)
  for i in 1 2; do
    for code in old new; do
      dir=.; [ $code = old ] && dir=.stage/old
      (cd $dir && python3 -m torch.distributed.run --standalone --nproc_per_node 1 grpo_colocate.py "${A[@]}" \
        --output_dir /tmp/ab-$code-$i > "$OUT/ab-$code-$i.log" 2>&1); cp /tmp/ab-$code-$i/metrics.jsonl "$OUT/ab-$code-$i.jsonl"
    done
  done ;;
push)
  [ -f "$M15/config.json" ] || python3 bench/bench.py make-model qwen2.5-1.5b "$M15" "$SMOL" > /dev/null 2>&1
  python3 bench/push_ab.py "$M15" > "$OUT/push_ab.txt" 2>&1; grep "median" "$OUT/push_ab.txt" || tail -20 "$OUT/push_ab.txt" ;;
trl15)
  varlen_data
  for w in ${2:-fixed varlen}; do  # (the random 1.5B never stops early: its "varlen" run is a fixed-length one)
    extra=(); [ $w = varlen ] && extra=("${V[@]}")
    python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/bench_trl.py train outputs/trl15-$w \
      --model "$M15" "${W[@]}" "${extra[@]}" --trl_defaults > "$OUT/trl15-$w.log" 2>&1 || tail -20 "$OUT/trl15-$w.log"
    cp outputs/trl15-$w/metrics.jsonl "$OUT/trl15-$w.jsonl"
  done ;;
install)
  staged_wheels trl /tmp/site && python3 -c "import trl; print('trl', trl.__version__)"
  versions ;;
checks)
  python3 bench/packed_check.py 2>&1 | tee "$OUT/packed_check.txt" | tail -20
  python3 bench/logprobs_bench.py 2>&1 | tee "$OUT/logprobs_bench.txt" | tail -20 ;;
resume)
  # resume reproduces the rollouts (issue 12): 4 steps saving at 2, then a resume from checkpoint-2 to 4
  R=(--model "$SMOL" --max_steps 4 --eval_steps 0 --max_completion_length 128)
  bash run.sh "${R[@]}" --save_steps 2 --output_dir outputs/resume-full > "$OUT/resume-full.log" 2>&1
  bash run.sh "${R[@]}" --save_steps -1 --output_dir outputs/resume-half \
    --resume_from_checkpoint outputs/resume-full/checkpoint-2 > "$OUT/resume-half.log" 2>&1
  cp outputs/resume-full/metrics.jsonl "$OUT/resume-full.jsonl"; cp outputs/resume-half/metrics.jsonl "$OUT/resume-half.jsonl"
  python3 - <<'EOF'
import json
def steps(d): return {r["step"]: r for r in map(json.loads, open(f"outputs/{d}/metrics.jsonl")) if "reward" in r}
a, b = steps("resume-full"), steps("resume-half")
for s in (3, 4):
    for k in ("reward", "completion_length/mean", "completion_length/max", "loss", "grad_norm", "logprob_gap"):
        print(s, k, a[s][k], b[s][k], "same" if a[s][k] == b[s][k] else "DIFFERENT")
EOF
  ;;
fixed)
  TRL_FLAGS=--trl_defaults bash run.sh compare smollm2-135m; keep "$(latest smollm2-135m)" fixed-smol
  TRL_FLAGS=--trl_defaults bash run.sh compare qwen2.5-1.5b-shape; keep "$(latest qwen2.5-1.5b)" fixed-1.5b ;;
varlen)
  varlen_data
  for model in smollm2-135m qwen2.5-1.5b-shape; do
    TRL_FLAGS=--trl_defaults bash run.sh compare $model "${V[@]}"; keep "$(latest ${model%-shape})" varlen-$model
  done ;;
learn)
  L=(--model "$SMOL" --num_generations 8 --per_device_train_batch_size 64 --gradient_accumulation_steps 4
     --max_completion_length 128 --lr_scheduler_type constant --max_steps 60 --eval_steps 0 --save_steps -1
     --reward_funcs accuracy_reward --learning_rate 1e-5 --temperature 1.0)
  for seed in ${2:-42 7}; do
    python3 -m torch.distributed.run --standalone --nproc_per_node 1 grpo_colocate.py "${L[@]}" --seed $seed \
      --output_dir outputs/learn/ours-s$seed > "$OUT/learn-ours-s$seed.log" 2>&1
    python3 -m torch.distributed.run --standalone --nproc_per_node 1 bench/bench_trl.py train outputs/learn/trl-s$seed \
      "${L[@]}" --seed $seed > "$OUT/learn-trl-s$seed.log" 2>&1
    cp outputs/learn/ours-s$seed/metrics.jsonl "$OUT/learn_ours-s$seed.jsonl"
    cp outputs/learn/trl-s$seed/metrics.jsonl "$OUT/learn_trl-s$seed.jsonl"
  done ;;
seeds)  # per-request seeds vs none, one engine, the same requests (the 1.5B shape)
  python3 bench/seeds_ab.py "$HOME/.cache/grpo_colocate/qwen2.5-1.5b-random" 2>&1 | grep "tok/s" | tee "$OUT/seeds.txt" ;;
lora)
  STANDALONE=0 bash run.sh bench qwen2.5-1.5b-shape --max_steps 6; keep "$(latest qwen2.5-1.5b)" full-1.5b
  STANDALONE=0 bash run.sh bench qwen2.5-1.5b-shape --max_steps 6 --use_peft --learning_rate 1e-5
  keep "$(latest qwen2.5-1.5b)" lora-1.5b ;;
s14)
  # the final code on 2 GPUs, one call after staging: the 1-GPU tests marked gpu (GPU 0) beside run.sh's GPU
  # default for 20 steps (GPU 1: held-out accuracy before and after, and the sleep plan it prints); then, with
  # S14_FSDP=1, the 2-GPU --full_determinism test under FSDP2 (rank 0 alone reads the weights, then the checkpoint)
  versions | tee "$OUT/s14-versions.txt"
  if [ "${S14_FSDP:-0}" = 1 ]; then
    timeout 540 bash run.sh test --gpu -v -rs -k "repeats_two_rank_runs and trainer1" > "$OUT/s14-fsdp-tests.txt" 2>&1
    tail -4 "$OUT/s14-fsdp-tests.txt"
  else
    (CUDA_VISIBLE_DEVICES=1 timeout 420 bash run.sh --model "$SMOL" --max_steps 20 --eval_steps 20 \
       --output_dir outputs/s14-learn > "$OUT/s14-learn.log" 2>&1; cp outputs/s14-learn/metrics.jsonl "$OUT/s14-learn.jsonl") &
    CUDA_VISIBLE_DEVICES=0 timeout 420 bash run.sh test --gpu -v -rs -k "not full_determinism" > "$OUT/s14-gpu-tests.txt" 2>&1
    tail -4 "$OUT/s14-gpu-tests.txt"
    wait
    grep -h "^engine\|^per process\|eval at\|^step 1/\|^step 20" "$OUT/s14-learn.log" | cut -c1-300
  fi ;;
esac

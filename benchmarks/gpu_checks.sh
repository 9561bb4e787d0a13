#!/usr/bin/env bash
# Every GPU check of issue 6, item 2, in one run on a machine with a CUDA device (a lent GPU is held for
# minutes, so one prepared command does it all):
#   1. the GPU tests (`tests/test_gpu.py`: CUDA = CPU numerics, bf16, fused SDPA kernels, CUDA pre-training,
#      resume, compile, fine-tuning);
#   2. `gpu_throughput.py` at batch 256, eager and compiled in torch.compile's default and reduce-overhead
#      (CUDA graphs) modes (base-size MFU against the measured bf16 matmul peak, ratio against Hugging Face
#      on the same GPU, and a profile of each model's step: host vs kernel time, operator tables in
#      OUTDIR/profiles.tgz), then at batch 64 (host-bound on the H200), eager and with CUDA graphs;
#   3. the real pre-training loop (`vlberts pretrain`, visualbert-small on a small world, batch 256: the
#      host collates a lot per update) with its batches drawn in the loop (`--prefetch=0`) and drawn ahead in
#      a thread and pinned (the GPU default), interleaved, updates per second and their ratio;
#   4. `vlberts features extract` (torchvision Faster R-CNN, randomly initialised weights written here) over
#      EXTRACT_IMAGES synthetic 640 x 480 JPEGs: images per second at the default settings on the GPU;
#   5. with SUITE="FILES", those test files with the GPU visible to every test (VLBERTS_TEST_CUDA=1: each
#      recipe's device=auto takes CUDA and bf16), each result listed in OUTDIR/suite.log; then, with
#      CPU_SUITE="FILES", those files as `make test` runs them on a GPU machine (GPU hidden but for `gpu` tests);
#   6. with DEMO=1, the main job: `vlberts demo` (DEMO_ARGS: its flags) on the GPU, its log and summary.
# KERNELS, ATTN_KERNELS: see their steps below. THROUGHPUT=0 skips step 2 (B256=0 / B64=0 one of its runs); TESTS=0
# step 1; LOOP=0 step 3 (GRAPHS=0 its last part: the loop with --static_shapes, eager and in CUDA graphs,
# GRAPHS_S seconds for the latter); EXTRACT=0 step 4; MODES="default" compiles one mode only;
# SDPA_BACKENDS="" drops the batch-256 run's rows of our eager model held to one attention kernel each.
# Measured on a lent H200 (2026-11-26, second run, logs in benchmarks/results/h200-2026-11-26-run2): step 1
# 127 s, the batch-256 run with both compile modes and the profile 255 s, steps 3 + 4 (LOOP_STEPS=200) 204 s;
# the machine's start came on top. A fresh machine starts with torch.compile's caches empty (third run,
# 2026-11-27): one LXMERT-base process in CUDA graphs took over 128 s, and step 1 over 145 s. The fourth run
# (benchmarks/results/h200-2026-11-27-run2) measured the attention kernels (`ATTN_KERNELS=best,auto`, 370 s)
# and found the CUDA-graph loop failing in Inductor. The fifth (h200-2026-11-27-run3): `TESTS=1 ... KERNELS=0
# ATTN_KERNELS=efficient+flash ATTN_S=240` took 228 s (GPU tests 95 s, LXMERT-base at batch 512 with the runs of
# back-to-back steps 125 s), and `TESTS=1 ... LOOP_IMAGES=300 LOOP_STEPS=300 LOOP_BATCH=240 RUN_S=60 GRAPHS_S=270`
# 277 s (the CUDA-graph loop's 300 updates 89 s). The sixth (h200-2026-11-30, code at 48b3d95, after the MLM head's
# layout and LXMERT's last-layer rows changed): `TESTS=0 ... KERNELS=0 ATTN_KERNELS=efficient+flash ATTN_S=220`
# (LXMERT at batch 512, fresh machine) then `TESTS=1 TESTS_S=170` then the same with `ATTN_ARCH=visualbert
# ATTN_S=150`, 325 s in one call (GPU tests 24 passed, 1 skipped, 99 s); on the warm machine the LXMERT command
# again and `TESTS=0 B64=0 MODES=reduce-overhead SDPA_BACKENDS=` (the batch-256 rows), 262 s. The seventh
# (h200-2026-11-30-run2, code at 451ca41): `TESTS=0 ... KERNELS=0 DEMO=1` (the demo 270 s of 289) then `TESTS=1`
# (144 s), 450 s in one call on a fresh machine; then the demo with DEMO_ARGS=--seed=1, 303 s. What a next session
# could run: the batch-64 rows (`TESTS=0 B256=0 LOOP=0 GRAPHS=0 EXTRACT=0 KERNELS=0`), the loop in CUDA graphs again,
# the demo on the world with place compounds.
#
#   benchmarks/gpu_checks.sh OUTDIR        (PYTHON=python3 by default; the machine's own torch is used)
#
# Logs and JSON land in OUTDIR; the tables are printed last.
set -u
out=${1:?usage: benchmarks/gpu_checks.sh OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

# Every step needs a CUDA device: without one, stop here in one line (each step would fail in its own log).
if ! $py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "error: no CUDA device visible to $py (or it has no torch): these checks run on a GPU machine" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
$py -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
'transformers', transformers.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" \
  | tee -a "$out/gpu.txt"

if [ "${TESTS:-1}" = 1 ]; then
stamp "GPU tests"
timeout "${TESTS_S:-240}" $py -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -rfE 2>&1 \
  | tee "$out/gpu_tests.log" | tail -25
fi

if [ "${THROUGHPUT:-1}" = 1 ] && [ "${B256:-1}" = 1 ]; then
modes=${MODES:-default,reduce-overhead}
stamp "throughput, batch 256, compiled: $modes"
timeout "${B256_S:-420}" $py benchmarks/gpu_throughput.py --batch 256 --steps 20 --compile-modes "$modes" \
  --sdpa-backends "${SDPA_BACKENDS-efficient,math}" --profile "$out/profile" --json "$out/gpu_b256.json" > "$out/gpu_b256.log" 2>&1
# the operator tables in one file (a lent machine sends back few files)
[ -d "$out/profile" ] && tar -czf "$out/profiles.tgz" -C "$out" profile && rm -r "$out/profile"
fi
if [ "${THROUGHPUT:-1}" = 1 ] && [ "${B64:-1}" = 1 ]; then
stamp "throughput, batch 64, eager and with CUDA graphs"
timeout "${B64_S:-240}" $py benchmarks/gpu_throughput.py --batch 64 --steps 20 --compile-modes "${B64_MODES:-reduce-overhead}" \
  --json "$out/gpu_b64.json" > "$out/gpu_b64.log" 2>&1
fi

# The attention kernels alone (`attention_kernels.py`, under a minute): one forward + backward call per SDPA
# kernel at these models' shapes, and what each costs a whole LXMERT step. KERNELS=0 skips it.
if [ "${KERNELS:-1}" = 1 ]; then
  stamp "attention kernels alone, batch ${ATTN_BATCH:-512}"
  timeout "${KERNELS_S:-150}" $py benchmarks/attention_kernels.py --batch "${ATTN_BATCH:-512}" \
    --json "$out/attention_kernels.json" > "$out/attention_kernels.log" 2>&1
  tail -12 "$out/attention_kernels.log"
fi

# With ATTN_KERNELS="auto,efficient,flash+efficient" (settings of `pretrain --attention_kernel`, "+" for the
# comma of an order of kernels, or `best`: the fastest of the step above): ATTN_ARCH (lxmert) at ATTN_BATCH
# (512), eager and in CUDA graphs, once per setting, each in its own process (`gpu_throughput.py
# --attention-kernel`, held inside the compiled graph; its text padded as a real batch's, `--pad-text`). On the H200 run of
# 2026-11-27, PyTorch's own choice there (auto: cuDNN's kernel) took 25% of LXMERT's kernel time in CUDA
# graphs; the global switches tried first did not reach the compiled graph (torch.compile's cache held the
# cuDNN one), which is why the kernel is now chosen inside the model.
if [ -n "${ATTN_KERNELS:-}" ]; then
  for k in ${ATTN_KERNELS//,/ }; do
    if [ "$k" = best ]; then
      k=$($py -c "import json, sys; print(json.load(open(sys.argv[1]))['best_lxmert'] or '')" \
          "$out/attention_kernels.json" 2>/dev/null)
      [ -n "$k" ] || { stamp "ATTN_KERNELS=best: no attention_kernels.json with a pick (KERNELS=1 first)"; continue; }
    fi
    k=${k//+/,}; f=${k//,/_}  # the flag's commas; file names without them
    [ -e "$out/gpu_attn_$f.log" ] && { stamp "attention kernel $k: measured above"; continue; }  # best = one named
    stamp "throughput, ${ATTN_ARCH:-lxmert} at batch ${ATTN_BATCH:-512}, attention kernel: $k"
    timeout "${ATTN_S:-200}" $py benchmarks/gpu_throughput.py --arch "${ATTN_ARCH:-lxmert}" --batch "${ATTN_BATCH:-512}" \
      --steps 15 --compile-modes reduce-overhead --attention-kernel "$k" --pad-text --profile "$out/profile_attn_$f" \
      --json "$out/gpu_attn_$f.json" > "$out/gpu_attn_$f.log" 2>&1
  done
fi

# One `vlberts pretrain` run of the loop steps (visualbert-small, batch 256, the world's features in memory):
# NAME, then its extra flags. Prints the updates per second over the whole run and over its last 50 updates
# (after any compiling).
loop_run() {
  local name=$1; shift
  rm -rf "$w/$name"
  timeout "${RUN_S:-${LOOP_S:-120}}" $py -m vlberts.cli pretrain --captions="$w/world/annotations/captions_train.json" \
    --features="$w/features.h5" --out="$w/$name" --model=visualbert-small --steps="${LOOP_STEPS:-300}" \
    --batch_size="${LOOP_BATCH:-256}" --log_every=50 --ckpt_every=100000 --preload_features=true "$@" >> "$out/loop.log" 2>&1
  $py -c "import json, sys; r = [json.loads(l) for l in open(sys.argv[1])]
a, b = r[-2], r[-1]
print(f'{sys.argv[2]}: {b[\"step\"]} updates in {b[\"seconds\"]:.1f} s, {b[\"step\"] / b[\"seconds\"]:.2f} updates/s; '
      f'last {b[\"step\"] - a[\"step\"]}: {(b[\"step\"] - a[\"step\"]) / (b[\"seconds\"] - a[\"seconds\"]):.2f} updates/s')" \
    "$w/$name/metrics.jsonl" "$name ($*)" | tee -a "$out/loop.txt"
}

if [ "${LOOP:-1}" = 1 ] || [ "${GRAPHS:-1}" = 1 ]; then
  w="$out/loop"
  { $py -m vlberts.cli world build --out "$w/world" --images "${LOOP_IMAGES:-1000}" --seed 0 &&
    $py -m vlberts.cli extract --world "$w/world" --out "$w/features.h5"; } > "$out/loop.log" 2>&1
  if [ "${LOOP:-1}" = 1 ]; then
    stamp "pre-training loop: batches drawn in the loop (--prefetch=0) against drawn ahead (the default)"
    for rep in 1 2; do
      loop_run "inline$rep" --prefetch=0
      loop_run "ahead$rep" --prefetch=-1
    done
  fi
  if [ "${GRAPHS:-1}" = 1 ]; then
    stamp "pre-training loop in CUDA graphs: --static_shapes eager against compiled in reduce-overhead mode"
    loop_run static --static_shapes=true
    # Compiling takes its time before the first record: a graph per shape (`compile_model`), 15-20 s each on
    # the H200 (2026-11-27). On a CPU the same loop (visualbert-tiny, batch 240, 100 updates) compiles 4.
    RUN_S=${GRAPHS_S:-300} loop_run graphs --static_shapes=true --compile=true --compile_mode=reduce-overhead
  fi
  rm -rf "$w"
fi

if [ "${EXTRACT:-1}" = 1 ]; then
  stamp "feature extraction from images: torchvision Faster R-CNN, default settings"
  e="$out/extract"
  mkdir -p "$e/images"
  $py -c "
import sys, numpy as np, torch
from PIL import Image
from torchvision.models.detection import fasterrcnn_resnet50_fpn
torch.manual_seed(0)
torch.save(fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=91).state_dict(), sys.argv[1] + '/w.pth')
rng = np.random.default_rng(0)
for i in range(int(sys.argv[2])):
    Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)).save(f'{sys.argv[1]}/images/{i:012d}.jpg')
" "$e" "${EXTRACT_IMAGES:-256}"
  s0=$(date +%s.%N)
  timeout "${EXTRACT_S:-180}" $py -m vlberts.cli features extract --images "$e/images" --weights "$e/w.pth" \
    --out "$e/f.h5" --batch-images "${EXTRACT_BATCH:-8}" > "$out/extract.log" 2>&1
  rc=$?
  s1=$(date +%s.%N)
  if [ "$rc" = 0 ]; then  # a rate only for an extraction that finished
    $py -c "import sys; n, t = int(sys.argv[1]), float(sys.argv[3]) - float(sys.argv[2]); print(f'{n} images of 640 x 480 in {t:.1f} s (start-up included): {n / t:.1f} images/s')" \
      "${EXTRACT_IMAGES:-256}" "$s0" "$s1" | tee "$out/extract.txt"
  else
    echo "extraction failed or timed out (exit $rc; 124: past EXTRACT_S=${EXTRACT_S:-180} s): no rate" | tee "$out/extract.txt"
  fi
  tail -1 "$out/extract.log" | tee -a "$out/extract.txt"
  rm -rf "$e"
fi

# 6. The main job on the GPU (DEMO=1): `vlberts demo` with its defaults, so device auto takes CUDA and bf16 and
# pre-training and VQA run in this process (torchrun is for CPUs); DEMO_ARGS adds flags (e.g. --seed=1). Its log,
# summary and timings come back; the run's directory is removed.
if [ "${DEMO:-0}" = 1 ]; then
  stamp "vlberts demo on the GPU ${DEMO_ARGS:-}"
  # shellcheck disable=SC2086
  timeout "${DEMO_S:-420}" $py -m vlberts.cli demo --out "$out/demo_run" ${DEMO_ARGS:-} > "$out/demo.log" 2>&1
  stamp "demo exit status $?"
  cp "$out/demo_run/summary.json" "$out/demo_summary.json" 2>/dev/null
  cp "$out/demo_run/timings.json" "$out/demo_timings.json" 2>/dev/null
  rm -rf "$out/demo_run"
fi

if [ -n "${SUITE:-}" ]; then
  stamp "with the GPU visible to every test: $SUITE"
  # Each test has --timeout (pytest-timeout) so that the session ends and prints every failure's cause
  # (a run cut by the outer timeout prints none). On 2026-11-26, 14 workers with a 120 s limit reported
  # 85 errors and 10 failures (70 passed) whose causes the cut run never printed (most errors in fixture
  # set-up, so probably the limit itself): keep the workers few and the limit long.
  # shellcheck disable=SC2086
  VLBERTS_TEST_CUDA=1 timeout "${SUITE_S:-200}" $py -m pytest -v -rfE --tb=line --timeout="${TEST_TIMEOUT:-300}" \
    -n "${WORKERS:-4}" -p no:cacheprovider $SUITE > "$out/suite.log" 2>&1
  grep -oE "(PASSED|FAILED|ERROR|SKIPPED) tests/[^:]+" "$out/suite.log" | sort | uniq -c
  grep -E "^(FAILED|ERROR) " "$out/suite.log" | cut -c1-300
  tail -1 "$out/suite.log"
fi
if [ -n "${CPU_SUITE:-}" ]; then
  stamp "as make test runs them here (GPU hidden): $CPU_SUITE"
  # shellcheck disable=SC2086
  timeout "${CPU_SUITE_S:-120}" $py -m pytest -q -n "${WORKERS:-4}" -p no:cacheprovider $CPU_SUITE 2>&1 \
    | tee "$out/cpu_suite.log" | tail -4
fi
stamp "done"
if [ "${THROUGHPUT:-1}" = 1 ]; then
  [ -f "$out/gpu_b256.log" ] && { echo "== batch 256 + compile"; grep -v "^FLOPs/step" "$out/gpu_b256.log" | tail -36; }
  [ -f "$out/gpu_b64.log" ] && { echo "== batch 64"; grep -v "^FLOPs/step" "$out/gpu_b64.log" | tail -28; }
fi
for f in "$out"/gpu_attn_*.log; do
  [ -f "$f" ] && { echo "== $(basename "$f" .log)"; grep -E "^\| (Hugging|vlberts)|^throughput|^in runs|^MFU goal|^our attention|Error" "$f"; }
done
[ -f "$out/loop.txt" ] && { echo "== pre-training loop"; cat "$out/loop.txt"; }
[ -f "$out/extract.txt" ] && { echo "== feature extraction"; cat "$out/extract.txt"; }
[ -f "$out/demo.log" ] && { echo "== demo"; tail -25 "$out/demo.log"; }

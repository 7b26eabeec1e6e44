#!/usr/bin/env bash
# One GPU session's measurements (issue 49), in about 8 minutes on one H100.
#
#   OUT=/some/dir tools/gpu_session.sh        # on the GPU machine, from the repository root
#   DEVICE=cpu OUT=/tmp/dry tools/gpu_session.sh   # the dry run: every stage at --quick sizes
#
# GPU machines are lent now and then for about 15 minutes, starts included, so everything the
# issue measures on a GPU runs here, once, each stage under its own time limit so that one stage
# that hangs or fails costs only itself. The default stages, in the issue's order:
#   llama      (item 1) python -m benchmarks --llama --device cuda, the eager set: no checkpoint,
#              torch's checkpoint, torch selective, tracedac recompute_all and save_matmuls (warm,
#              and every call recorded: the warm path off), op by op and with compiled replay,
#              memory_budget(0.5). Look for: step ms and peak of each row; the ratios printed.
#   llama7b    (item 1) the same at the 7B-class layer shape (--llama-shape 7b: dim 4096, 4
#              layers, 8 x 2048 tokens, bf16).
#   profile    (item 1) the forward's floors: plain, torch, empty dispatch mode, least recorder,
#              tracedac recorded and warm (python -m benchmarks --profile --llama), then at 7b.
#   replay_bits  (item 2) tests/test_compiled_replay_bits.py's CUDA tests: under the defaults
#              (compiled replay on for CUDA, exact fusion) gradients bitwise equal to no
#              checkpointing, per model and dtype. A failure naming "refused:inexact" or
#              differing gradients: exact fusion is not exact on this GPU (docs/design.md,
#              "Compiled replay: bits").
#   peak       (item 3) python -m benchmarks --peak --device cuda: policies.peak at 8 budgets,
#              torch.cuda.max_memory_allocated against each budget, step time against torch's
#              options (eager, and compiled under activation_memory_budget) at equal peak.
#   fsdp2      (item 4) python -m benchmarks --fsdp2 --device cuda: one NCCL rank, each block
#              checkpointed by torch or tracedac inside fully_shard; held bytes and step time.
#   zero_profile  (item 5) tools/zero_profile.py: a compiled ZeRO bf16 "auto" step against
#              FSDP2's under the same autocast, one rank, under torch.profiler.
#   gpu_tests  the test files that use a CUDA device when one is visible
# and (item 6), the whole time, in the background on the other half of the cores, the suite with
# the GPU hidden (--dist loadscope), so that it does not disturb the timings.
# Named only (earlier issues' stages): llama_compiled, kernels, zero, zero_compile, replay_fusion.
# Every log and JSON lands in a temporary work/ folder; $OUT/results.tgz holds them all, remade
# after each stage, beside $OUT/session.log (the device tool brings back at most 8 files). The
# default stages' limits add up to 520 s; the suite in the background has 470 s, verbose, so
# that a run stopped at its limit still names its failures.
#
# A later session that needs only some stages names them, with the suite's share of the cores:
#   STAGES="kernels gpu_tests zero_compile" SUITE_CORES=10 SUITE_LIMIT=550 EXTRA="python3 x.py" \
#     OUT=... tools/gpu_session.sh
# (EXTRA: one more command, run as the stage "extra" after kernels, 60 s.)
set -u
OUT=${OUT:-gpu-out}
STAGES=" ${STAGES:-llama llama7b profile replay_bits peak fsdp2 zero_profile gpu_tests} ${EXTRA:+extra }"
DEV=${DEVICE:-cuda}  # DEVICE=cpu: a dry run of every stage at the benchmarks' --quick sizes
if [ "$DEV" = cpu ]; then QUICK=--quick CFG=l.QUICK; else QUICK= CFG=l.CUDA; fi
W=$(mktemp -d)/work  # outside $OUT: the device tool brings back 8 files at most
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CORES=$(nproc)
SUITE_CORES=${SUITE_CORES:-$((CORES / 2))}
SUITE_LIMIT=${SUITE_LIMIT:-470}
FIRST_BG=$((CORES - SUITE_CORES))
FG="0-$((FIRST_BG - 1))"
BG="$FIRST_BG-$((CORES - 1))"

say() { echo "[$(date +%T)] $*" | tee -a "$W/session.log"; }
pack() { tar -C "$W/.." -czf "$OUT/results.tgz" work && cp "$W/session.log" "$OUT/"; }
stage() {  # stage NAME LIMIT_S COMMAND...: run on the foreground cores, log to work/NAME.log
  local name=$1 limit=$2
  shift 2
  case "$STAGES" in *" $name "*) ;; *) return 0 ;; esac
  say "start $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 5 "$limit" taskset -c "$FG" "$@" >"$W/$name.log" 2>&1
  say "end $name rc=$? after $((SECONDS - t0))s"
  pack
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
  python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|peft|networkx|hypothesis|pytest|pytest-xdist|expecttest|numpy) "
} >"$W/machine.txt" 2>&1
say "machine: $(tail -n +2 "$W/machine.txt" | head -3 | tr '\n' ' ')"
# Wheels carried in .whl (the device tool's `carry`) for what the image lacks or has too old:
# expecttest (the OpInfo tests) and transformers >= 5.23 (the image's 5.17 has no
# activation_checkpointing_enable). `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 -d .whl expecttest transformers==5.24.0`, .whl in .git/info/exclude.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$W/wheels.log" 2>&1 &&
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# The suite without the GPU, in the background on the other cores (the CUDA files: stage gpu_tests).
GPU_TESTS="tests/kernels/test_gpu.py tests/kernels/test_host_path.py tests/bench/test_kernels_bench.py
  tests/test_offload.py::test_on_cuda_the_copy_is_pinned_asynchronous_and_the_device_memory_goes
  tests/test_offload.py::test_on_cuda_a_prefetched_copy_is_on_the_device_before_backward_reads_it_and_exact
  tests/test_offload.py::test_on_cuda_tracked_times_the_compute_streams_waits_for_copies
  tests/test_offload_planner.py::test_on_cuda_the_link_is_measured_and_an_offloading_plan_holds_fewer_device_bytes
  tests/test_offload_inputs.py::test_on_cuda_the_layer_inputs_leave_the_device_and_the_gradients_are_exact
  tests/test_compiled_replay.py::test_on_cuda_by_default_a_repeated_replay_runs_compiled_bit_for_bit"
# The modules that spawn process groups and compile for minutes go first (pytest keeps one copy
# of a path named twice), or the last of them is still running at the limit (run 3: test_tp.py).
# --dist loadscope: each module's tests on one worker. xdist's default handed test_tp.py's tests
# to every worker, and each ran the module's fixture, a 4-rank spawn that compiles (run 4: 13
# copies at once, none done in 480 s; one takes 47 s on a 2-core VM).
SLOW_FIRST="tests/zero/test_tp.py tests/zero/test_soak.py tests/integrations tests/zero/test_compile.py"
# pytest-timeout (a hung test named, not the whole stage lost) where the image has it: without it
# pytest refuses the option and the stage would run nothing
PER_TEST=""
python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST="--timeout 300"
[ "$DEV" = cpu ] || (
  CUDA_VISIBLE_DEVICES="" timeout -k 5 "$SUITE_LIMIT" taskset -c "$BG" \
    python3 -m pytest -v -p no:cacheprovider -n "$((SUITE_CORES - 1))" --dist loadscope $PER_TEST $SLOW_FIRST tests >"$W/suite_cpu.log" 2>&1
  echo "rc=$?" >>"$W/suite_cpu.log"
) &
SUITE=$!

# item 1: the eager set, warm (the default) and every call recorded, op by op and compiled replay
EAGER=none,torch,torch_sac,tracedac_recompute_all,tracedac_recompute_all_recorded,tracedac_compiled_replay,\
tracedac_save_matmuls,tracedac_save_matmuls_recorded,tracedac_save_matmuls_cr,tracedac_budget
stage llama 55 python3 -m benchmarks --llama --device $DEV $QUICK --steps 5 --only "$EAGER" --json "$W/llama.json"
SHAPE7B=--llama-shape=7b
[ "$DEV" = cpu ] && SHAPE7B=  # (the dry run: the 7B shape is 13 GB of weights in fp32 on the CPU)
stage llama7b 70 python3 -m benchmarks --llama --device $DEV $QUICK $SHAPE7B --steps 4 --only "$EAGER" \
  --json "$W/llama7b.json"
stage profile 55 bash -c "python3 -m benchmarks --profile --llama --device $DEV $QUICK --json $W/profile.json &&
  python3 -m benchmarks --profile --llama --device $DEV $QUICK $SHAPE7B --json $W/profile7b.json"
# item 2: bitwise replay on CUDA (each test compiles one structure: seconds each)
stage replay_bits 70 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_compiled_replay_bits.py
# item 3: whole-model budgets, read by torch.cuda.max_memory_allocated
stage peak 80 python3 -m benchmarks --peak --device $DEV $QUICK --json "$W/peak.json"
# item 4: tracedac regions inside FSDP2, one NCCL rank (the dry run: two gloo ranks)
stage fsdp2 40 python3 -m benchmarks --fsdp2 --device $DEV $QUICK --json "$W/fsdp2.json"
# item 5: compiled ZeRO bf16 "auto" against FSDP2 under the same autocast
stage zero_profile 110 python3 tools/zero_profile.py --device $DEV ${QUICK:+--tiny --steps 3}
stage gpu_tests 40 python3 -m pytest -q -p no:cacheprovider $GPU_TESTS
# named only: the stages of earlier issues
COMPILED=none,torch,tracedac_recompute_all,c_torch,c_torch_sac,c_budget_torch,c_tracedac_recompute_all,\
c_tracedac_save_matmuls,c_tracedac_budget
stage llama_compiled 170 python3 -c "
import json, sys
from dataclasses import replace
from benchmarks import llama_steps as l
r = l.run($CFG, device='$DEV', steps=5, variants=tuple('$COMPILED'.split(',')))
print(l.format_report(r))
json.dump(r, open('$W/llama_compiled.json', 'w'), indent=1, default=str)
"
stage kernels 40 python3 -m benchmarks --kernels $QUICK --json "$W/kernels.json"
stage extra 60 bash -c "${EXTRA:-}"
ZERO_SIZE="--layers 2 --dim 1024 --heads 16 --experts 8 --expert-hidden 2048 --seq 512 --batch 8"
stage zero 45 python3 -m benchmarks --zero --device $DEV $QUICK $ZERO_SIZE --json "$W/zero.json"
FUSION=none,torch,tracedac_recompute_all,tracedac_compiled_replay,tracedac_compiled_replay_all,\
tracedac_save_matmuls,tracedac_save_matmuls_cr,tracedac_save_matmuls_cr_all
stage replay_fusion 150 python3 -m benchmarks --llama --device $DEV $QUICK --steps 5 --only "$FUSION" \
  --json "$W/llama_fusion.json"
stage zero_compile 200 python3 -m benchmarks --zero --compile --device $DEV $QUICK $ZERO_SIZE --json "$W/zero_compile.json"
say "waiting for the background suite"
wait "$SUITE"
say "suite (GPU hidden): $(tail -2 "$W/suite_cpu.log" | tr '\n' ' ')"
pack
say "done"

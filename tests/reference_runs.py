"""megatron-core training against plain PyTorch, shared by tests/cpu and tests/mcore.

``train_megatron`` trains megatron's GPTModel with megatron's DDP, (distributed) optimizer and
pipeline schedule inside a ``dist.run_ranks`` rank; ``train_reference`` trains the same model
with ``torch.optim.AdamW`` in a world-size-1 process on the gradient of the mean loss over every
rank's micro-batches.
"""

import torch

WORLD_SIZE = 4
NUM_STEPS = 3
NUM_MICROBATCHES = 2  # per rank per step: exercises DDP's no_sync grad accumulation
MICRO_BATCH_SIZE = 2
GLOBAL_BATCH = WORLD_SIZE * NUM_MICROBATCHES * MICRO_BATCH_SIZE
SEED = 1234
# Megatron applies wd_mult (no decay for biases/norms) only through its OptimizerParamScheduler;
# without one every parameter group decays with `weight_decay`, and so does the reference.
ADAM = dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8)
CLIP_GRAD = 1.0
BUCKET_SIZE = 4000  # elements: the ~30k-parameter model is split into several buckets
TOLERANCE = 1e-5


def train_megatron(rank, world_size, use_distributed_optimizer, instances):
    import gpt_utils
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    gpt_utils.init_parallel_state(num_distributed_optimizer_instances=instances)
    model = gpt_utils.wrap_ddp(
        gpt_utils.build_tiny_gpt(SEED),
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=True,
        overlap_param_gather=use_distributed_optimizer,
        num_distributed_optimizer_instances=instances,
        bucket_size=BUCKET_SIZE,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=ADAM["lr"],
            weight_decay=ADAM["weight_decay"],
            adam_beta1=ADAM["betas"][0],
            adam_beta2=ADAM["betas"][1],
            adam_eps=ADAM["eps"],
            clip_grad=CLIP_GRAD,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        [model],
    )
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    batches = gpt_utils.make_batches(NUM_STEPS, GLOBAL_BATCH)
    losses = []
    for step in range(NUM_STEPS):
        mine = gpt_utils.rank_micro_batches(batches[step], dp_rank, dp_size, NUM_MICROBATCHES)
        losses.append(gpt_utils.train_step(model, optimizer, mine))
    if use_distributed_optimizer:
        # overlap_param_gather defers the all-gather of updated shards to the next forward.
        model.start_param_sync(force_sync=True)
    # The ranks sharding one instance (every megatron-core release has this getter).
    intra = parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    return dict(
        params=gpt_utils.named_params(model),
        losses=losses,
        num_buckets=sum(len(buffer.buckets) for buffer in model.buffers),
        intra_instance_size=torch.distributed.get_world_size(intra),
    )


def train_reference(rank, world_size):
    import gpt_utils

    gpt_utils.init_parallel_state()
    model = gpt_utils.build_tiny_gpt(SEED)
    initial = gpt_utils.named_params(model)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAM)
    batches = gpt_utils.make_batches(NUM_STEPS, GLOBAL_BATCH)
    losses = []
    for step in range(NUM_STEPS):
        optimizer.zero_grad()
        loss = model(**gpt_utils.gpt_inputs(batches[step])).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
        optimizer.step()
        losses.append(loss.item())
    return dict(params=gpt_utils.named_params(model), initial=initial, losses=losses)

"""Tiny-GPT building blocks for multi-rank tests on real megatron-core (CPU/gloo).

Everything here runs inside a rank started by ``dist.run_ranks`` (so the CPU adapter is active
and a gloo process group exists). The model is megatron's own ``GPTModel`` with the local layer
spec: 2 layers, hidden 32, 4 heads, vocab 64, sequence 16, fp32, no dropout.
"""

import torch

from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

SEQ_LENGTH = 16
VOCAB_SIZE = 64


def init_parallel_state(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    num_distributed_optimizer_instances=1,
    **kwargs,
):
    """Initialize megatron's parallel_state on the already-initialized default process group
    (``kwargs`` go to ``parallel_state.initialize_model_parallel`` unchanged)."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        **kwargs,
    )


def tiny_gpt_config(**overrides) -> TransformerConfig:
    """The tiny fp32, dropout-free TransformerConfig; ``overrides`` replace any field."""
    fields = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Megatron's CPU init path: the full weight is drawn from the CPU generator and this TP
        # rank's slice kept, so init does not depend on TP size (and skips the RNG-tracker fork,
        # which on CPU would log "CPU RNG state changed" for every layer).
        use_cpu_initialization=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
    )
    if overrides.get("num_moe_experts"):
        fields.update(expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
                      expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size())
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_tiny_gpt(seed=1234, **config_overrides) -> GPTModel:
    """A GPTModel whose initial weights depend only on ``seed`` (needs parallel_state set up);
    MoE when ``config_overrides`` has ``num_moe_experts``.

    Seeds both the model-parallel RNG tracker and the CPU generator (on CPU, weight init draws
    from the latter), so any rank or a world-size-1 process gets identical weights.
    """
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = tiny_gpt_config(**config_overrides)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
    )


class SequenceParallelNorm(torch.nn.LayerNorm):
    """torch's LayerNorm, marked for Megatron's sequence parallelism (its gradients are
    all-reduced over the tensor-parallel group by ``finalize_model_grads``): the local spec's
    norm refuses sequence parallelism, which MoE with tensor parallelism requires."""

    def __init__(self, config, hidden_size, eps=1e-5):
        super().__init__(hidden_size, eps=eps)
        for param in self.parameters():
            param.sequence_parallel = config.sequence_parallel


def layer_spec(config):
    """The local layer spec; a MoE one (sequential experts) when ``config.num_moe_experts``;
    with sequence parallelism, a block spec whose norms are :class:`SequenceParallelNorm`."""
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    if not config.sequence_parallel:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    spec.submodules.input_layernorm = SequenceParallelNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=SequenceParallelNorm)


def wrap_ddp(model, **ddp_overrides) -> DistributedDataParallel:
    """Wrap ``model`` in megatron DDP and wire its hooks into the model config the way
    Megatron-LM's training loop does (no_sync, finalize_model_grads)."""
    ddp_config = DistributedDataParallelConfig(**ddp_overrides)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def make_batches(num_steps, num_samples, seed=0) -> torch.Tensor:
    """Deterministic token ids ``[num_steps, num_samples, SEQ_LENGTH + 1]`` (inputs + next token).

    Uses a private generator, so it neither reads nor advances the global RNG.
    """
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(
        0, VOCAB_SIZE, (num_steps, num_samples, SEQ_LENGTH + 1), generator=generator
    )


def gpt_inputs(tokens) -> dict:
    """Keyword arguments for ``GPTModel.forward`` from ``[b, SEQ_LENGTH + 1]`` token ids.

    The local spec's attention is causal, so no explicit mask is needed.
    """
    inputs = tokens[:, :-1].contiguous()
    position_ids = torch.arange(inputs.shape[1], device=inputs.device).unsqueeze(0).expand_as(inputs)
    return dict(
        input_ids=inputs,
        position_ids=position_ids,
        attention_mask=None,
        labels=tokens[:, 1:].contiguous(),
    )


def _mean_loss(per_token_loss):
    loss = per_token_loss.float().mean()
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    """``forward_step_func`` for ``get_forward_backward_func``: batches are token tensors.

    GPTModel returns the per-token loss ``[b, s]`` when given labels; the loss function averages
    it over the micro-batch (megatron then divides by the number of micro-batches and DDP averages
    over data-parallel ranks, so the gradient is that of the mean over all micro-batches).
    """
    return model(**gpt_inputs(next(data_iterator))), _mean_loss


def train_step(model, optimizer, micro_batches, before_step=None, skipped=None) -> float:
    """One Megatron training step on this rank's micro-batches ``[n, b, SEQ_LENGTH + 1]``.

    Mirrors Megatron-LM's ``train_step``: zero the grad buffers, forward/backward through the
    schedule (which calls ``finalize_model_grads``), optimizer step. Returns this rank's mean loss.
    ``before_step()`` runs between the backward pass and the optimizer step; a step the optimizer
    skips (a loss scaler found an inf) fails the step unless ``skipped`` (a list) is given, which
    then gets True or False appended.
    """
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=SEQ_LENGTH,
        micro_batch_size=micro_batches.shape[1],
        forward_only=False,
    )
    if before_step is not None:
        before_step()
    update_successful, _, _ = optimizer.step()
    if skipped is None:
        assert update_successful
    else:
        skipped.append(not update_successful)
    if not losses:  # not the last pipeline stage: no loss here
        return float("nan")
    return sum(d["lm loss"].item() for d in losses) / len(losses)


def rank_micro_batches(batch, dp_rank, dp_size, num_microbatches=1):
    """This data-parallel rank's ``[num_microbatches, b, SEQ_LENGTH + 1]`` slice of a global batch
    ``[num_samples, SEQ_LENGTH + 1]`` (rank r takes the r-th contiguous block of samples)."""
    per_rank = batch.shape[0] // dp_size
    mine = batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    return mine.reshape(num_microbatches, per_rank // num_microbatches, *mine.shape[1:])


def named_params(module) -> dict:
    """``{name: detached CPU copy}`` of a module's parameters (unwraps DDP's ``.module``)."""
    module = getattr(module, "module", module)
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def global_param_name(name, num_local_experts=None, ep_rank=0) -> str:
    """A parameter's name in the whole model: a local expert's number becomes its global one
    (expert parallelism: rank r holds experts r x local .. (r + 1) x local - 1)."""
    import re

    name = name[len("module."):] if name.startswith("module.") else name
    if num_local_experts is None:
        return name
    return re.sub(r"(\.local_experts\.)(\d+)\.",
                  lambda m: f"{m.group(1)}{int(m.group(2)) + ep_rank * num_local_experts}.", name)


def reinit_by_global_name(model, seed=1234) -> None:
    """Overwrite every parameter with values drawn from its global name (and this rank's
    tensor-parallel slice of the full tensor): the same model whatever the tensor- and
    expert-parallel layout (Megatron's own init draws experts from one generator in build order,
    so expert parallelism would change every weight after the first MoE layer)."""
    import zlib

    from megatron.core import parallel_state as ps

    module = getattr(model, "module", model)
    experts = module.config.num_moe_experts
    ep = ps.get_expert_model_parallel_world_size() if experts else 1
    local = experts // ep if experts else None
    ep_rank = ps.get_expert_model_parallel_rank() if experts else 0
    with torch.no_grad():
        for name, param in module.named_parameters():
            full_name = global_param_name(name, local, ep_rank)
            generator = torch.Generator().manual_seed(seed + zlib.crc32(full_name.encode()))
            shape, dim = list(param.shape), getattr(param, "partition_dim", -1)
            split = getattr(param, "tensor_model_parallel", False) and dim >= 0
            if split:
                if ".experts." in full_name:
                    tp, tp_rank = (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank())
                else:
                    tp, tp_rank = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank())
                shape[dim] *= tp
            full = torch.randn(shape, generator=generator) * 0.02
            if param.dim() == 1 and "norm" in name and name.endswith("weight"):
                full += 1.0
            param.copy_(full.chunk(tp, dim)[tp_rank] if split else full)

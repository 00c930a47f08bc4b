"""megatron_edit.mcore.shards: naming the layer of a Megatron parameter."""

from megatron_edit.mcore.shards import layer_key


def test_layer_key_groups_parameters_by_transformer_layer():
    assert layer_key("module.decoder.layers.3.self_attention.linear_qkv.weight") == "decoder.layers.3"
    assert layer_key("decoder.layers.12.mlp.linear_fc1.bias") == "decoder.layers.12"
    assert layer_key("module.module.embedding.word_embeddings.weight") == "embedding.word_embeddings"
    assert layer_key("output_layer.weight") == "output_layer"


def test_layer_key_makes_a_moe_layers_routed_experts_one_layer():
    """MoE: a layer's routed experts are one layer of their own (every expert, every expert
    implementation, local expert numbers never enter); the router and the shared experts stay
    with their transformer layer."""
    experts = "decoder.layers.1.mlp.experts"
    for name in ("module.decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
                 "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.bias",
                 "decoder.layers.1.mlp.experts.weight1",  # GroupedMLP
                 "decoder.layers.1.mlp.experts.linear_fc1.weight0"):  # TEGroupedMLP
        assert layer_key(name) == experts, name
    assert layer_key("decoder.layers.1.mlp.router.weight") == "decoder.layers.1"
    assert layer_key("decoder.layers.1.mlp.shared_experts.linear_fc1.weight") == "decoder.layers.1"
    assert layer_key("decoder.layers.10.mlp.experts.local_experts.0.linear_fc1.weight") == "decoder.layers.10.mlp.experts"

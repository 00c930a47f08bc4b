"""megatron_edit.mcore.shards: naming the layer of a Megatron parameter."""

from megatron_edit.mcore.shards import layer_key


def test_layer_key_groups_parameters_by_transformer_layer():
    assert layer_key("module.decoder.layers.3.self_attention.linear_qkv.weight") == "decoder.layers.3"
    assert layer_key("decoder.layers.12.mlp.linear_fc1.bias") == "decoder.layers.12"
    assert layer_key("module.module.embedding.word_embeddings.weight") == "embedding.word_embeddings"
    assert layer_key("output_layer.weight") == "output_layer"

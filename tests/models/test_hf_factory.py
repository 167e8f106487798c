"""The HF checkpoint factory: meta skeleton, config overrides, sharded checkpoints."""

import json

import torch

import autodeploy
from autodeploy.models import HFCheckpointFactory
from tiny_models import hf_reference, random_batch, save_tiny_checkpoint


def test_skeleton_is_on_meta_device(tiny_checkpoint):
    model = HFCheckpointFactory(tiny_checkpoint("llama")).build_model()
    assert all(p.is_meta for p in model.parameters())


def test_model_kwargs_override_config(tiny_checkpoint):
    factory = HFCheckpointFactory(tiny_checkpoint("llama"), model_kwargs={"num_hidden_layers": 1})
    assert factory.get_config().num_hidden_layers == 1
    assert len(factory.build_model().model.layers) == 1


def test_sharded_checkpoint_loads(tmp_path):
    path = tmp_path / "sharded"
    save_tiny_checkpoint(path, "qwen2")
    # re-save in several shards with an index.json, as large checkpoints come
    reference = hf_reference(path)
    sharded = tmp_path / "sharded2"
    reference.save_pretrained(sharded, max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    gm = autodeploy.optimize(sharded, until="weight_load")
    input_ids, position_ids = random_batch(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(
            gm(input_ids, position_ids)[0], reference(input_ids=input_ids, position_ids=position_ids).logits,
            atol=1e-4, rtol=0,
        )


def test_truncated_model_with_num_hidden_layers_override(tiny_checkpoint):
    """A common debugging workflow: load only the first layer(s) of a checkpoint."""
    path = tiny_checkpoint("llama")
    gm = autodeploy.optimize(path, until="weight_load", overrides={"model_kwargs.num_hidden_layers": 1})
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(path, num_hidden_layers=1, dtype=torch.float32).eval()
    input_ids, position_ids = random_batch(1, 6)
    with torch.no_grad():
        torch.testing.assert_close(
            gm(input_ids, position_ids)[0], reference(input_ids=input_ids, position_ids=position_ids).logits,
            atol=1e-4, rtol=0,
        )

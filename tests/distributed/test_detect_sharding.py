"""detect_sharding on canonical graphs, in one process: which regions split how for each rank, what stays
replicated (and why), and the plans by module name. The split graphs themselves run in
test_tensor_parallel.py."""

import pytest
import torch

import autodeploy
from autodeploy.errors import ConfigError
from autodeploy.transform.library.sharding import DetectShardingConfig, detect
from tiny_models import _COMMON, save_tiny_checkpoint


def _canonical(path):
    return autodeploy.optimize(path, until="pattern_matcher")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _canonical(save_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama"))


def _config(**fields):
    return DetectShardingConfig(stage="sharding", **fields)


def _splits(plan, kind):
    return [r.splits for r in plan.regions if r.kind == kind]


def test_attention_and_mlp_split_in_whole_heads(llama):
    # tiny llama: 4 heads, 2 kv heads, head_dim 16, intermediate 96, 2 layers
    for rank in (0, 1):
        plan = detect(llama, _config(), rank, 2, None)
        assert plan.summary() == "attention x2 split, mlp x2 split"
        (q, k, v, o), _ = _splits(plan, "attention")
        assert (q.style, q.start, q.end, q.role) == ("colwise", rank * 32, rank * 32 + 32, "opener")
        assert (k.start, k.end) == (v.start, v.end) == (rank * 16, rank * 16 + 16)  # one kv head each
        assert (o.style, o.start, o.end, o.role) == ("rowwise", rank * 32, rank * 32 + 32, "closer")
        gate, up, down = _splits(plan, "mlp")[0]
        assert {gate.style, up.style} == {"colwise"} and (gate.start, gate.end) == (rank * 48, rank * 48 + 48)
        assert (down.style, down.role) == ("rowwise", "closer")


def test_more_ranks_than_kv_heads_replicate_the_kv_head_of_the_ranks_queries(llama):
    kv = [_splits(detect(llama, _config(), rank, 4, None), "attention")[0][1] for rank in range(4)]
    assert [(k.start, k.end) for k in kv] == [(0, 16), (0, 16), (16, 32), (16, 32)]  # q heads 0,1 use kv head 0


def test_nothing_splits_by_three_heads_stays_replicated_and_mlp_splits(llama):
    plan = detect(llama, _config(), 0, 3, None)  # 4 heads do not divide by 3; 96 intermediate does
    assert plan.summary() == "mlp x2 split, attention x2 replicated"


def test_a_norm_over_all_heads_keeps_attention_replicated(tmp_path):
    """OLMo-2 normalizes q and k over all heads at once: splitting by heads would change it."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Olmo2Config(**_COMMON)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    plan = detect(_canonical(tmp_path), _config(), 0, 2, None)
    assert plan.summary() == "mlp x2 split, attention x2 replicated"


def test_ep_partitions_experts_remainder_to_the_last_rank(tmp_path):
    path = save_tiny_checkpoint(tmp_path, "mixtral", num_local_experts=5)
    gm = _canonical(path)
    ranges = [[r.moe[1:] for r in detect(gm, _config(), rank, 2, None).regions if r.kind == "moe"] for rank in (0, 1)]
    assert ranges == [[(0, 2), (0, 2)], [(2, 5), (2, 5)]]
    plan = detect(gm, _config(sharding_dims=["tp"]), 0, 2, None)
    assert "moe" not in plan.summary()


def test_plans_by_module_name(llama):
    # the model config's own plan (llama's) gives exactly the heuristic's regions
    factory = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
               "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
               "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
               "layers.*.mlp.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts"}
    assert detect(llama, _config(), 0, 2, factory).summary() == "attention x2 split, mlp x2 split"
    # a manual plan that disagrees with a region's roles splits those products on their own
    manual = {"tp_plan": {"layers.*.mlp.down_proj": "colwise"}}
    plan = detect(llama, _config(manual_config=manual, support_partial_config=False), 0, 2, None)
    assert plan.summary() == "product x2 split, attention x2 replicated"
    assert {s.style for r in plan.regions for s in r.splits} == {"colwise"}
    with pytest.raises(ConfigError, match=r"'layers\.\*\.mlp\.dwn_proj' names no product.*nearest"):
        detect(llama, _config(manual_config={"tp_plan": {"layers.*.mlp.dwn_proj": "rowwise"}}), 0, 2, None)


def test_simple_shard_only_splits_every_product_by_columns(llama):
    plan = detect(llama, _config(simple_shard_only=True), 1, 2, None)
    assert {r.kind for r in plan.regions} == {"product"}
    assert {s.style for r in plan.regions for s in r.splits} == {"gather"}
    assert len(plan.regions) == 15  # 7 products per layer and the LM head


def test_a_model_that_nothing_splits_for_is_an_error(llama):
    from autodeploy.transform import PipelineContext, TransformRegistry

    transform = TransformRegistry.get("detect_sharding")(_config())
    with pytest.raises(ConfigError, match="world_size=5.*nothing"):
        transform(llama, PipelineContext(world_size=5, rank=0))


def test_bmm_with_a_weight_splits_on_its_batch_dim(monkeypatch):
    """A batched matmul against a graph weight: each rank takes its batch entries of both operands, and an
    all-gather on dim 0 puts the result back together (structure here; numerics need the ranks)."""
    from autodeploy.custom_ops import distributed
    from autodeploy.transform import PipelineContext, TransformRegistry
    from helpers import export_gm

    class Batched(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 8, 6))

        def forward(self, x):
            return torch.bmm(x, self.w)

    gm = export_gm(Batched(), torch.randn(4, 3, 8))
    plan = detect(gm, _config(), 1, 2, None)
    assert [(r.kind, r.splits[0].start, r.splits[0].end) for r in plan.regions] == [("bmm", 2, 4)]
    monkeypatch.setattr(distributed, "world_size", lambda: 2)  # what the fake all-gather sees in a 2-rank group
    ctx = PipelineContext(world_size=2, rank=1)
    ctx.extras["sharding"] = plan
    executor = TransformRegistry.get("sharding_transform_executor")
    gm = executor(executor.get_config_class()(stage="sharding"))(gm, ctx)
    assert gm.get_parameter("w").shape == (2, 8, 6)
    assert gm.meta["sharding"]["slices"] == {"w": (0, 2, 4)}
    (gather,) = gm.graph.find_nodes(op="call_function", target=torch.ops.auto_deploy.torch_dist_all_gather.default)
    assert gather.args[1] == 0 and tuple(gather.meta["val"].shape) == (4, 3, 6)


def test_world_size_below_one_is_a_config_error():
    from autodeploy.config import load_config

    with pytest.raises(ConfigError, match="world_size"):
        load_config(overrides={"world_size": 0})

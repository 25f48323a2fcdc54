"""Bad input gets a clear error that names the argument, before any compute."""
import pytest
import torch

import compiled_grpo as cg
from helpers import make_inputs


def _inp(**over):
    inp = make_inputs(dtype=torch.float32)
    inp.update(over)
    return inp


@pytest.mark.parametrize("field,value,match", [
    ("loss_type", "ppo", "loss_type"),
    ("importance_sampling_level", "doc", "importance_sampling_level"),
    ("kl_estimator", "k4", "kl_estimator"),
    ("temperature", 0.0, "temperature"),
    ("temperature", -1.0, "temperature"),
    ("epsilon_low", -0.1, "epsilon_low"),
    ("epsilon_low", 1.0, "epsilon_low"),
    ("epsilon_low", 2.5, "epsilon_low"),
    ("beta", float("nan"), "beta"),
    ("delta", 0.0, "delta"),
    ("log_ratio_clamp", -1.0, "log_ratio_clamp"),
    ("grad_divisor", 0.0, "grad_divisor"),
    ("max_completion_length", 0, "max_completion_length"),
    ("sapo_temperature_neg", 0.0, "sapo_temperature_neg"),
    ("logit_scale", 0.0, "logit_scale"),
    ("logit_scale", float("inf"), "logit_scale"),
    ("final_logit_softcapping", -30.0, "final_logit_softcapping"),
    ("final_logit_softcapping", True, "final_logit_softcapping"),
    ("metrics", "fancy", "metrics"),
    ("metrics", ("basic", "with_entropy"), "metrics"),
    ("fp32_lm_head", 1, "fp32_lm_head"),
    ("fused_scaled_backward", 1, "fused_scaled_backward"),
    ("loss_type", "VESPO", "loss_type"),
    ("vespo_k_pos", float("nan"), "vespo_k_pos"),
    ("vespo_k_neg", None, "vespo_k_neg"),
    ("vespo_lambda_pos", -1.0, "vespo_lambda_pos"),
    ("vespo_lambda_neg", "2", "vespo_lambda_neg"),
    ("off_policy_mask_threshold", float("inf"), "off_policy_mask_threshold"),
    ("top_entropy_quantile", 1.5, "top_entropy_quantile"),
    ("top_entropy_quantile", -0.1, "top_entropy_quantile"),
    ("vllm_importance_sampling_correction", 1, "vllm_importance_sampling_correction"),
    ("vllm_importance_sampling_mode", "token", "vllm_importance_sampling_mode"),
    ("vllm_importance_sampling_clip_min", -0.5, "vllm_importance_sampling_clip_min"),
    ("vllm_importance_sampling_clip_max", float("nan"), "vllm_importance_sampling_clip_max"),
])
def test_config_field_errors(field, value, match):
    with pytest.raises(ValueError, match=match):
        cg.GRPOConfig(**{field: value})


def test_dr_grpo_needs_max_completion_length():
    with pytest.raises(ValueError, match="max_completion_length"):
        cg.GRPOConfig(loss_type="dr_grpo")


@pytest.mark.parametrize("loss_type", ("cispo", "sapo"))
def test_sequence_level_accepted_for_cispo_and_sapo(loss_type):
    """TRL 1.16 allows it (its loss against TRL's: tests/test_trl_options.py); Liger refuses it."""
    cg.GRPOConfig(loss_type=loss_type, importance_sampling_level="sequence")


def test_beta_without_ref_logprobs():
    with pytest.raises(ValueError, match="ref_logprobs"):
        cg.grpo_loss(**_inp(ref_logprobs=None), config=cg.GRPOConfig(beta=0.04))


@pytest.mark.parametrize("name,value,exc", [
    ("hidden", torch.randn(3, 7), ValueError),
    ("hidden", torch.randn(3, 7, 16).long(), TypeError),
    ("weight", torch.randn(37, 15), ValueError),
    ("weight", torch.randn(37), ValueError),
    ("token_ids", torch.zeros(3, 6, dtype=torch.long), ValueError),
    ("token_ids", torch.zeros(3, 7), TypeError),
    ("advantages", torch.randn(4), ValueError),
    ("advantages", torch.randn(3, 6), ValueError),
    ("advantages", torch.zeros(3, dtype=torch.long), TypeError),
    ("mask", torch.ones(3, 6, dtype=torch.bool), ValueError),
    ("old_logprobs", torch.randn(3, 6), ValueError),
    ("ref_logprobs", torch.randn(7, 3), ValueError),
    ("mask", [[1] * 7] * 3, TypeError),
])
def test_tensor_argument_errors(name, value, exc):
    with pytest.raises(exc, match=name):
        cg.grpo_loss(**_inp(**{name: value}), config=cg.GRPOConfig(beta=0.04))


def test_trl_option_cross_field_errors():
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_min"):   # TRL: min < max
        cg.GRPOConfig(vllm_importance_sampling_clip_min=3.0)
    with pytest.raises(ValueError, match="vllm_importance_sampling_clip_max"):   # TRL: truncate needs a bound
        cg.GRPOConfig(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None)
    cg.GRPOConfig(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None,
                  vllm_importance_sampling_correction=False)
    cg.GRPOConfig(loss_type="vespo", off_policy_mask_threshold=-0.1, top_entropy_quantile=0.0)


def test_sampling_inputs_errors():
    inp = _inp()
    samp = inp["old_logprobs"].clone()
    with pytest.raises(ValueError, match="sampling_per_token_logps"):   # the IS weight twice
        cg.grpo_loss(**inp, sampling_ratio=torch.ones(3, 7), sampling_per_token_logps=samp)
    cg.grpo_loss(**inp, sampling_ratio=torch.ones(3, 7), sampling_per_token_logps=samp,
                 config=cg.GRPOConfig(vllm_importance_sampling_correction=False, off_policy_mask_threshold=0.1))
    with pytest.raises(ValueError, match="sampling_per_token_logps"):
        cg.grpo_loss(**inp, sampling_per_token_logps=samp[:, :3])
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):   # TRL: vespo needs token_*
        cg.grpo_loss(**inp, sampling_per_token_logps=samp, config=cg.GRPOConfig(loss_type="vespo"))
    with pytest.raises(ValueError, match="sampling_ratio"):
        cg.grpo_loss(**inp, sampling_ratio=torch.ones(3, 1), config=cg.GRPOConfig(loss_type="vespo"))


def test_keyword_argument_errors():
    inp = _inp()
    with pytest.raises(ValueError, match="bias"):
        cg.grpo_loss(**inp, bias=torch.randn(36))
    with pytest.raises(ValueError, match="sampling_ratio"):
        cg.grpo_loss(**inp, sampling_ratio=torch.ones(3, 2))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        cg.grpo_loss(**inp, num_items_in_batch=-1)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        cg.grpo_loss(**inp, num_items_in_batch=torch.ones(2))
    with pytest.raises(TypeError, match="config"):
        cg.grpo_loss(**inp, config={"beta": 0.0})


@pytest.mark.parametrize("bad_id", (-1, 37, 10**6))
def test_token_id_out_of_range(bad_id):
    inp = _inp()
    inp["token_ids"] = inp["token_ids"].clone()
    inp["token_ids"][0, 0] = bad_id  # position (0, 0) is always valid in make_inputs
    with pytest.raises(ValueError, match="token_ids"):
        cg.grpo_loss(**inp)
    with pytest.raises(ValueError, match="token_ids"):
        cg.token_logprobs(inp["hidden"], inp["weight"], inp["token_ids"])


def test_token_id_out_of_range_at_masked_position_is_fine():
    inp = _inp()
    inp["mask"] = inp["mask"].clone()
    inp["mask"][2, 3] = False
    inp["token_ids"] = inp["token_ids"].clone()
    inp["token_ids"][2, 3] = -100
    assert torch.isfinite(cg.grpo_loss(**inp).loss)


def test_token_id_range_is_checked_under_compile():
    inp = _inp()
    inp["token_ids"] = inp["token_ids"].clone()
    inp["token_ids"][0, 0] = 37
    f = torch.compile(cg.grpo_loss, backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="token_ids"):
        f(**inp)


def test_device_mismatch():
    inp = _inp()
    inp["mask"] = inp["mask"].to("meta")
    with pytest.raises(ValueError, match="mask"):
        cg.grpo_loss(**inp)


def test_token_logprobs_errors():
    h, w = torch.randn(2, 3, 8), torch.randn(11, 8)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        cg.token_logprobs(h, w, ids, temperature=0.0)
    with pytest.raises(ValueError, match="logit_scale"):
        cg.token_logprobs(h, w, ids, logit_scale=-1.0)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        cg.token_logprobs(h, w, ids, final_logit_softcapping=0.0)
    with pytest.raises(ValueError, match="token_ids"):
        cg.token_logprobs(h, w, ids[:, :2])
    with pytest.raises(ValueError, match="weight"):
        cg.token_logprobs(h, w[:, :7], ids)


def test_unknown_or_reserved_metric_names():
    with pytest.raises(ValueError, match="metric name"):
        cg.metric("basic")
    with pytest.raises(ValueError, match="metric name"):
        cg.metric("entropy")


def test_bad_argument_under_fullgraph_compile_is_a_dynamo_error_carrying_the_message():
    """docs/errors-and-edge-cases.md: under torch.compile(fullgraph=True) a bad argument surfaces as Dynamo's
    Unsupported (a RuntimeError, torch._dynamo.exc.TorchDynamoException), whose __cause__ carries
    the library's ValueError message; eager, or compiled without fullgraph, it is the ValueError."""
    import torch._dynamo
    h, w = torch.randn(2, 3, 4), torch.randn(5, 4)
    ids = torch.zeros(2, 3, dtype=torch.long)
    fn = lambda h, w, ids, m: cg.token_logprobs(h, w, ids, mask=m).logprobs  # noqa: E731
    with pytest.raises(torch._dynamo.exc.TorchDynamoException) as info:
        torch.compile(fn, fullgraph=True)(h, w, ids, torch.ones(2, 4))
    assert "mask must have the shape of token_ids" in str(info.value.__cause__)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="mask must have the shape of token_ids"):
        torch.compile(fn)(h, w, ids, torch.ones(2, 4))

"""Property tests (hypothesis): random shapes and configs against the float64 golden transcription."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import compiled_grpo as cg
from helpers import golden_loss, make_inputs

CONFIGS = st.fixed_dictionaries({
    "loss_type": st.sampled_from(("grpo", "bnpo", "dr_grpo", "dapo", "luspo")),
    "importance_sampling_level": st.sampled_from(("token", "sequence")),
    "beta": st.sampled_from((0.0, 0.04, 0.5)),
    "kl_estimator": st.sampled_from(("k1", "k2", "k3")),
    "delta": st.sampled_from((None, 1.3, 3.0)),
    "epsilon_low": st.floats(0.0, 0.5),
    "epsilon_high": st.floats(0.0, 0.5),
    "temperature": st.floats(0.3, 2.0),
    "use_bias_correction_kl": st.booleans(),
})


@settings(max_examples=40, deadline=None)
@given(cfg=CONFIGS, B=st.integers(1, 4), T=st.integers(1, 9), V=st.integers(2, 300), seed=st.integers(0, 2**16))
def test_random_config_and_shape_matches_golden(cfg, B, T, V, seed):
    config = cg.GRPOConfig(max_completion_length=T + 2, **cfg)
    inp = make_inputs(B=B, T=T, H=8, V=V, seed=seed, spread=0.5)
    ours = cg.grpo_loss(**inp, config=config)
    gold, _ = golden_loss(**inp, cfg=config)
    gh, gw = torch.autograd.grad(ours.loss, (inp["hidden"], inp["weight"]))
    rh, rw = torch.autograd.grad(gold, (inp["hidden"], inp["weight"]))
    torch.testing.assert_close(ours.loss, gold, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gh, rh, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gw, rw, rtol=1e-9, atol=1e-12)

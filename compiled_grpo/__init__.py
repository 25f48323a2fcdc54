"""compiled_grpo: a torch.compile-native GRPO loss that never materializes [tokens, vocab] logits.

Public contract (README.md's quickstart and docs/): ``grpo_loss``, ``GRPOConfig``, ``GRPOOutput``, ``GRPOMetrics``,
``metric``, and the pure per-token functions ``token_logprobs``, ``importance_ratio``,
``kl_penalty``, ``advantage_stats``, ``policy_objective``, ``aggregate``, and TRL 1.16's options
``sampling_importance_weight``, ``off_policy_mask``, ``high_entropy_mask``, ``vespo_weight`` (``Segments`` /
``segments_from_cu_seqlens`` for packed inputs); ``reference_grpo_loss``
and ``reference_token_logprobs`` define the result every fast path is tested against;
``enable_naive_logprob_fusion`` opts a user's naive ``log_softmax(h @ W.T)`` code under
torch.compile into the fused op (an Inductor pre-grad pass).
"""
from compiled_grpo.api import GRPOOutput, grpo_loss
from compiled_grpo.config import GRPOConfig
from compiled_grpo.logprobs import TokenLogprobs, token_logprobs
from compiled_grpo.loss import (Aggregate, AdvantageStats, ImportanceRatio, KLPenalty, PolicyObjective, Segments,
                                advantage_stats, aggregate, high_entropy_mask, importance_ratio, kl_penalty,
                                off_policy_mask, policy_objective, sampling_importance_weight,
                                segments_from_cu_seqlens, vespo_weight)
from compiled_grpo.metrics import GRPOMetrics, TokenStats, metric
from compiled_grpo.reference import reference_grpo_loss, reference_token_logprobs

__all__ = [
    "GRPOConfig", "GRPOOutput", "GRPOMetrics", "TokenStats", "TokenLogprobs", "grpo_loss", "metric",
    "token_logprobs", "importance_ratio", "kl_penalty", "advantage_stats", "policy_objective", "aggregate",
    "ImportanceRatio", "KLPenalty", "AdvantageStats", "PolicyObjective", "Aggregate",
    "Segments", "segments_from_cu_seqlens",
    "sampling_importance_weight", "off_policy_mask", "high_entropy_mask", "vespo_weight",
    "reference_grpo_loss", "reference_token_logprobs",
    "enable_naive_logprob_fusion", "disable_naive_logprob_fusion", "naive_logprob_fusion",
]

# The naive-fusion pass (lowerings/naive_fusion) imports Inductor's pattern matcher and lowerings,
# which every process (the tests' subprocesses, a trainer's workers) paid at `import compiled_grpo`
# whether or not it ever enables the pass: a fresh import took 7.5-8.2 s on a 2-core CPU with it,
# 5.2-5.6 s without. Its three names load it when first named (PEP 562); nothing in it runs at
# import.
_NAIVE_FUSION = ("enable_naive_logprob_fusion", "disable_naive_logprob_fusion", "naive_logprob_fusion")


def __getattr__(name: str):
    if name in _NAIVE_FUSION:
        from lowerings import naive_fusion
        return getattr(naive_fusion, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_NAIVE_FUSION))

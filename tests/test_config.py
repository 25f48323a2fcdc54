"""GRPOConfig's names against the tables that give them meaning."""


def test_every_loss_type_has_one_rule():
    """config.LOSS_TYPES (the names GRPOConfig accepts) and loss.LOSS_RULES (each one's clip rule
    and divisor) name the same loss types, in the same order."""
    from compiled_grpo.config import LOSS_TYPES
    from compiled_grpo.loss import LOSS_RULES
    assert tuple(LOSS_RULES) == LOSS_TYPES

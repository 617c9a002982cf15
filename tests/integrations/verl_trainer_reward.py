"""Rule-based reward of the verl trainer test (verl's ``reward.custom_reward_function`` hook): the share
of the decoded response's characters that are lowercase letters (``ground_truth`` names that class)."""

import string


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    assert ground_truth == "lowercase", ground_truth
    return sum(c in string.ascii_lowercase for c in solution_str) / max(len(solution_str), 1)

"""Rule-based reward of the verl trainer test (verl's ``reward.custom_reward_function`` hook).

Text runs (``ground_truth`` "lowercase"): the share of the decoded response's characters that are
lowercase letters. Image runs (``data_source`` "image_colour", ``ground_truth`` the image's colour):
the same, a letter of the colour's name counting three times (a random model rarely writes them:
alone they would leave whole steps at reward 0, without advantages)."""

import string


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    if data_source == "image_colour":
        lower = sum(c in string.ascii_lowercase for c in solution_str)
        return (lower + 2 * sum(c in ground_truth for c in solution_str)) / max(len(solution_str), 1)
    assert ground_truth == "lowercase", ground_truth
    return sum(c in string.ascii_lowercase for c in solution_str) / max(len(solution_str), 1)

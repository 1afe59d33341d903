"""DAPO's overlong reward shaping as verl computes it: the reference the overlong tests compare with."""


def dapo_overlong_reward(valid_response_length, max_resp_len, overlong_buffer_len, overlong_penalty_factor):
    """Reference: verl, verl/workers/reward_manager/dapo.py (DAPORewardManager, overlong_buffer enabled)."""
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)

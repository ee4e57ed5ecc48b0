"""Reinforcement learning with group-relative advantages (GRPO) on the treadle client.

`groups` holds what a rollout produces and the pure arithmetic on it (advantages, dropping
constant and stale groups); `datums` turns samples into policy-loss training examples and
measures how far the sampler's logprobs are from the trainer's; `rollouts` samples and grades
groups, either when the step asks (sync) or ahead of training in the background
(overlapped); `train` runs one optimizer step over several forward_backward sub-batches.
The recipe `treadle_cookbook.recipes.math_grpo` shows the loop that joins them.
"""

"""Reinforcement learning with group-relative advantages (GRPO) on the treadle client.

`groups` holds what a rollout produces and the pure arithmetic on it (advantages, dropping
constant and stale groups); `datums` turns samples into policy-loss training examples and
measures how far the sampler's logprobs are from the trainer's; `episodes` says how a group
is played, in one turn or several with the environment answering between them; `rollouts`
samples and grades groups, either when the step asks (sync) or ahead of training in the
background (overlapped); `train` runs one optimizer step over several forward_backward
sub-batches. The recipes `treadle_cookbook.recipes.math_grpo` (one turn) and
`treadle_cookbook.recipes.code_rl` (two turns, a tool call between) show the loop that joins
them.
"""

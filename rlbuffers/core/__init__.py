"""The replay buffer's own parts behind :class:`rlbuffers.ReplayBuffer`: opening and creating a
buffer, gathering sampled rows, frame stacks stored once."""

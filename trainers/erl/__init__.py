"""ERL + TD3 reference trainer (``python -m trainers.erl``): ``train`` (the loop), ``config``
(its flags), ``rollout`` (the actor and the episode job rollout workers import by name),
``evolution`` (selection, crossover, mutation) and ``td3`` (the gradient learner).

This module imports nothing, so that a rollout worker importing ``trainers.erl.rollout`` loads
torch, gymnasium and numpy only."""

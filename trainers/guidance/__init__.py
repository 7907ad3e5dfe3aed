"""Two-turn guidance trainer (hierarchical, ArCHer-style) on a small LM: shared weights, a
placement plan, chunked target updates, every utterance in a replay buffer.

An episode has three utterances: the agent answers a math problem (turn 1), a guidance model
reads the problem and that answer and writes a hint, the agent revises its answer (turn 2); the
reward is turn 1's correctness (1.0 right, 0.0 for a wrong number and for no answer alike
unless ``--partial-credit``; the shared ``trainers.llm.evaluation.correctness``) and turn 2's
improvement on it (``--hint-reward improvement``, the default: -1 for a break, +1 for a fix)
or its correctness (``turn2``); ``--freeze-agent`` keeps the agent's weights fixed.
The learner follows ArCHer (Zhou et al. 2024, "ArCHer: Training Language Model Agents via
Hierarchical Multi-Turn RL", Sec. 4): an utterance-level critic trained off-policy by TD on
utterances sampled from the replay buffer, with a Polyak-averaged target critic, and a
token-level policy gradient for each adapter, plus ``beta * k3`` KL to the reference policy.

Modules: ``config`` (the settings), ``train`` (the loop: ``python -m trainers.guidance``),
``rollout`` (the policies, the episode job rollout workers import, phase 1), ``critic`` (the
double critic, its TD and value losses, advantages), ``policy`` (utterance batches, log-probs,
the policy step, micro-batch plans), ``placement`` (which model on which device), ``data``
(problem order, buffer rows). Output in ``--run-dir``: ``metrics.jsonl``, ``curve.png``,
``buffer/`` (``rlbuffers inspect``), ``ckpt/iteration-N``, ``eval.json``.
"""

"""The critic's verdict term: the verdict is a choice between two continuations (``correct``
/ ``incorrect``, ``formats.VERDICTS``) whose probabilities are known exactly, so it is trained
over both continuations instead of through the one that was sampled.

With ``L_c``, ``L_i`` the summed token log-probs of the two continuations after a critic
prompt, ``p = softmax([L_c, L_i])`` is the verdict distribution the rollout samples from
(``rollout.choose_verdicts``). For an attempt of class ``y`` (the verifier's label) and the
class-balanced rewards ``R_v`` of ``rewards.balanced_verdict_reward`` (``+w_y`` for the
verdict ``y``, ``-w_y`` for the other), the modes (``--verdict-loss``) are:

- ``likelihood`` (default): ``-w_y log p_y``, the class-balanced log-likelihood of the
  verifier's label (a weighted logistic loss: King & Zeng 2001, Sec. 4; how a generative
  verifier's verdict token is trained: Zhang et al. 2024, "Generative Verifiers: Reward
  Modeling as Next-Token Prediction"). Its gradient ``-w_y p_o (grad L_y - grad L_o)``
  (``o`` the other verdict) does not vanish while the critic is confidently wrong;
- ``expected``: ``-E_p[R] = -(p_c R_c + p_i R_i)``, the exact policy gradient of the
  expected balanced reward over both actions (an all-action estimator: Sutton et al. 2000,
  policy gradient theorem; Petit et al. 2019, "All-Action Policy Gradient Methods"). Its
  gradient ``-(R_c - R_i) p_c p_i (grad L_c - grad L_i)`` is the sampled verdict's expected
  one without its variance, but it shrinks with ``p_c p_i``: a critic saying "correct" with
  p = 0.03 moves 30x slower than at p = 0.5;
- ``sampled``: no verdict term; the sampled verdict's tokens carry the balanced reward in the
  critic's policy gradient like any other token (with K verdicts per attempt drawn at p =
  0.03, nearly every group is flat and its advantage 0).

Both terms are a linear combination of ``grad L_c`` and ``grad L_i`` with weights computed at
rollout (the behaviour policy's ``p``), so the update adds the two continuations as
completions of the critic's batch with per-token advantages ``A_c``, ``A_i`` (the weights
above) and a per-token weight of ``coef / M`` (a sum over the continuation's tokens, a mean
over the ``M`` judged attempts): on the update's first pass (ratio 1) the clipped surrogate's
gradient is exactly the term's. The sampled completions' verdict tokens then get weight 0
(the term trains the verdict) and their reason's advantage comes from its format and length
rewards (``rollout``)."""

from __future__ import annotations

import numpy as np

#: ``--verdict-loss`` choices.
MODES = ("likelihood", "expected", "sampled")


def verdict_advantages(logprobs: np.ndarray, truth: np.ndarray, rate: float, mode: str
                       ) -> np.ndarray:
    """float32[M, 2]: the per-token advantages ``(A_c, A_i)`` of the two verdict
    continuations of each judged attempt (module docstring).

    ``logprobs``: float64[M, 2], ``(L_c, L_i)`` per attempt (``rollout.verdict_logprobs``);
    ``truth``: bool[M], the attempt was correct; ``rate``: the frequency of correct attempts
    in (0, 1) (``rewards.class_rate``), giving the class weights ``w_y = 1 / (2 freq(y))``.

    Raises:
        ValueError: ``mode`` not ``likelihood`` or ``expected``, ``rate`` outside (0, 1), or
            the shapes disagree.
    """
    if mode not in MODES[:2]:
        raise ValueError(f"mode: expected one of {MODES[:2]}, got {mode!r}")
    if not 0.0 < rate < 1.0:
        raise ValueError(f"rate: expected a class frequency in (0, 1), got {rate}")
    lp, y = np.asarray(logprobs, np.float64), np.asarray(truth, bool)
    if lp.ndim != 2 or lp.shape[1] != 2 or y.shape != (len(lp),):
        raise ValueError(f"logprobs / truth: expected float[M, 2] and bool[M], got "
                         f"{lp.shape} and {y.shape}")
    p_c = 1.0 / (1.0 + np.exp(lp[:, 1] - lp[:, 0]))  # softmax over the two continuations
    p_i = 1.0 - p_c
    w = np.where(y, 0.5 / rate, 0.5 / (1.0 - rate))
    if mode == "likelihood":  # -w_y log p_y: +w_y p_o on y's tokens, -w_y p_o on the other's
        a_c = np.where(y, w * p_i, -w * p_c)
    else:  # -(p_c R_c + p_i R_i), R_c - R_i = +2 w_1 (y) or -2 w_0 (not y)
        a_c = np.where(y, 2.0 * w, -2.0 * w) * p_c * p_i
    return np.stack([a_c, -a_c], 1).astype(np.float32)


def verdict_loss(logprobs: np.ndarray, truth: np.ndarray, rate: float, mode: str
                 ) -> np.ndarray:
    """float64[M]: each judged attempt's verdict loss in ``mode`` (``-w_y log p_y`` or
    ``-(p_c R_c + p_i R_i)``), the value whose gradient :func:`verdict_advantages` weights
    give; for metrics and tests."""
    lp, y = np.asarray(logprobs, np.float64), np.asarray(truth, bool)
    log_p = lp - np.logaddexp(lp[:, :1], lp[:, 1:])
    w = np.where(y, 0.5 / rate, 0.5 / (1.0 - rate))
    if mode == "likelihood":
        return -w * np.where(y, log_p[:, 0], log_p[:, 1])
    p = np.exp(log_p)
    r_c, r_i = np.where(y, w, -w), np.where(y, -w, w)
    return -(p[:, 0] * r_c + p[:, 1] * r_i)

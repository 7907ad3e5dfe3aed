"""ERL's gradient learner: TD3 (Fujimoto, van Hoof & Meger, "Addressing Function Approximation
Error in Actor-Critic Methods", ICML 2018, Algorithm 1), in place of the paper's DDPG."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainers.erl.config import Config
from trainers.erl.rollout import Actor


class TwinCritic(nn.Module):
    """TD3's two Q-networks: (obs [B, obs_dim], action [B, act_dim]) -> (q1 [B], q2 [B])."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: int) -> None:
        super().__init__()

        def q() -> nn.Sequential:
            return nn.Sequential(nn.Linear(obs_dim + act_dim, hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

        self.q1, self.q2 = q(), q()

    def forward(self, obs: torch.Tensor, act: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([obs, act], dim=-1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)


class Learner(nn.Module):
    """The gradient learner: actor, twin critic, their target copies and Adam optimizers
    (``low``/``high``: the env's action box, float32[act_dim])."""

    def __init__(self, obs_dim: int, act_dim: int, cfg: Config, low: np.ndarray,
                 high: np.ndarray) -> None:
        super().__init__()
        self.actor = Actor(obs_dim, act_dim, cfg.hidden, low, high)
        self.critic = TwinCritic(obs_dim, act_dim, cfg.hidden)
        self.actor_target = copy.deepcopy(self.actor).requires_grad_(False)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=cfg.actor_lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=cfg.critic_lr)
        self.updates = 0

    def full_state(self) -> dict[str, Any]:
        """Networks, targets, optimizers and update count, for ``torch.save``."""
        return {"nets": self.state_dict(), "actor_opt": self.actor_opt.state_dict(),
                "critic_opt": self.critic_opt.state_dict(), "updates": self.updates}

    def load_full_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`full_state` returned."""
        self.load_state_dict(state["nets"])
        self.actor_opt.load_state_dict(state["actor_opt"])
        self.critic_opt.load_state_dict(state["critic_opt"])
        self.updates = state["updates"]


def td3_update(learner: Learner, batch: dict[str, np.ndarray], cfg: Config) -> float:
    """One TD3 step on a batch from ``buf.sample`` (``obs``/``next_obs`` float32[B, obs_dim],
    ``action`` float32[B, act_dim], ``reward`` float32[B], ``terminated`` bool[B]): clipped
    double-Q target with target-policy smoothing (Fujimoto et al. 2018, Eq. 14-15); every
    ``policy_delay`` steps a deterministic policy-gradient step on the actor and a Polyak update
    of the targets. Returns the critic loss."""
    obs, act, next_obs = (torch.from_numpy(batch[k]) for k in ("obs", "action", "next_obs"))
    reward = torch.from_numpy(batch["reward"])
    not_done = 1.0 - torch.from_numpy(batch["terminated"]).float()  # truncation is not terminal
    scale = learner.actor.scale
    with torch.no_grad():
        noise = (torch.randn_like(act) * cfg.policy_noise).clamp(-cfg.noise_clip, cfg.noise_clip)
        next_act = learner.actor_target(next_obs) + noise * scale
        next_act = torch.maximum(torch.minimum(next_act, learner.actor.center + scale),
                                 learner.actor.center - scale)
        next_q = torch.min(*learner.critic_target(next_obs, next_act))
        target = reward + cfg.gamma * not_done * next_q
    q1, q2 = learner.critic(obs, act)
    critic_loss = F.mse_loss(q1, target) + F.mse_loss(q2, target)
    learner.critic_opt.zero_grad()
    critic_loss.backward()
    learner.critic_opt.step()
    learner.updates += 1
    if learner.updates % cfg.policy_delay == 0:
        actor_loss = -learner.critic.q1(torch.cat([obs, learner.actor(obs)], -1)).mean()
        learner.actor_opt.zero_grad()
        actor_loss.backward()
        learner.actor_opt.step()
        with torch.no_grad():
            for net, tgt in ((learner.actor, learner.actor_target),
                             (learner.critic, learner.critic_target)):
                for p, tp in zip(net.parameters(), tgt.parameters(), strict=True):
                    tp.lerp_(p, cfg.tau)
    return float(critic_loss.detach())

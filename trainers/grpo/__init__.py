"""GRPO (Group Relative Policy Optimization) on a small causal LM: ``python -m trainers.grpo``
(``train.main``); settings in :mod:`trainers.grpo.config`."""

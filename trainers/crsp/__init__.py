"""CRSP (Cognition via Rewarded Self-Play): a proposer, a solver and a critic, three LoRA
adapters over one causal LM, trained against each other (``python -m trainers.crsp``; see
``trainers/crsp/train.py`` and docs/crsp.md)."""
